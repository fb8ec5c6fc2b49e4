"""Bring a job up on Ray and run it: connect (or start an embedded local Ray), check the cluster can hold
the mesh, ask the autoscaler for the largest mesh the job may grow to, host the rendezvous store
(``StoreProvider``), start the RankActors, hand them to the Controller, and tear down -- also when
stopped by SIGTERM (`ray job stop`) or SIGINT (Ctrl-C): a first signal while training saves at the
next step boundary and finishes cleanly (``StopRequest``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import ray

from checkpoints.catalog import ensure_writable, latest_valid
from checkpoints.errors import CheckpointError
from checkpoints.safe_pickle import check_metadata_file
from meshspeak.profile import profile_spec
from meshspeak.sections import JobConfig
from orchestrator.cluster.autoscale import CapacityRequest, alive_node_totals, bundles_that_fit, wanted_bundles
from orchestrator.cluster.store_provider import StoreProvider
from orchestrator.cluster.worker_group import ActorResources, WorkerGroup
from orchestrator.control.controller import Controller, RunSummary
from orchestrator.data_inputs import JobData, check_job_data
from orchestrator.errors import ClusterConnectError, UserInputError, WorkerGroupStartupError
from orchestrator.metrics import MetricsLog, check_outputs
from orchestrator.saves.checkpointing import check_resumable, job_record
from orchestrator.tracking.sinks import open_trackers

logger = logging.getLogger(__name__)

LOCAL_MIN_CPUS = 8  # logical CPU slots of the embedded Ray: enough for a dp=2 x tp=2 laptop job
PROBE_TIMEOUT_S = 5.0  # a TCP connect to the GCS port: a closed port fails at once, not after ray.init's retries
FIX_ADDRESS = ("start one with `ray start --head`, fix RAY_ADDRESS, or unset it to use an embedded local "
               "Ray (with token auth on, also set RAY_AUTH_MODE=token)")


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Fail fast and clearly when RAY_ADDRESS cannot be a reachable cluster address."""
    if address.startswith(("http://", "https://")):
        # `ray job` talks to the dashboard's HTTP address; a driver needs the GCS address, which
        # `ray job submit` sets for the job itself. Exporting the first for `ray job` is a common slip.
        raise ClusterConnectError(
            f"RAY_ADDRESS={address} is a dashboard (job API) address; elastimesh joins the cluster "
            "address host:6379, which `ray job submit` sets for the job: unset RAY_ADDRESS here, or "
            "use --address / RAY_API_SERVER_ADDRESS for `ray job` commands"
        )
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto" and other forms: ray.init resolves them (bounded below)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ClusterConnectError(
            f"RAY_ADDRESS={address}: cannot reach a Ray cluster (nothing answers at {target}: {why}); "
            + FIX_ADDRESS
        ) from None


