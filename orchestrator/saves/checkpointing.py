"""CheckpointCoordinator: the driver's half of the two-phase checkpoint commit.

Phase 1: every rank stages its shard to CPU and returns (``save_checkpoint``: the step's stall), then
writes it in the background; ``wait_checkpoint`` (a call parked on a second actor thread) answers when
the shard is durable. Phase 2: once every rank acked, the driver writes ``manifest.json`` last
(``checkpoints.catalog.commit``). At most one save is in flight; a failure in between leaves a
directory without a manifest, which is never taken as a checkpoint. A save due while the previous one
still writes waits for it, stalling every rank (``checkpoint.when_busy = "wait"``, the default, as
TorchTitan's async saves do), or with "defer" is owed and started at the first step after that one
committed (event ``checkpoint_deferred``): training keeps its pace and the saves slow storage's.

Failures: a save that fails because a rank died or hung is the elastic path's business (the step is
never committed; the rebuild resumes from the previous checkpoint). A save that fails while every
rank is alive is a storage problem (disk full, permissions, a vanished mount): the run stops with
``TrainingFailed`` (exit 1) instead of training on without checkpoints, and committed checkpoints are
left as they are, so running again resumes from the newest one.

Resume: the newest *valid* checkpoint, skipping (with a warning and a ``checkpoint_skipped`` event)
damaged newer ones. It must come from the same model (``model_fingerprint``) and the same global
batch size: the data cursor counts samples of a (seed, epoch) order, and step k trains on samples
[(k-1)*G, k*G), so a different G would skip or repeat samples. Both are checked when the controller
is constructed, before any process group is formed, and are bad input (exit 2) naming the keys.

Ownership: a run has an id, kept across resumes of that run (a resume adopts the id of the checkpoint
it starts from). Every step directory it makes says so (``.owner``, the manifest's ``run_id``), and it
purges, replaces and — after a failure — resumes only its own (or the one it started from). A new
run (``checkpoint.resume = false``) in a directory that holds another run's checkpoints is refused
(exit 2), so it can neither delete them nor silently fall back to them later.

With ``checkpoint.dir`` unset, planned resizes still need to move state between meshes: they use a
private temporary directory on the driver's machine (fine for one node; multi-node runs need a shared
``checkpoint.dir``, which ``elastimesh train`` warns about).

The ranks answer with ``messages.SaveAck`` / ``messages.WriteAck``; the save in flight is a
``PendingSave``. Every call goes through the worker group (no Ray here), so tests drive this
coordinator with a fake group. The coordinator takes the job's ``checkpoint`` and ``elastic`` sections
and a ``JobRecord`` (what each manifest records of the model, the data and the batch, made from those
sections by ``job_record``); ``coordinator_for(cfg, metrics)`` builds all three from a job's config.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

from checkpoints.catalog import (
    BackgroundPurger,
    CheckpointInfo,
    check_checkpoint,
    commit,
    ensure_writable,
    latest_valid,
    list_checkpoints,
    prepare_attempt,
    prepare_step,
)
from checkpoints.errors import CheckpointError
from checkpoints.lease import LeaseHeldError, LeaseLostError, RunLease
from checkpoints.manifest import CheckpointManifest
from checkpoints.safe_pickle import check_metadata_file
from meshspeak.mesh import layer_ranges
from meshspeak.messages import CallOutcome, SaveAck, WriteAck
from meshspeak.rank_calls import RankCalls
from meshspeak.sections import CheckpointConfig, DataConfig, ElasticConfig, JobConfig, config_to_dict
from orchestrator.config.fingerprint import model_diff, model_fingerprint
from orchestrator.errors import TrainingFailed, UserInputError
from orchestrator.recovery.hang_watch import collect_while_alive

logger = logging.getLogger(__name__)


class RestoreFailed(TrainingFailed):
    """Loading a checkpoint into a new generation failed; ``outcome`` says which members died,
    failed or never answered, so the controller can treat a lost member as a failed rebuild."""

    def __init__(self, message: str, outcome=None) -> None:
        super().__init__(message)
        self.outcome = outcome


@dataclass
class PendingSave:
    """Driver side: the one save in flight. Every member staged its shard (``SaveAck``s in); the
    ``wait_checkpoint`` calls in ``refs`` answer with a ``WriteAck`` each once the shard is durable."""

    step: int
    gen: Any  # the controller's GenerationRecord whose members write it
    path: str
    refs: dict  # wait_checkpoint call -> actor id
    stall_s: float  # the slowest member's save call
    attempt: str  # the subdirectory of ``path`` its DCP files go to (manifest ``dcp_dir``)


@dataclass(frozen=True)
class JobRecord:
    """What every manifest records of the job, and what a resume is checked against: the model (its
    config section and fingerprint: another model's checkpoint is refused), the data (its content
    identity, and how a refusal names it) and the global batch (the data cursor counts its samples)."""

    model_config: dict[str, Any]
    model_fingerprint: str
    data_identity: str
    data_named: str  # "data.mix" or "data.path = '...'"
    global_batch_size: int


def job_record(cfg: JobConfig) -> JobRecord:
    """The job's record, from its model, data and train sections."""
    return JobRecord(model_config=config_to_dict(cfg)["model"], model_fingerprint=model_fingerprint(cfg),
                     data_identity=_data_identity(cfg.data),
                     data_named="data.mix" if cfg.data.mix else f"data.path = {cfg.data.path!r}",
                     global_batch_size=cfg.train.global_batch_size)


