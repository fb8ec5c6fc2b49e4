"""CheckpointCoordinator: the driver's half of the two-phase checkpoint commit.

Phase 1: every rank stages its shard to CPU and returns (``save_checkpoint``: the step's stall), then
writes it in the background; ``wait_checkpoint`` (a call parked on a second actor thread) answers when
the shard is durable. Phase 2: once every rank acked, the driver writes ``manifest.json`` last
(``checkpoints.catalog.commit``). At most one save is in flight; a failure in between leaves a
directory without a manifest, which is never taken as a checkpoint.

With ``checkpoint.dir`` unset, planned resizes still need to move state between meshes: they use a
private temporary directory on the driver's machine (fine for one node; multi-node runs need a shared
``checkpoint.dir``, which ``elastimesh train`` warns about).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time

from checkpoints.catalog import (
    BackgroundPurger,
    commit,
    ensure_writable,
    latest_valid,
    list_checkpoints,
    prepare_step,
)
from checkpoints.errors import CheckpointError
from checkpoints.manifest import CheckpointManifest
from orchestrator.config import JobConfig, config_to_dict, model_diff, model_fingerprint
from orchestrator.errors import TrainingFailed, UserInputError
from orchestrator.mesh import layer_ranges

logger = logging.getLogger(__name__)


class CheckpointCoordinator:
    def __init__(self, cfg: JobConfig, metrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.user_dir = cfg.checkpoint.dir
        self._tmp = None if self.user_dir else tempfile.mkdtemp(prefix="elastimesh-ckpt-")
        self.root = self.user_dir or self._tmp
        self.every = cfg.checkpoint.every if self.user_dir else 0
        self.fingerprint = model_fingerprint(cfg)
        self.purger = BackgroundPurger()
        self._pending: dict | None = None  # the save in flight: step, gen, refs, stall
        self.last_committed = 0
        self._committed_here: set[int] = set()  # steps this run committed (resume=false trusts only these)
        if self.user_dir:
            try:
                ensure_writable(self.root)
            except CheckpointError as exc:
                raise UserInputError(f"checkpoint.dir: {exc}") from None

    # -- saving -----------------------------------------------------------------------------------
    def after_step(self, group, gen, step: int) -> None:
        self._try_commit(group, block=False)
        if self.every and step % self.every == 0:
            self._start_save(group, gen, step)

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
        self._try_commit(group, block=True)

    def abandon_pending(self) -> None:
        if self._pending is not None:
            logger.warning("checkpoint of step %d abandoned (failure while writing)", self._pending["step"])
        self._pending = None

    def _start_save(self, group, gen, step: int) -> None:
        self._try_commit(group, block=True)  # at most one save in flight
        path = prepare_step(self.root, step)
        actors = list(gen.members.values())
        t0 = time.monotonic()
        staged = group.call(actors, "save_checkpoint", (path, step), timeout_s=self.cfg.elastic.step_timeout_s)
        if not staged.ok:
            logger.warning("checkpoint of step %d not started: %s", step, staged.failed or staged.dead)
            return
        refs = group.submit(actors, "wait_checkpoint")
        self._pending = {
            "step": step, "gen": gen, "path": path, "refs": refs, "t0": t0,
            "stall_s": max(r["stall_s"] for r in staged.results.values()),
        }

    def _try_commit(self, group, *, block: bool) -> None:
        pending = self._pending
        if pending is None:
            return
        timeout = self.cfg.elastic.step_timeout_s if block else 0.0
        outcome = group.collect(dict(pending["refs"]), timeout)
        if not block and outcome.pending:
            return  # still writing; look again after the next step
        self._pending = None
        if not outcome.ok:
            logger.warning("checkpoint of step %d not committed: %s", pending["step"],
                           outcome.failed or outcome.dead or f"no ack from actors {outcome.pending}")
            self.metrics.event("checkpoint_failed", step=pending["step"], path=pending["path"],
                               reason=str(outcome.failed or outcome.dead or outcome.pending)[:300])
            return
        gen = pending["gen"]
        rank_of = {actor: rank for rank, actor in gen.members.items()}
        files: dict[str, int] = {}
        for ack in outcome.results.values():
            files.update(ack["files"])
        manifest = CheckpointManifest(
            step=pending["step"],
            generation=gen.number,
            mesh=gen.shape.as_dict(),
            model_fingerprint=self.fingerprint,
            data_cursor=pending["step"] * self.cfg.train.global_batch_size,
            global_batch_size=self.cfg.train.global_batch_size,
            world_size=gen.shape.world,
            ranks_acked=sorted(rank_of[a] for a in outcome.results),
            schedule=gen.plan.schedule_name,
            stage_layers=[list(range(a, b)) for a, b in layer_ranges(list(gen.plan.layers_per_stage))],
            model_config=config_to_dict(self.cfg)["model"],
            files=files,
        )
        try:
            commit(self.root, manifest)
        except CheckpointError as exc:
            logger.warning("%s", exc)
            self.metrics.event("checkpoint_failed", step=pending["step"], path=pending["path"], reason=str(exc)[:300])
            return
        self.last_committed = pending["step"]
        self._committed_here.add(pending["step"])
        write_s = max(a["write_s"] for a in outcome.results.values())
        self.metrics.event("checkpoint", step=pending["step"], stall_s=pending["stall_s"],
                           write_s=write_s, path=pending["path"])
        if self.user_dir:
            self.purger.request(self.root, self.cfg.checkpoint.keep)

    # -- loading ----------------------------------------------------------------------------------
    def resume_point(self):
        """The newest valid checkpoint to (re)start from, or None. Checks it belongs to this model.

        With ``checkpoint.resume = false`` only checkpoints this run committed count, so a rebuild
        never jumps into an older run's state that happens to share the directory.
        """
        if self.cfg.checkpoint.resume or not self.user_dir:
            info = latest_valid(self.root)
        else:
            valid = [i for i in list_checkpoints(self.root) if i.valid and i.step in self._committed_here]
            info = valid[-1] if valid else None
        if info is None:
            return None
        if info.manifest.model_fingerprint != self.fingerprint:
            keys = model_diff(info.manifest.model_config, config_to_dict(self.cfg)["model"])
            raise UserInputError(
                f"checkpoint {info.path} was saved from a different model config "
                f"(mismatching keys: {', '.join(keys) or 'data.path'}): use a new checkpoint.dir or "
                "restore those keys"
            )
        return info

    def restore(self, group, gen) -> int:
        """Load the newest committed checkpoint into every member; returns its step (0 = none)."""
        info = self.resume_point()
        if info is None:
            return 0
        outcome = group.call(list(gen.members.values()), "load_checkpoint", (info.path,),
                             timeout_s=self.cfg.elastic.rebuild_timeout_s)
        if not outcome.ok:
            raise TrainingFailed(f"loading {info.path} failed: {outcome.failed or outcome.dead or outcome.pending}")
        self.last_committed = max(self.last_committed, info.step)
        return info.step

    def close(self) -> None:
        self.purger.close()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