def connect(cfg: JobConfig) -> bool:
    """Join RAY_ADDRESS's cluster (within ``resources.connect_timeout_s``), or start a local one. Returns
    True for an embedded local Ray."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        probe(address)
        # ray.init retries for a long time on an unreachable address: bound it ourselves.
        error: list[BaseException] = []

        def attempt() -> None:
            try:
                ray.init(address=address, log_to_driver=True)
            except BaseException as exc:  # reported below as one line
                error.append(exc)

        thread = threading.Thread(target=attempt, daemon=True)
        thread.start()
        connect_timeout_s = cfg.resources.connect_timeout_s
        thread.join(connect_timeout_s)
        if thread.is_alive() or error:
            why = (f"{type(error[0]).__name__}: {str(error[0]).splitlines()[0]}" if error
                   else f"no answer in {connect_timeout_s:g}s, resources.connect_timeout_s")
            raise ClusterConnectError(f"RAY_ADDRESS={address}: cannot reach a Ray cluster ({why}); " + FIX_ADDRESS)
        return False
    world = cfg.mesh.world
    needed = world * cfg.resources.cpus_per_worker
    cpus = max(os.cpu_count() or 1, LOCAL_MIN_CPUS)
    if needed > cpus:
        raise WorkerGroupStartupError(
            f"mesh.dp*pp*tp={world} workers x resources.cpus_per_worker="
            f"{cfg.resources.cpus_per_worker:g} need {needed:g} CPU slots but the local Ray has {cpus}: "
            "lower mesh.dp/pp/tp or resources.cpus_per_worker, or set RAY_ADDRESS to a larger cluster"
        )
    # address="local": never attach to a `ray start` cluster on this machine by accident.
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True)
    return True


def resolve_gpu(cfg: JobConfig) -> bool:
    setting = cfg.resources.use_gpu
    if setting == "auto":
        return ray.cluster_resources().get("GPU", 0) > 0
    return bool(setting)


def check_host_memory(cfg: JobConfig) -> None:
    """Before any rank is placed: refuse a mesh whose in-memory snapshot and staging copies would not
    fit a node's memory with as many ranks there as its CPU/GPU slots hold (Ray places by slots, not
    memory); orchestrator/plan/host_memory.py counts the copies."""
    from orchestrator.plan.host_memory import check_node_memory, node_rooms
    from orchestrator.plan.mesh_plan import make_plan, rank_memory

    use_gpu = resolve_gpu(cfg)
    plan = make_plan(cfg)
    memory = {p: rank_memory(cfg, plan, p) for p in range(plan.shape.pp)}
    bundle = {"CPU": cfg.resources.cpus_per_worker, **({"GPU": 1.0} if use_gpu else {})}
    nodes = [(n["NodeID"], n["Resources"]) for n in ray.nodes() if n.get("Alive")]
    check_node_memory(cfg, plan.shape.world, memory, node_rooms(nodes, bundle), on_cpu=not use_gpu)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """What a stop signal asked for. SIGTERM (`ray job stop`, a scheduler) or SIGINT (Ctrl-C) while
    training runs (``graceful``) asks the controller to save at the next step boundary and finish
    (``stop_requested`` reads it); before that (start-up) and for a second signal the handler exits
    at once by raising SystemExit, so the `finally` blocks still run."""

    def __init__(self) -> None:
        self.graceful = False
        self.signum: int | None = None
        # Run at once, on a thread of their own, when a graceful stop is asked for: what must not wait
        # for the step boundary. `ray job stop` SIGKILLs the job RAY_JOB_STOP_WAIT_TIME_S (3 s by
        # default) after its SIGTERM, which a step plus the save may outlast; the autoscaler request
        # must be withdrawn even then, or idle nodes are kept (tests/e2e/test_autoscale_grow.py).
        self.on_stop: list[Callable[[], None]] = []

    def __call__(self) -> bool:
        return self.signum is not None

    def _asked(self, signum: int) -> None:
        self.signum = signum
        for callback in self.on_stop:
            # Not in the handler itself: it runs between the main thread's bytecodes, maybe inside a
            # Ray call; a daemon thread never holds the exit up.
            threading.Thread(target=callback, name="elastimesh-on-stop", daemon=True).start()


@contextmanager
def stop_on_signals(stop: StopRequest):
    """Install the stop handlers for SIGTERM and SIGINT (see ``StopRequest``).

    Enter it *after* ray.init: Ray's core worker installs a C-level SIGTERM handler that aborts the
    driver (exit 134, no cleanup), replacing any Python handler set before (docs/design.md, "Ray 2.60 and
    signals/auth")."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    exiting: list[int] = []

    def handler(signum, _frame):
        name = signal.Signals(signum).name
        if stop.graceful and stop.signum is None:
            stop._asked(signum)
            logger.warning("stopping: got %s (e.g. `ray job stop`, Ctrl-C): saving at the next step "
                           "boundary, then exiting; a second signal exits at once", name)
            return
        for sig in STOP_SIGNALS:  # the cleanup that follows must not be cut short by a third
            signal.signal(sig, signal.SIG_IGN)
        exiting.append(signum)
        logger.warning("stopping now: got %s%s", name, "" if stop.graceful else " during start-up")
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    except SystemExit:
        if exiting:  # raised inside ray.wait/ray.get, Ray re-raises it as SystemExit(1): keep 128+N
            raise SystemExit(128 + exiting[0]) from None
        raise
    finally:
        for sig, handler_before in previous.items():
            # None: the previous handler was not a Python one (Ray's); the default is as good after.
            signal.signal(sig, signal.SIG_DFL if handler_before is None else handler_before)


def check_checkpoint_dir(cfg: JobConfig) -> None:
    """Exit 2 before Ray and the actors start: a checkpoint.dir that cannot be written (a wrong bucket
    or path), and, when resuming, a checkpoint to resume that holds a crafted ``.metadata`` or that
    this job cannot continue (another model, other data, another global batch: ``check_resumable``).
    The controller checks again at every resume."""
    if not cfg.checkpoint.dir:
        return
    try:
        ensure_writable(cfg.checkpoint.dir)
    except CheckpointError as exc:
        raise UserInputError(f"checkpoint.dir: {exc}") from None
    if cfg.checkpoint.resume:
        info = latest_valid(cfg.checkpoint.dir)  # what the first formation resumes
        if info is not None:
            check_metadata_file(info.dcp_path)
            check_resumable(info, job_record(cfg))


def run_job(cfg: JobConfig, *, progress: bool = True, reserved=None, step_listeners=()) -> RunSummary:
    """Run one job to the end. ``reserved``: a placement group already holding one bundle per rank
    (a Tune trial's, see orchestrator/sweep/trial.py); ``step_listeners`` get every step record."""
    from meshmodels.family import check_init_from, resolve_model

    launched_at = time.time()  # the report's start-up counts from here (orchestrator/report/goodput.py)
    vocab = resolve_model(cfg.model).shape.vocab_size  # the model family's (model.from_hf's config.json)
    data = check_job_data(cfg, vocab)  # data.path / data.mix, eval.path / eval.mix; exit 2 before any actor
    cfg = data.cfg  # a mixture's paths resolved (the ranks may run elsewhere)
    check_init_from(cfg)  # the HF weights, before any actor starts
    check_outputs(cfg.metrics)  # before Ray and the actors start
    check_checkpoint_dir(cfg)  # before Ray and the actors start
    started_local = connect(cfg)
    try:
        check_host_memory(cfg)  # snapshot and staging copies against each node's memory: exit 2 now
        stop = StopRequest()
        with stop_on_signals(stop):
            return _run(cfg, data, progress, started_local, reserved, list(step_listeners), stop, launched_at)
    finally:
        if started_local:
            ray.shutdown()


def _run(cfg: JobConfig, data: JobData, progress: bool, started_local: bool, reserved,
         listeners, stop: StopRequest, launched_at: float) -> RunSummary:
    metrics = None
    group = None
    store = None
    capacity = CapacityRequest()
    failed = True  # until the controller returns: the trackers' run status
    try:
        use_gpu = resolve_gpu(cfg)
        if not started_local and not cfg.checkpoint.dir and len(ray.nodes()) > 1:
            logger.warning("checkpoint.dir is unset on a multi-node cluster: elastic recovery restarts "
                           "from step 1; set it to shared storage (e.g. s3://bucket/run)")
        store = StoreProvider()
        store.begin()  # its start overlaps the ranks' (both import torch); address() below waits for it
        group = WorkerGroup(
            ActorResources(cpus=cfg.resources.cpus_per_worker, gpus=1 if use_gpu else 0),
            placement_timeout_s=cfg.resources.placement_timeout_s, reserved=reserved,
            actor_kwargs={"profile": profile_spec(cfg.metrics, cfg.train.steps), "snapshot_keep": cfg.checkpoint.memory_keep},
        )
        # An embedded Ray has no autoscaler to ask; a reserved group's owner asked for it (Tune's
        # pending placement group is the demand), and one request per cluster would clobber the others.
        if not started_local and reserved is None:
            capacity.ask(wanted_bundles(cfg, group.bundle()),
                         fits_now=bundles_that_fit(group.bundle(), alive_node_totals()))
        group.add(cfg.mesh.world)
        store.address()  # hosted by now; a cluster that cannot host it fails here, before any step
        # Hot spares are not waited for here: the first generation's formation asks for them once its
        # first step trained (SparePool.ask_after_first_step), started in the background. Waited for
        # here, they came after the mesh's actors, one more actor start on every run's start-up.
        if cfg.elastic.spares:
            logger.info("elastic.spares=%d: started once the first step trained", cfg.elastic.spares)
        metrics = MetricsLog(cfg.metrics, progress_total=cfg.train.steps if progress else None,
                             launched_at=launched_at, trackers=open_trackers(cfg))
        metrics.step_listeners.extend(listeners)
        metrics.data_counters = data.counters if cfg.data.mix else None  # per-source counters in step records
        controller = Controller(
            cfg, group, metrics=metrics, store_address=store, use_gpu=use_gpu,
            # With a mix the ranks read RuntimeSpec.data_mix; its first source is where export finds the tokenizer.
            data_path=data.train.sources[0].name,
            eval_path=data.eval_spec, eval_mask_eos_id=data.eval_mask_eos_id,
        )
        controller.stop_requested = stop
        stop.on_stop.append(capacity.release)
        stop.graceful = True  # from now on a signal saves at the next step boundary first
        summary = controller.run()
        failed = False
        return summary
    finally:
        capacity.release()  # first: if the job is being killed, this is what must not be lost
        if metrics is not None:
            metrics.close("FAILED" if failed else "FINISHED")
        if group is not None:
            group.shutdown()
        if store is not None:
            store.close()