def check_resumable(info: CheckpointInfo, job: JobRecord) -> None:
    """Refuse (``UserInputError``, naming the keys) a checkpoint ``job`` cannot continue: saved from
    another model config, trained on other data, or with another global batch (its data cursor counts
    samples of that batch). ``resume_point`` checks every resume; ``run_job`` checks the one it would
    resume before Ray and the actors start, so such a bad input costs no cluster start."""
    if info.manifest.model_fingerprint != job.model_fingerprint:
        keys = model_diff({"model": info.manifest.model_config}, {"model": job.model_config})
        raise UserInputError(
            f"checkpoint {info.path} was saved from a different model config "
            f"(mismatching keys: {', '.join(keys) or 'unknown'}): use a new checkpoint.dir or "
            "restore those keys"
        )
    saved_data = info.manifest.data_identity
    if saved_data and saved_data != job.data_identity:
        # Moving the corpus keeps its identity (content, not path); other data would silently
        # change what "sample i" means for the data cursor.
        raise UserInputError(
            f"checkpoint {info.path} was trained on other data than {job.data_named} "
            f"(content {saved_data[:12]} vs {job.data_identity[:12]}): to train this data from its "
            f"weights start a new run: `elastimesh export {info.path} --out WEIGHTS`, then set "
            "checkpoint.init_from = WEIGHTS and a new checkpoint.dir"
        )
    saved_batch, batch = info.manifest.global_batch_size, job.global_batch_size
    if saved_batch != batch:
        raise UserInputError(
            f"checkpoint {info.path} consumed {info.manifest.data_cursor} samples in batches of "
            f"train.global_batch_size={saved_batch}; resuming with {batch} would skip or repeat "
            f"samples: set train.global_batch_size={saved_batch} or use a new checkpoint.dir"
        )


def coordinator_for(cfg: JobConfig, metrics) -> CheckpointCoordinator:
    """The job's checkpoint coordinator: its checkpoint and elastic sections and its record."""
    return CheckpointCoordinator(cfg.checkpoint, cfg.elastic, job_record(cfg), metrics)


