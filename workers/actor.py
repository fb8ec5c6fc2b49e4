"""RankActor: the thin Ray shell around one rank. Knows nothing of placement, policy or other actors.

All training work (joining a generation, steps, evaluation, saving and loading checkpoints and
snapshots, gathering the state) runs on one long-lived thread: the ``TRAIN_GROUP`` concurrency group,
one thread. The driver keeps a few steps queued there (orchestrator/control/window.py), so a rank
goes from one step to the next without waiting for the driver. Ray does not promise to run a
threaded actor's calls in the order they were sent, so each training call checks that it comes in
order (a step after the one before it) and fails otherwise. An error inside a step is latched: it is
returned in the ``StepResult``, and every later training call of the generation refuses at once, so
steps queued behind a broken one do not block in collectives; the driver decides what happens next.

Other calls run on the default group's small pool, so while the training thread is inside a step —
possibly blocked in a collective whose peer died — the driver can still poll the actor, park a
``wait_checkpoint`` and tell it to free the step (``kick``: gloo sockets shut down, NCCL
communicators aborted). A peer's snapshot push and a restore's reads run on the ``SNAPSHOT_GROUP``
thread (workers/snapshot_push.py), so they never take a thread the driver's rescue calls need.

The methods the driver calls are listed, with their parameters, in ``meshspeak.rank_calls.RankCalls``
(tests/unit/test_rank_calls.py keeps this class equal to it). Faults can be injected on purpose
(``arm_fault``, workers/faults.py), so tests can prove recovery from each.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace

import ray

from meshspeak.messages import (
    GenerationOrders,
    JoinSpec,
    RankInfo,
    RestoreAck,
    RestoreSource,
    RuntimeSpec,
    SaveAck,
    SnapKey,
    SnapshotInventory,
    SplitOrders,
    StepResult,
    WorkerStatus,
    WriteAck,
    early_answer,
)
from meshspeak.pids import pid_namespace
from meshspeak.rank_calls import SNAPSHOT_GROUP
from meshspeak.rank_errors import RankError
from workers import compile_stats
from workers.faults import Faults
from workers.heavy_imports import collector_paused
from workers.profiling import profiled_step
from workers.rank_methods import on, plain, training
from workers.snapshot_push import AskedAhead, SnapshotWorker, ask_ahead, keep_asked, serve_pieces
from workers.snapshots import DEFAULT_KEEP, SnapshotStore

logger = logging.getLogger(__name__)


@dataclass
class GenerationLinks:
    """The current (or joining) generation's connections, as a kick needs them (``RankActor.kick``)."""

    backend: str = "gloo"  # of the generation's training groups (NCCL's own sockets are never shut)
    listeners: tuple[tuple[str, int], ...] = ()  # its gloo groups' listeners, as peers dial them
    # The connections its groups made (workers/sockets.py): a kick matches the listeners of peers
    # that are gone against these only.
    conns: frozenset = frozenset()
    # While a join is in progress: (its spec, listening ports before it). A kick then also frees a
    # rendezvous blocked on a peer that died mid-join.
    joining: tuple[JoinSpec, frozenset[int]] | None = None
    store: tuple[str, int] | None = None  # the generation's rendezvous store

    def targets(self, peers) -> tuple[set[int], set[tuple[str, int]]]:
        """(own listening ports, remote endpoints) whose connections a kick shuts down: the
        generation's listeners and the live ``peers``'; mid-join also the store and, on gloo, the
        listeners opened since the join began; on NCCL after the join the store (a communicator is
        made at its first collective, reading its id from there: workers/groups.py)."""
        from workers.sockets import endpoint, listening_ports

        local = {port for _, port in self.listeners}
        remote = set(map(tuple, peers))
        if self.joining is not None:
            gen, before = self.joining
            if self.backend == "gloo":
                local |= listening_ports() - before
            remote.add(endpoint(gen.store_addr, gen.store_port))
        elif self.backend == "nccl" and self.store is not None:
            remote.add(endpoint(*self.store))
        return local, remote