class CheckpointCoordinator:
    def __init__(self, checkpoint: CheckpointConfig, elastic: ElasticConfig, job: JobRecord, metrics) -> None:
        self.checkpoint = checkpoint
        self.elastic = elastic  # step_timeout_s, rebuild_timeout_s: how often the ranks' saves and loads are probed
        self.job = job
        self.metrics = metrics
        self.user_dir = checkpoint.dir
        self._tmp = None if self.user_dir else tempfile.mkdtemp(prefix="elastimesh-ckpt-")
        self.root = self.user_dir or self._tmp
        self.every = checkpoint.every if self.user_dir else 0
        self.purger = BackgroundPurger()
        self._pending: PendingSave | None = None
        self.last_committed = 0
        self.save_measured_s: float | None = None  # stage + write of the last commit (preemption budget)
        self.run_id = uuid.uuid4().hex[:12]  # replaced by the resumed checkpoint's run id (_claim_root)
        self._start: CheckpointInfo | None = None  # the checkpoint this run resumed from, if any
        self._reported_skips: set[str] = set()  # damaged checkpoints already warned about
        self._safe: set[str] = set()  # checkpoints whose .metadata passed checkpoints.safe_pickle
        self._abandoned: list = []  # WriteAck call refs of saves dropped by a failure, read once they resolve
        # A save abandoned by a failure, or deferred while another wrote, to be made good (``due``).
        self.owed_step: int | None = None
        self.skipped_steps: set[int] = set()  # bad steps (orchestrator/recovery/bad_steps.py): written, and read back
        self.lease: RunLease | None = None
        if self.user_dir:
            try:
                ensure_writable(self.root)
                self.lease = RunLease(self.root, checkpoint.lease_s)
                self.lease.acquire()  # before reading anything: another live driver may be writing here
            except LeaseHeldError as exc:
                raise UserInputError(exc.message) from None
            except CheckpointError as exc:
                raise UserInputError(f"checkpoint.dir: {exc}") from None
            # Refuse a foreign directory or an alien checkpoint now, before groups are formed.
            try:
                self._claim_root()
                self.resume_point()
            except BaseException:
                self.lease.release()
                raise

    # -- saving -----------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """A save of ``step`` is due: a periodic one, or one owed for a save a failure abandoned (the
        first step trained at or after it, from whatever state the recovery restored) or one deferred
        while another wrote (``_defer``)."""
        return self._periodic(step) or (self.owed_step is not None and step >= self.owed_step)

    def _periodic(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def after_step(self, group, gen, step: int, *, later_sent: bool = False) -> None:
        """The boundary after ``step``: commit the save in flight if it is done, and start one due
        (``due``). ``later_sent``: a later step is in flight already (``wants_empty_window`` said
        the save could not start yet): a save now would take that step's state, so it stays owed."""
        self._reap_abandoned(group)
        writing = self._pending.step if self._pending is not None else None
        self._try_commit(group, block=False)
        if not self.due(step):
            return
        if later_sent or (self._pending is not None and self.checkpoint.when_busy == "defer"):
            self._defer(step, writing)
            return
        self._start_save(group, gen, step)

    def writing(self, group) -> bool:
        """Whether a save is in flight whose writes are not all done (a re-form now would wait for it)."""
        return self._pending is not None and not group.all_done(self._pending.refs)

    def wants_empty_window(self, group, step: int) -> bool:
        """Whether the step after ``step`` must wait until ``step`` was read, for ``step``'s save: it is
        due and can start then (nothing writing, or the write done, or ``when_busy`` "wait"). A
        save that must wait for a slow write does not hold the steps in flight back."""
        if not self.due(step):
            return False
        return self.checkpoint.when_busy == "wait" or not self.writing(group)

    def _defer(self, step: int, writing: int | None) -> None:
        """Save ``step`` is due while the previous save (of step ``writing``) still writes: owe it
        (``due``) instead of stalling every rank until storage catches up, so training keeps its pace
        and the saves theirs (``checkpoint.when_busy``). Every periodic save deferred is said (never
        dropped in silence); a save owed already is made good by one save, once the write committed."""
        if not self._periodic(step):
            return  # due only as the save already owed
        self._owe(step)
        logger.info("checkpoint of step %d deferred: the save of step %s is still writing", step, writing)
        self.metrics.event("checkpoint_deferred", step=step, writing=writing)

    def _owe(self, step: int) -> None:
        """A save of ``step`` (or the first step trained at or after it) is still to be made (``due``)."""
        self.owed_step = step if self.owed_step is None else min(self.owed_step, step)

    def save_now(self, group, gen, step: int) -> None:
        """Commit a checkpoint of ``step`` before a planned resize (skipped if already committed)."""
        self._try_commit(group, block=True)
        if step <= 0 or step == self.last_committed:
            return
        self._start_save(group, gen, step)
        self._try_commit(group, block=True)
        if self.last_committed != step:
            raise TrainingFailed(f"could not checkpoint step {step} before resizing")

    def finish(self, group, gen, step: int) -> None:
        """Commit the save in flight, if any (before a re-form or a load, and at the end)."""
        self._try_commit(group, block=True)
        self._reap_abandoned(group)

    def finish_run(self, group, gen, step: int) -> None:
        """The run trained its last step: commit the save in flight, then save ``step`` itself unless it
        is already committed, so a run whose ``train.steps`` is not a multiple of ``checkpoint.every``
        still ends on a checkpoint of its last step (a rerun resumes at the end, not ``every`` back)."""
        self._try_commit(group, block=True)
        if self.user_dir and step > 0 and step != self.last_committed:
            self._start_save(group, gen, step)
            self._try_commit(group, block=True)
        self._reap_abandoned(group)

    def abandon_pending(self) -> None:
        """A failure ends the generation writing the save in flight: it is never committed, and a save
        is owed instead (``due``), so that no save is lost in silence (a restore from a snapshot past
        its step would otherwise leave the run without it until the next periodic one)."""
        if self._pending is not None:
            logger.warning("checkpoint of step %d abandoned (failure while writing); the first step trained "
                           "at or after it is saved instead", self._pending.step)
            self._abandoned.extend(self._pending.refs)
            if self.user_dir:  # a planned resize's temporary save is not owed: it only moved state
                self._owe(self._pending.step)
        self._pending = None

    def set_aside(self, group, step: int) -> None:
        """A planned re-form that resumes from the in-memory snapshots of ``step`` without waiting for a
        save (a drain, orchestrator/recovery/preemption.py): the save in flight, which
        the draining actors write too, is committed if its writes are done, else abandoned, and a save
        of ``step`` is owed (``due``: made at the new generation's first step boundary) unless it is
        committed. Said in a ``checkpoint_deferred`` event. Without ``checkpoint.dir`` nothing is owed
        (temporary saves only move state, which the snapshots do here)."""
        self._try_commit(group, block=False)  # a save whose every write is done still commits
        writing = self._pending.step if self._pending is not None else None
        if self._pending is not None:
            self._abandoned.extend(self._pending.refs)
            self._pending = None
        if not self.user_dir or step == self.last_committed:
            return
        self._owe(step if writing is None else min(step, writing))
        logger.warning("checkpoint of step %d deferred to after the re-form (a drain re-forms from the "
                       "snapshots)%s", step, "" if writing is None else f"; the save of step {writing} in flight abandoned")
        self.metrics.event("checkpoint_deferred", step=step, writing=writing, reason="drain")

    def _reap_abandoned(self, group) -> None:
        # Read the acks of abandoned saves once they fail, so Ray does not log each as an
        # "Unhandled error" with a traceback: the failure was already reported as one event.
        if self._abandoned:
            self._abandoned = group.drain(self._abandoned)

    def _start_save(self, group, gen, step: int) -> None:
        self._try_commit(group, block=True)  # at most one save in flight
        # Each attempt writes its DCP files into a subdirectory of its own (the generation's), which the
        # manifest names: a write abandoned by a failure (a survivor's thread, a partitioned host's
        # process) can only ever land in its own attempt's directory, never in a later attempt's.
        attempt = f"g{gen.number}"
        if self.owed_step is not None and step >= self.owed_step:
            self.owed_step = None  # this save makes good the one owed (abandoned, not started, deferred)
        try:
            path = prepare_step(self.root, step, run_id=self.run_id)
            dcp_dir = prepare_attempt(path, attempt)
        except CheckpointError as exc:
            self._storage_failed(step, self.root, exc.message)
        calls = group.submit(list(gen.members.values()), RankCalls.save_checkpoint, (dcp_dir, step))
        self._started(group, gen, step, path, calls, attempt)

    def _started(self, group, gen, step: int, path: str, calls: dict, attempt: str) -> None:
        """Phase 1 answered (or will: the calls are read here): park the ``wait_checkpoint`` calls."""
        actors = list(gen.members.values())
        staged = self._collect_while_alive(group, calls, step, "staging")
        if not staged.ok:
            logger.warning("checkpoint of step %d not started: %s", step, staged.failed or staged.dead)
            if staged.failed and not (staged.dead or staged.pending):
                failed = {r: a for r, a in calls.items() if a in staged.failed}
                self._storage_failed(step, path, _first_cause(group, failed, staged.failed))
            if self.user_dir:  # a rank died staging it: made good after the recovery, as an abandoned one
                self._owe(step)
            return
        acks: list[SaveAck] = list(staged.results.values())
        refs = group.submit(actors, RankCalls.wait_checkpoint)
        self._pending = PendingSave(step=step, gen=gen, path=path, refs=refs,
                                    stall_s=max(a.stall_s for a in acks), attempt=attempt)

    def _try_commit(self, group, *, block: bool) -> None:
        pending = self._pending
        if pending is None:
            return
        # Poll: commit as soon as every ack is in, without waiting.
        if not block and not group.all_done(pending.refs):
            return  # still writing; look again after the next step
        outcome = self._collect_while_alive(group, pending.refs, pending.step, "writing")
        self._pending = None
        if outcome.failed and not (outcome.dead or outcome.pending):
            # Every rank is alive and answered, yet the write failed: storage, not a lost rank.
            failed = {r: a for r, a in pending.refs.items() if a in outcome.failed}
            self._storage_failed(pending.step, pending.path, _first_cause(group, failed, outcome.failed))
        if not outcome.ok:
            # A rank died or hung while writing: never committed; the failure path rebuilds.
            logger.warning("checkpoint of step %d not committed: %s", pending.step,
                           outcome.failed or outcome.dead or f"no ack from actors {outcome.pending}")
            self.metrics.event("checkpoint_failed", step=pending.step, path=pending.path,
                               reason=str(outcome.failed or outcome.dead or outcome.pending)[:300])
            return
        gen = pending.gen
        acks: list[WriteAck] = list(outcome.results.values())
        rank_of = {actor: rank for rank, actor in gen.members.items()}
        files: dict[str, int] = {}
        for ack in acks:
            files.update(ack.files)
        manifest = CheckpointManifest(
            step=pending.step,
            generation=gen.number,
            mesh=gen.shape.as_dict(),
            model_fingerprint=self.job.model_fingerprint,
            data_cursor=pending.step * self.job.global_batch_size,
            global_batch_size=self.job.global_batch_size,
            world_size=gen.shape.world,
            ranks_acked=sorted(rank_of[a] for a in outcome.results),
            schedule=gen.plan.schedule_name,
            stage_layers=[list(range(a, b)) for a, b in layer_ranges(list(gen.plan.layers_per_stage))],
            model_config=self.job.model_config,
            data_identity=self.job.data_identity,
            files=files,
            dcp_dir=pending.attempt,
            run_id=self.run_id,
            skipped_steps=sorted(s for s in self.skipped_steps if s <= pending.step),
        )
        self._fence(pending.step)
        try:
            commit(self.root, manifest)
        except CheckpointError as exc:
            self._storage_failed(pending.step, pending.path, exc.message)
        self.last_committed = pending.step
        write_s = max(a.write_s for a in acks)
        # The acks' stall includes any wait for background staging before the next optimizer step.
        stall_s = max([pending.stall_s] + [a.stall_s for a in acks])
        self.save_measured_s = stall_s + write_s
        self.metrics.event("checkpoint", step=pending.step, stall_s=stall_s,
                           write_s=write_s, path=pending.path)
        if self.user_dir:
            self.purger.request(self.root, self.checkpoint.keep, self.run_id)

    def _collect_while_alive(self, group, refs: dict, step: int, what: str) -> CallOutcome:
        """The answers to a save's calls (``what``: "staging", "writing"), waited for as long as the ranks
        still working on them are alive (``recovery.hang_watch.collect_while_alive``): a stage or a write
        slower than ``elastic.step_timeout_s`` (a large model, slow storage) used to be dropped as "no
        ack". A dead, failed or silent rank ends the wait; the save is then not committed, as before."""
        return collect_while_alive(group, refs, self.elastic.step_timeout_s, f"checkpoint of step {step}: {what}")

    def _fence(self, step: int) -> None:
        """Write a manifest (and purge after it) only while this driver holds the run lease: a driver
        that was silent past checkpoint.lease_s may have been replaced by another, whose directory this
        now is (checkpoints/lease.py)."""
        if self.lease is None:
            return
        try:
            self.lease.check_held()
        except LeaseLostError as exc:
            self.metrics.event("checkpoint_failed", step=step, path=self.root, reason=exc.message[:300])
            raise TrainingFailed(f"checkpoint.dir: step {step} not committed: {exc.message}") from None

    def _storage_failed(self, step: int, path: str, reason: str) -> None:
        """Stop the run: a checkpoint could not be written although every rank is alive.

        Training on would leave nothing to recover from at the next failure; committed
        checkpoints are untouched (a failed step never gets a manifest), so a rerun resumes.
        """
        reason = " ".join(reason.split())[:300]
        self.metrics.event("checkpoint_failed", step=step, path=path, reason=reason)
        newest = f"step {self.last_committed}" if self.last_committed else "none yet"
        raise TrainingFailed(
            f"checkpoint.dir: saving step {step} failed ({reason}); training stopped rather than run on "
            f"without checkpoints. Committed checkpoints are intact (newest: {newest}): free space or fix "
            "permissions of checkpoint.dir and run again to resume"
        )

    # -- loading ----------------------------------------------------------------------------------
    def _claim_root(self) -> None:
        """Decide whose run this is before anything is written (see the module docstring)."""
        if not self.checkpoint.resume:
            others = [i for i in list_checkpoints(self.root) if i.committed or i.owner]
            if others:
                runs = sorted({i.owner or "an earlier run" for i in others})
                raise UserInputError(
                    f"checkpoint.dir {self.root} already holds checkpoints of {', '.join(runs)} (steps "
                    f"{others[0].step}..{others[-1].step}) and checkpoint.resume=false starts a new run, which "
                    "must not write beside them: point checkpoint.dir at an empty directory, or set "
                    "checkpoint.resume=true to continue that run")
            return
        self._start = latest_valid(self.root, on_skip=self._report_skip)
        if self._start is not None and self._start.manifest.run_id:
            self.run_id = self._start.manifest.run_id

    def resume_point(self, *, vet_metadata: bool = True) -> CheckpointInfo | None:
        """The newest valid checkpoint to (re)start from, or None. Checks it belongs to this model.

        Only this run's checkpoints count, plus the one it resumed from (written before runs had ids,
        it may carry none), so a rebuild never jumps into another run's state that shares the
        directory. Damaged newer ones are skipped, each reported once (a warning and a
        ``checkpoint_skipped`` event). ``vet_metadata=False``: DCP's pickled ``.metadata`` is not
        checked (``checkpoints.safe_pickle``, 20-60 ms on a loaded host), for a caller that only
        wants the step: a rebuild's plan, which mostly restores snapshots; ``restore`` checks it
        before any rank loads the checkpoint.
        """
        info = latest_valid(self.root, run_id=self.run_id, on_skip=self._report_skip)
        if info is None and self._start is not None and check_checkpoint(self._start.path)[0]:
            info = self._start
        if info is None:
            return None
        if vet_metadata and info.path not in self._safe:  # a crafted .metadata is refused before any rank unpickles it
            check_metadata_file(info.dcp_path)
            self._safe.add(info.path)
        check_resumable(info, self.job)
        return info

    def _report_skip(self, info: CheckpointInfo) -> None:
        """A damaged checkpoint newer than the one resumed: reported once (log + metrics event)."""
        if info.path not in self._reported_skips:
            self._reported_skips.add(info.path)
            logger.warning("skipping checkpoint %s: %s; trying the previous one", info.path, info.reason)
            self.metrics.event("checkpoint_skipped", step=info.step, path=info.path, reason=info.reason)

    def restore(self, group, gen) -> int:
        """Load the newest committed checkpoint into every member; returns its step (0 = none)."""
        info = self.resume_point()
        if info is None:
            return 0
        # Stop waiting as soon as a member died: the others are then blocked in DCP's collectives
        # and the controller frees them (RestoreFailed carries who answered what).
        refs = group.submit(list(gen.members.values()), RankCalls.load_checkpoint, (info.dcp_path,))
        outcome = collect_while_alive(group, refs, self.elastic.rebuild_timeout_s, f"loading {info.path}",
                                      stop_early=lambda o: bool(o.dead))
        if not outcome.ok:
            raise RestoreFailed(
                f"loading {info.path} failed: {outcome.failed or outcome.dead or outcome.pending}", outcome)
        self.last_committed = max(self.last_committed, info.step)
        self.skipped_steps.update(info.manifest.skipped_steps)  # a resume skips them again
        return info.step

    def close(self) -> None:
        """Stop the purger, give back the run lease, remove a temporary root (idempotent)."""
        self.purger.close()
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


def _data_identity(data: DataConfig) -> str:
    """Content identity of the job's data: data.path's, or data.mix's (every source's and the weights:
    other weights would change which sample each step holds). meshdata: torch-free, cached per process."""
    from meshdata import open_mixture

    return open_mixture(data.mix or data.path, 1).identity


def _first_cause(group, refs: dict, fallback: dict[int, str]) -> str:
    """The rank-side error of the first failed call (``WorkerGroup.first_cause``), else the outcome's."""
    return group.first_cause(refs) or next(iter(fallback.values()), "unknown error")