def _import_a_spares_first_join(family: str) -> None:
    """What the project's modules import only where first used, which for a spare is its first join or
    load, on the recovery's critical path (listed from the modules a promoted spare's join and load
    added: tests/unit/test_actor_start_imports.py), and the job's model family. Only a spare's warm-up
    (``SparePool.warm`` names the family) imports them: an actor's start does not, since the mesh's
    first formation, which would import them anyway, waits for every start (on 2 cores ~0.5 s more
    for four actors starting at once). clear_dtensor_caches' import of torch.distributed.tensor.debug
    pulls torch.distributed._tools and torch.utils.flop_counter: 0.2-0.9 s of a spare's join on the
    loaded 2-core machine."""
    import torch.distributed.tensor.debug  # noqa: F401
    import torch.utils.serialization.config  # noqa: F401  (a snapshot load's first torch.load)

    import checkpoints.memory  # noqa: F401
    import checkpoints.reader  # noqa: F401
    import checkpoints.snapshot_taker  # noqa: F401
    import checkpoints.state  # noqa: F401
    import checkpoints.writer  # noqa: F401
    from meshmodels.family import load_family

    with suppress(Exception):  # a bad reference is the join's to report (model.family, exit 2)
        load_family(family)


class RankActor:
    def __init__(self, actor_id: int, profile=None, snapshot_keep: int = DEFAULT_KEEP) -> None:
        try:
            with collector_paused():  # the imports of a start (workers/heavy_imports.py)
                self._start(actor_id, profile, snapshot_keep)
        except Exception as exc:  # as every call's error: text only (``workers.rank_methods.plain``)
            raise RankError.of(exc) from exc

    def _start(self, actor_id: int, profile, snapshot_keep: int) -> None:
        import torch  # here, not at the top: the driver imports this module to create the actors

        # Ranks share few cores; one intra-op thread each avoids oversubscription (docs/design.md, F13).
        torch.set_num_threads(1)
        logging.basicConfig(
            level=logging.INFO, format=f"%(asctime)s [actor={actor_id}] %(name)s: %(message)s"
        )
        self.actor_id = actor_id
        self.profile = profile  # workers.profiling.ProfileSpec: which steps to trace (metrics.profile_steps)
        self.runtime = None
        self.orders: GenerationOrders | None = None  # of the current generation
        self.split: SplitOrders | None = None  # its microbatch split, once one came (elastic.rebalance)
        self.run_id: str | None = None  # whose restore polled it last (snapshot_inventory); None before any
        self.generation = -1
        self.world_rank = -1
        self.life = 0  # loads done in this generation (part of its snapshots' keys)
        self.step = 0  # the last step this generation trained (or loaded)
        self.busy = False
        self.error: str | None = None  # latched: later training calls of the generation refuse
        self.links = GenerationLinks()  # what a kick shuts down
        self._lock = threading.Lock()
        self._train_threads: set[int] = set()  # threads that ran training work (one, by design)
        self.faults = Faults()  # injected on purpose (``arm_fault``; the runtime's step hooks)
        # Outlives generations: a rebuild restores from it. Keeps checkpoint.memory_keep per owner.
        self.snapshots = SnapshotStore(snapshot_keep)
        self.snapshot_worker = SnapshotWorker(self.snapshots)
        # What a snapshot load's reads asked for at the join (metadata, the shard it loads)
        self.asked: AskedAhead | None = None
        self.warm()

    @plain
    def ping(self) -> tuple[int, str, str, int]:
        """(pid, node IP, Ray node id, pid namespace): several nodes may share one IP (e.g. in tests),
        and a pid means this process only to a driver in the same namespace (meshspeak/pids.py)."""
        return (os.getpid(), ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(),
                pid_namespace())

    @plain
    def warm(self, family: str = "") -> None:
        """Import what joining a generation needs (FSDP2, DTensor, the model code), so that a hot spare
        joins as fast as a member re-forms (``elastic.spares``); the first call (from ``__init__``,
        before any generation) freezes the heap, later ones find it frozen. ``family``: the job's
        ``model.family`` reference, which the driver's ``SparePool`` passes to a spare in a later call:
        the family's module and what a spare's first join and load would import are imported then
        (``_import_a_spares_first_join``), after the freeze (their objects stay in the GC's reach).

        The freeze moves every object alive then (the imported torch, Ray and model code: ~330k
        objects) out of the cyclic GC's reach, once per process. Leaving a generation runs a full
        collection (``workers.device.release_memory``) on the rebuild's critical path; while it scanned
        those objects too it took 0.7-1.2 s per survivor in the chaos bench (a rank's join 0.55-0.6 s
        -> 0.2 s without). Only objects made before the first join are frozen, so every generation's
        own cycles are still collected.

        dynamo is among them, though only ``train.compile`` compiles: FSDP2's ``fully_shard`` imports
        it (0.7-0.9 s of CPU), so left out here it moved into every promoted spare's first join, on
        the recovery's critical path (in one chaos campaign without it, the joins took 1.1-1.9 s
        against 0.3-1.1 s: tests/unit/test_actor_start_imports.py)."""
        import gc

        with collector_paused():  # a spare's warm-up imports too (workers/heavy_imports.py)
            import torch._dynamo  # noqa: F401  (see above; the compute clock's decorators import it too)

            import checkpoints.direct_load  # noqa: F401  (a restore's; 0.08 s at the first one, under cProfile)
            import workers.groups  # noqa: F401
            import workers.runtime  # noqa: F401
            import workers.snapshot_restore  # noqa: F401

            if family:
                _import_a_spares_first_join(family)
        if gc.get_freeze_count() == 0:
            gc.collect()
            gc.freeze()

    @plain
    def train_threads(self) -> int:
        """How many distinct threads have run this actor's training work (1 unless misconfigured)."""
        return len(self._train_threads)

    @plain
    def node_id(self) -> str:
        """The Ray node this actor runs on (several nodes may share one IP, e.g. in tests)."""
        return ray.get_runtime_context().get_node_id()

    @training
    def join_generation(self, gen: JoinSpec, spec: RuntimeSpec, orders: GenerationOrders) -> RankInfo:
        """Leave the current generation (if any) and join ``gen`` as ``gen.world_rank``: this rank's
        ``RankGroups`` and ``RankRuntime`` for it are built here. ``orders``: what every step runs."""
        from workers import sockets
        from workers.groups import build_process_groups
        from workers.runtime import RankRuntime

        with self._lock:
            t0 = time.perf_counter()
            self.asked = self._ask_ahead(orders.restore, gen)
            self._leave()
            t_left = time.perf_counter()
            device = self._device_for(gen, spec)
            before = sockets.table()
            self.links.joining = (gen, frozenset(before.ports))
            try:
                self.faults.reached("join", gen.generation)
                groups = build_process_groups(
                    store_addr=gen.store_addr, store_port=gen.store_port, store_prefix=gen.store_prefix,
                    store_secret=gen.store_secret, generation=gen.generation, shape=gen.shape,
                    world_rank=gen.world_rank, timeout_s=spec.collective_timeout_s, device=device,
                    replicate=spec.dp.replicate, bind_ip=ray.util.get_node_ip_address(), sockets_before=before)
                t_groups = time.perf_counter()
                try:
                    # The fault seam (test hooks, workers/faults.py) and the snapshot copy's fence.
                    self.runtime = RankRuntime(spec, groups, hooks=self.faults,
                                               before_update=self.snapshot_worker.fence)
                except BaseException:
                    groups.destroy()
                    raise
            finally:
                self.links.joining = None
            self.generation, self.world_rank, self.error = gen.generation, gen.world_rank, None
            self.orders, self.split, self.life, self.step = orders, None, 0, 0
            self.links.store = (gen.store_addr, gen.store_port)
            ip = ray.util.get_node_ip_address()
            # Where they listen, as peers dial them (Ray's node address since workers/bind.py; read,
            # not assumed: a kick matches the peers' connections by it). The tied groups' are in.
            after = sockets.table()
            self.links.listeners = after.listeners(groups.gloo_ports)
            self.links.conns = after.established - before.established  # the tied groups' are in
            logger.info("joined generation %d as rank %d in %.3f s: leave %.3f, groups %.3f, runtime %.3f",
                        gen.generation, gen.world_rank, time.perf_counter() - t0, t_left - t0,
                        t_groups - t_left, time.perf_counter() - t_groups)
            return RankInfo(
                world_rank=gen.world_rank,
                pid=os.getpid(),
                node_ip=ip,
                gloo_listeners=self.links.listeners,
                setup_s=time.perf_counter() - t0,
                num_params_local=sum(p.numel() for p in self.runtime.params),
            )

    def _enter_run(self, run_id: str) -> None:
        """Asked for its snapshots by another run's restore than the last one (``snapshot_inventory``; an
        actor reused by a new controller, as tests do): the snapshots kept for the last run are dropped,
        their own and the peers' copies. Every formation with snapshots on polls every live actor before
        its members join, so members and spares alike drop them before the new run can read or retain any.
        Their keys (generation, life, step) restart with every run, so the new run's restore could
        otherwise count one of them as a live copy of its own set (``newest_covered``) and load it.
        (A peer's push of the last run still in flight when this runs would land after it: a window of
        one push, milliseconds, which runs seconds apart, as tests make them, do not meet.)"""
        if run_id == self.run_id:
            return
        if self.run_id is not None:
            dropped = self.snapshots.forget_all()
            if dropped:
                logger.info("run %s: dropped %d in-memory snapshots of run %s", run_id, dropped, self.run_id)
        self.run_id = run_id

    def _ask_ahead(self, source: RestoreSource | None, gen: JoinSpec) -> AskedAhead | None:
        """The reads of the snapshot load that follows this join (``GenerationOrders.restore``), asked
        for now: answered by the providers while this rank builds its groups and model."""
        if source is None:
            return None
        return ask_ahead(self.snapshots, source, gen.world_rank, gen.shape.world, self.actor_id)

    def _device_for(self, gen: JoinSpec, spec: RuntimeSpec):
        """This rank's device for generation ``gen`` (its backend noted for the kick). A GPU job on a
        rank without CUDA fails here, in one line (no silent gloo fallback)."""
        import torch

        from workers.device import backend_for, select_device

        device = select_device(spec.use_gpu, gpu_ids=ray.get_gpu_ids(),
                               where=f"rank {gen.world_rank} on {ray.util.get_node_ip_address()}")
        self.links.backend = backend_for(device)
        if device.type == "cuda":
            # The host's share of a GPU rank (the offloaded optimizer step, data, staging) gets
            # the CPUs Ray reserved for it, not the one thread CPU ranks share cores with.
            cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
            torch.set_num_threads(max(1, int(cpus)))
        return device

    def _refuse(self, what: str) -> None:
        """A training call behind a broken one, or before any generation: fail at once."""
        if self.runtime is None:
            raise RuntimeError(f"{what} before join_generation")
        if self.error is not None:
            raise RuntimeError(f"{what} refused: generation {self.generation} broke ({self.error})")

    @training
    def train_step(self, step: int, keep: tuple = (), after: int | None = None,
                   split: SplitOrders | None = None) -> StepResult:
        """Train ``step``; ``after``: the step this one follows (``step - 1`` unless the steps between
        were recorded as bad and are passed over untrained); ``keep``: see ``SnapshotStore.retain``;
        ``split``: a new microbatch split from this step on (elastic.rebalance), kept for the
        generation's later steps."""
        self.busy = True
        try:
            self._refuse(f"step {step}")
            follows = step - 1 if after is None else after
            if self.step < follows:  # Ray may reorder a threaded actor's calls: the driver sends it again
                logger.warning("step %d arrived before step %d ran: answered early, not trained", step, follows)
                return early_answer(step, self.world_rank, follows, self.step)
            if self.step != follows:
                raise RuntimeError(f"step {step} arrived after step {self.step}: calls out of order")
            self.faults.reached("step", step)
            self.snapshots.retain(keep)
            with profiled_step(self.profile, step, self.world_rank, self.generation):
                if split is not None:
                    self.split = split
                if self.split is None:
                    result = self.runtime.train_step(step, list(self.orders.actions))
                else:
                    result = self.runtime.train_step(step, list(self.split.actions), self.split.split)
            self.step = step
            self._maybe_snapshot(step, result)
            return replace(result, snapshots=self.snapshot_worker.take_acks())
        except Exception as exc:  # latched: the driver decides (rebuild, retry or stop)
            if self.error is None:
                self.error = f"{type(exc).__name__}: {exc}"
                logger.warning("step %d failed: %s\n%s", step, self.error, traceback.format_exc(limit=4))
            return StepResult(step=step, world_rank=self.world_rank, ok=False, error=self.error)
        finally:
            self.busy = False

    def _maybe_snapshot(self, step: int, result: StepResult) -> None:
        """Every ``snapshot_every`` steps (not a skipped one) take this rank's snapshot: planned here,
        copied and pushed to the holder by the snapshot worker; skipped while the last push runs."""
        every = self.orders.snapshot_every
        if not every or step % every or result.skipped:
            return
        if not self.snapshot_worker.idle():
            self.snapshot_worker.skipped += 1
            return
        t0 = time.perf_counter()
        self.faults.reached("snapshot", step)
        slot = self.snapshots.slot_for()
        planned = self.runtime.plan_snapshot(step, slot)
        key: SnapKey = (self.generation, self.life, step)
        self.snapshot_worker.submit(key, planned, self.orders.holder, self.world_rank, time.perf_counter() - t0)

    @training
    def eval_step(self, path: str, batch: int, mask_eos_id: int | None) -> dict:
        """Held-out loss of eval batch ``batch`` (forward only, between steps); errors propagate.

        Training work, queued behind the step whose snapshot it follows: the snapshot's state dict is
        planned on this thread inside that step (FSDP2's state-dict hook resharded the modules in the
        middle of an eval forward on another thread: tests/ray/test_data_eval.py); the copy that runs
        on beside the eval only reads the local shards, which an eval forward never writes."""
        self._refuse("eval")
        if batch == 0:
            self.faults.reached("eval", self.step, self.runtime)
        return self.runtime.eval_step(path, batch, list(self.orders.actions), mask_eos_id)

    @training
    def full_state(self) -> dict:
        return self.runtime.full_state()

    @training
    def save_checkpoint(self, path: str, step: int) -> SaveAck:
        self._refuse(f"the checkpoint of step {step}")
        if step < self.step:  # later than ``step`` (the steps between may have been passed over)
            raise RuntimeError(f"checkpoint of step {step} asked after step {self.step}: calls out of order")
        self.faults.reached("ckpt_write", step)
        return SaveAck(stall_s=self.runtime.save_checkpoint(path, step))

    @plain
    def wait_checkpoint(self) -> WriteAck:
        return self.runtime.wait_checkpoint()

    @training
    def load_checkpoint(self, path: str) -> int:
        """Load the checkpoint at ``path`` into this generation (a collective); its step."""
        with self._loading():
            self.step = self.runtime.load_checkpoint(path)
        return self.step

    @contextmanager
    def _loading(self):
        """Around a load (checkpoint or snapshot: the same path, only the source differs): the
        snapshot copy still reading the state finishes first; a load done starts a new life of the
        generation (part of its snapshots' keys)."""
        with self._lock:
            self.faults.reached("load", self.generation)
            self.snapshot_worker.fence()
            yield
            self.life += 1

    # -- in-memory snapshots (workers/snapshots.py, snapshot_push.py; orchestrator/saves/snapshots.py)
    @on(SNAPSHOT_GROUP)
    def keep_snapshot(self, key: SnapKey, owner: int, snap) -> int:
        """Hold a copy of rank ``owner``'s snapshot (its owner's push, or another actor's
        ``give_snapshot`` answer the driver handed on; Ray resolved the bytes)."""
        return self.snapshots.keep(tuple(key), owner, snap)

    @plain
    def wait_snapshots(self, timeout_s: float) -> tuple:
        """Wait until the snapshot taken last was copied, pushed and acknowledged; the own keys."""
        self.snapshot_worker.wait_idle(timeout_s)
        return tuple(k for k, _ in self.snapshots.inventory().own)

    @plain
    def snapshot_inventory(self, run_id: str = "") -> SnapshotInventory:
        """``run_id`` (the asking driver's run): an actor whose snapshots are another run's (one reused by
        a new controller, as tests do) answers none of them, and drops them (``_enter_run``; two racing
        calls each drop, then agree)."""
        if run_id:
            self._enter_run(run_id)
        return self.snapshots.inventory()

    @on(SNAPSHOT_GROUP)
    def give_snapshot(self, key: SnapKey, owner: int):
        return self.snapshots.find(tuple(key), owner).serialize()

    @on(SNAPSHOT_GROUP)
    def snapshot_meta(self, key: SnapKey, owner: int):
        return self.snapshots.find(tuple(key), owner).metadata

    @on(SNAPSHOT_GROUP)
    def snapshot_pieces(self, key: SnapKey, owner: int, requests: list) -> list:
        return serve_pieces(self.snapshots, tuple(key), owner, requests)

    @training
    def load_snapshot(self, source: RestoreSource) -> RestoreAck:
        """Load snapshot set ``source.key`` into this generation (a collective), fetching from the
        providers only the pieces of the old shards this rank needs."""
        asked, self.asked = self.asked, None
        if asked is not None and asked.key != tuple(source.key):  # a load no join announced (a rollback)
            asked = None
        with self._loading():
            kept = keep_asked(self.snapshots, asked) if asked else 0
            ack = self.runtime.load_snapshot(source, self.snapshots, self.actor_id, asked.metadata if asked else None)
            self.step = ack.step
        return replace(ack, fetched_bytes=ack.fetched_bytes + kept, fetched_ahead=kept)

    @plain
    def arm_fault(self, at: int, kind: str, delay_s: float = 0.3, where: str = "step", steps: int = 1) -> None:
        """Test hook: SIGKILL ("kill") or SIGSTOP ("hang") this process once, ``delay_s`` after reaching
        ``where`` at ``at``: "step" (train step ``at``), "forward" (right after this rank's first
        forward in train step ``at``), "join" / "load" (joining generation ``at`` / loading a
        checkpoint or snapshot in it) or "ckpt_write" (inside the background write of step ``at``'s
        shard, or of the first save after it: a save can be deferred, ``checkpoint.when_busy``).
        ``delay_s`` is ignored at "forward" and "ckpt_write". "nan", "slow", "sleep" take
        ``where="step"``; "sleep" also takes "microbatch" (every microbatch's forward, ``steps`` steps:
        a slower device), "ckpt_write" (every save from step ``at`` stalls ``delay_s``: slow storage) or
        a ``SLEEP_POINTS`` point (workers/faults.py). Bad arguments raise, so a test never arms nothing."""
        self.faults.arm(at, kind, delay_s, where, steps)

    @plain
    def disarm_faults(self) -> None:
        """Test hook: drop every armed fault, so that a test reusing this actor after a run with one
        starts clean (``Faults.disarm``)."""
        self.faults.disarm()

    @training
    def leave_generation(self, generation: int | None = None) -> None:
        with self._lock:
            if generation is None or generation == self.generation:
                self._leave()
                self.asked = None  # a load its join announced never comes now (its shard pinned in Ray's store)

    def _leave(self) -> None:
        if self.runtime is not None:
            from workers.device import release_memory

            self.snapshot_worker.fence()  # the copy reads the state this destroys
            device = self.runtime.groups.device
            self.runtime.destroy()
            self.runtime = None
            release_memory(device)  # before the next generation allocates its own
        self.links.listeners, self.links.conns = (), frozenset()
        self.generation, self.world_rank, self.orders = -1, -1, None

    @plain
    def kick(self, peers: list[tuple[str, int]], gone: list[tuple[str, int]] = (), generation: int | None = None) -> int:
        """Make a collective blocked on a dead peer fail now (runs on a second actor thread).

        gloo: this generation's gloo connections are shut down (``workers.sockets``). NCCL: the
        communicators are aborted (``workers.groups.abort_nccl``) and only the checkpoint group's
        gloo connections are shut down; NCCL's own sockets are never touched.
        Mid-join the new generation's listeners are not known to the driver yet, and a rank may be
        blocked in the rendezvous itself (waiting in the store for a peer that died before
        registering), so then the connection to the store is shut down too, and on gloo the
        connections of listeners opened since the join began (on NCCL those may be NCCL's
        bootstrap: left alone); the join then raises and leaves nothing behind. On NCCL a group's
        communicator is made at its first collective, which reads its NCCL id from the store, so
        there the store connection is shut down after the join too (workers/groups.py).
        ``peers``: the live members' listeners; ``gone``: the dead or cut-off members', whose
        connections are shut only among those the join recorded (``workers.sockets``: a vanished
        host sends no FIN, and its port may be another process's by now). ``generation``: the
        generation the driver is freeing; a kick for an earlier one than this rank is joining or in is
        ignored: its call can outlive the driver's wait (``KICK_S``) on a loaded host and arrive while
        the next generation joins, whose fresh listeners it would shut (peers then read "connection
        refused" as a network fault, with every member alive).
        """
        from workers.groups import abort_nccl
        from workers.sockets import shutdown_gloo_sockets

        current = self.links.joining[0].generation if self.links.joining is not None else self.generation
        if generation is not None and current > generation:
            logger.warning("kick for generation %d ignored: this rank is in generation %d now", generation, current)
            return 0
        if self.links.backend == "nccl" and abort_nccl():
            logger.warning("kick: NCCL communicators aborted")
        local, remote = self.links.targets(peers)
        # ``gone``: listeners of the generation's members that are dead or cut off; matched against the
        # connections recorded at the join only (workers/sockets.py): after the join, never mid-join.
        recorded = self.links.conns if self.links.joining is None else frozenset()
        closed = shutdown_gloo_sockets(local, remote, recorded=recorded, gone_endpoints=set(map(tuple, gone)))
        # Which connections a kick reached, for a survivor that still does not return (docs/design.md,
        # Failure path): its own listeners and the peers' it was given.
        logger.warning("kick (generation %d, busy=%s): shut %d connections; own listeners %s, peers %s, gone %s",
                       self.generation, self.busy, closed, sorted(local), sorted(remote), sorted(map(tuple, gone)))
        return closed

    @plain
    def status(self) -> WorkerStatus:
        return WorkerStatus(
            world_rank=self.world_rank,
            pid=os.getpid(),
            generation=self.generation,
            busy=self.busy,
            step=self.step,
            error=self.error,
            step_compile_s=compile_stats.PROCESS.step_compile_s(),
            stalled_s=self.runtime.stalled_s() if self.busy and self.runtime is not None else None,
        )
