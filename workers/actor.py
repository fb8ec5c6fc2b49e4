"""RankActor: the thin Ray shell around one rank. Knows nothing of placement, policy or other actors.

All training work (joining a generation, steps, held-out eval, snapshots, saving and loading
checkpoints, gathering the state) runs on one long-lived thread: the ``TRAIN_GROUP`` concurrency
group, one thread. Other calls run on the default group's small pool, so while the training thread
is inside a step — possibly blocked in a collective whose peer died — the driver can still poll the
actor, park a ``wait_checkpoint`` and tell it to free the step (``kick``: gloo sockets shut down, NCCL
communicators aborted). Every error inside a step is latched into the returned ``StepResult``; the
driver decides what happens next.

In-memory snapshots (``workers/snapshots.py``): ``snapshot`` and ``load_snapshot`` are training work;
handing one out (``snapshot_blob``, ``give_snapshot``) and keeping a peer's copy (``keep_snapshot``,
its argument a ref the driver passed, resolved by Ray) run on the other threads while training goes on.

Faults can be injected on purpose (``arm_fault``) at five points — at (or a delay into) a training
step, right after the rank's first forward of a step (deterministically mid-step: its peers are then
blocked in that step's collectives), at the start of joining a generation, at the start of loading a
checkpoint, and inside the background checkpoint write — so tests can prove recovery from each.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback

import ray
import torch

from meshspeak.messages import JoinSpec, RankInfo, RuntimeSpec, SaveAck, StepResult, WorkerStatus, WriteAck
from meshspeak.schedule import Action
from workers.profiling import profiled_step
from workers.snapshots import SnapshotStore
from workers.write_faults import dcp_write_function, die_inside_next_dcp_write

logger = logging.getLogger(__name__)

# Why one thread: DTensor's sharding-propagation caches (and torch's other per-thread state) are per
# thread, so on Ray's rotating pool every new thread paid the warm-up again: steps 1-4 of the default
# job took 1.6-2.8 s, then 0.3-0.5 s. On one thread step 2 is already at full speed.
TRAIN_GROUP = "train"


def _train(method):
    """Run ``method`` in the training thread (and note that thread, for ``train_threads``)."""

    def on_train_thread(self, *args, **kwargs):
        self._train_threads.add(threading.get_ident())
        return method(self, *args, **kwargs)

    # Not functools.wraps: with __wrapped__ set, Ray 2.60 ignored the concurrency group and ran the
    # method on the default pool (measured: 3 threads over 10 calls instead of 1).
    on_train_thread.__name__, on_train_thread.__qualname__ = method.__name__, method.__qualname__
    on_train_thread.__doc__ = method.__doc__
    return ray.method(concurrency_group=TRAIN_GROUP)(on_train_thread)


FAULT_SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}
# Faults that leave the process running, in the ``steps`` train steps from ``at``: "nan" puts a NaN
# into this rank's gradient (a bad step); "slow" burns ``delay_s`` CPU seconds and "sleep" sleeps
# ``delay_s`` inside the first block's forward of the step (a straggler: workers/compute_clock.py).
# "sleep" at where="microbatch": in every microbatch's (a slower device: bench/rebalance.py).
STEP_FAULTS = ("nan", "slow", "sleep")
# Where a fault fires; ``at`` is a step number for "step"/"ckpt_write", a generation number otherwise.
FAULT_POINTS = ("step", "forward", "join", "load", "ckpt_write")
# Delays that widen a race on purpose (kind "sleep"; ``at`` is a step): "snapshot" sleeps ``delay_s``
# before the snapshot of step ``at`` reads the state; "eval" sleeps ``delay_s`` inside the first
# block's forward of the first eval batch after step ``at`` (its parameters unsharded by FSDP then).
SLEEP_POINTS = ("snapshot", "eval")


class RankActor:
    def __init__(self, actor_id: int, profile=None) -> None:
        # Ranks share few cores; one intra-op thread each avoids oversubscription (docs/design.md, F13).
        torch.set_num_threads(1)
        logging.basicConfig(
            level=logging.INFO, format=f"%(asctime)s [actor={actor_id}] %(name)s: %(message)s"
        )
        self.actor_id = actor_id
        self.profile = profile  # workers.profiling.ProfileSpec: which steps to trace (metrics.profile_steps)
        self.runtime = None
        self.generation = -1
        self.world_rank = -1
        self.step = 0
        self.busy = False
        self.error: str | None = None
        self.gloo_listeners: tuple[tuple[str, int], ...] = ()
        self._backend = "gloo"  # of the current (or joining) generation's training groups
        self._lock = threading.Lock()
        self._train_threads: set[int] = set()  # threads that ran training work (one, by design)
        self._faults: dict[str, tuple[int, str, float]] = {}  # point -> (at, kind, delay_s)
        self._step_faults: dict[str, tuple[int, int, float]] = {}  # STEP_FAULTS kind -> (at, steps, delay_s)
        self._sleeps: dict[str, tuple[int, float]] = {}  # SLEEP_POINTS point -> (at, delay_s)
        # While a join is in progress: (its spec, listening ports before it). A kick then also frees
        # a rendezvous blocked on a peer that died mid-join (see ``kick``).
        self._joining: tuple[JoinSpec, frozenset[int]] | None = None
        self._store: tuple[str, int] | None = None  # the current generation's rendezvous store
        self.snapshots = SnapshotStore()  # outlives generations: a rebuild restores from it

    def ping(self) -> tuple[int, str, str]:
        """(pid, node IP, Ray node id): several nodes may share one IP (e.g. in tests)."""
        return os.getpid(), ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def warm(self) -> None:
        """Import what joining a generation needs (FSDP2, DTensor, the model code), so that a hot spare
        joins as fast as a member re-forms (``elastic.spares``)."""
        import workers.groups  # noqa: F401
        import workers.runtime  # noqa: F401

    def train_threads(self) -> int:
        """How many distinct threads have run this actor's training work (1 unless misconfigured)."""
        return len(self._train_threads)

    def node_id(self) -> str:
        """The Ray node this actor runs on (several nodes may share one IP, e.g. in tests)."""
        return ray.get_runtime_context().get_node_id()

    @_train
    def join_generation(self, gen: JoinSpec, spec: RuntimeSpec) -> RankInfo:
        """Leave the current generation (if any) and join ``gen`` as ``gen.world_rank``: this rank's
        ``RankGroups`` and ``RankRuntime`` for it are built here."""
        from workers import sockets
        from workers.device import backend_for, select_device
        from workers.groups import build_process_groups
        from workers.runtime import RankRuntime

        with self._lock:
            t0 = time.perf_counter()
            self._leave()
            # A GPU job on a rank without CUDA fails here, in one line (no silent gloo fallback).
            device = select_device(spec.use_gpu, gpu_ids=ray.get_gpu_ids(),
                                   where=f"rank {gen.world_rank} on {ray.util.get_node_ip_address()}")
            self._backend = backend_for(device)
            if device.type == "cuda":
                # The host's share of a GPU rank (the offloaded optimizer step, data, staging) gets
                # the CPUs Ray reserved for it, not the one thread CPU ranks share cores with.
                cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
                torch.set_num_threads(max(1, int(cpus)))
            self._joining = (gen, frozenset(sockets.listening_ports()))
            try:
                self._maybe_fire_fault("join", gen.generation)
                groups = build_process_groups(
                    store_addr=gen.store_addr,
                    store_port=gen.store_port,
                    store_prefix=gen.store_prefix,
                    store_secret=gen.store_secret,
                    generation=gen.generation,
                    shape=gen.shape,
                    world_rank=gen.world_rank,
                    timeout_s=spec.collective_timeout_s,
                    device=device,
                    replicate=spec.dp.replicate,
                )
                try:
                    self.runtime = RankRuntime(spec, groups)
                except BaseException:
                    groups.destroy()
                    raise
            finally:
                self._joining = None
            self.generation, self.world_rank, self.error = gen.generation, gen.world_rank, None
            self._store = (gen.store_addr, gen.store_port)
            ip = ray.util.get_node_ip_address()
            self.gloo_listeners = tuple((ip, port) for port in groups.gloo_ports)
            return RankInfo(
                world_rank=gen.world_rank,
                pid=os.getpid(),
                node_ip=ip,
                gloo_listeners=self.gloo_listeners,
                setup_s=time.perf_counter() - t0,
                num_params_local=sum(p.numel() for p in self.runtime.params),
            )

    @_train
    def train_step(self, step: int, actions: list[Action], split: tuple[int, ...] | None = None) -> StepResult:
        self.busy, self.step = True, step
        self._maybe_fire_fault("step", step)
        try:
            if self.runtime is None:
                raise RuntimeError("train_step before join_generation")
            self._arm_forward_fault(step)
            self._arm_step_faults(step)
            with profiled_step(self.profile, step, self.world_rank, self.generation):
                return self.runtime.train_step(step, actions, split)
        except Exception as exc:  # latched: the driver decides (rebuild, retry or stop)
            self.error = f"{type(exc).__name__}: {exc}"
            logger.warning("step %d failed: %s\n%s", step, self.error, traceback.format_exc(limit=4))
            return StepResult(step=step, world_rank=self.world_rank, ok=False, error=self.error)
        finally:
            self.busy = False

    @_train
    def eval_step(self, path: str, batch: int, actions: list[Action], mask_eos_id: int | None) -> dict:
        """Held-out loss of eval batch ``batch`` (forward only); errors propagate to the driver.

        Training work: it queues behind the snapshot the driver submitted just before it (not
        awaited). On another thread FSDP2's state-dict hook, run by the snapshot, would reshard the
        modules in the middle of the eval forward (tests/ray/test_data_eval.py)."""
        if self.runtime is None:
            raise RuntimeError("eval_step before join_generation")
        if batch == 0:  # test hook (arm_fault "sleep" at "eval"): consumed by the first block's forward
            self.runtime.compute_clock.sleep_s = self._take_sleep("eval", self.step)
        return self.runtime.eval_step(path, batch, actions, mask_eos_id)

    @_train
    def full_state(self) -> dict:
        return self.runtime.full_state()

    @_train
    def save_checkpoint(self, path: str, step: int) -> SaveAck:
        fault = self._take_fault("ckpt_write", step)
        if fault is not None:
            die_inside_next_dcp_write(FAULT_SIGNALS[fault[1]])
        return SaveAck(stall_s=self.runtime.save_checkpoint(path, step))

    def wait_checkpoint(self) -> WriteAck:
        return self.runtime.wait_checkpoint()

    @_train
    def load_checkpoint(self, path: str) -> int:
        with self._lock:
            self._maybe_fire_fault("load", self.generation)
            return self.runtime.load_checkpoint(path)

    # -- in-memory snapshots (workers/snapshots.py, orchestrator/saves/snapshots.py) ---------------------
    @_train
    def snapshot(self, generation: int, step: int, keep: tuple = ()) -> float:
        """Take this rank's snapshot of ``step`` (at the step boundary); returns the seconds it took.
        Snapshots other than ``keep`` and this one are dropped."""
        t0 = time.perf_counter()
        key = (generation, step)
        time.sleep(self._take_sleep("snapshot", step))  # test hook: 0 unless armed
        try:
            if self.runtime is None or generation != self.generation:
                raise RuntimeError(f"snapshot of generation {generation} while in {self.generation}")
            self.snapshots.put_own(key, self.runtime.take_snapshot(step), keep)
        except Exception as exc:
            self.snapshots.put_own(key, None, keep, f"{type(exc).__name__}: {exc}")
            raise
        return time.perf_counter() - t0

    def snapshot_blob(self, generation: int, step: int):
        """This rank's own snapshot of ``step`` (the driver hands the ref to its holder)."""
        return self.snapshots.blob((generation, step), timeout_s=600.0)

    def keep_snapshot(self, generation: int, step: int, owner: int, snap, keep: tuple = ()) -> int:
        """Hold a copy of rank ``owner``'s snapshot (resolved by Ray from the ref the driver passed)."""
        return self.snapshots.keep((generation, step), owner, snap, keep)

    def give_snapshot(self, generation: int, step: int, owner: int):
        return self.snapshots.give((generation, step), owner)

    @_train
    def load_snapshot(self, *snapshots) -> int:
        """Load the snapshots of every rank of one step into this generation (a collective)."""
        with self._lock:
            self._maybe_fire_fault("load", self.generation)
            return self.runtime.load_snapshot(list(snapshots))

    def arm_fault(self, at: int, kind: str, delay_s: float = 0.3, where: str = "step", steps: int = 1) -> None:
        """Test hook: SIGKILL ("kill") or SIGSTOP ("hang") this process once, ``delay_s`` after reaching
        ``where`` at ``at``: "step" (train step ``at``), "forward" (right after this rank's first
        forward in train step ``at``), "join" / "load" (joining generation ``at`` / loading a
        checkpoint in it) or "ckpt_write" (inside the background write of step ``at``'s shard).
        ``delay_s`` is ignored at "forward" and "ckpt_write". ``STEP_FAULTS`` ("nan", "slow", "sleep": see
        there) take ``where="step"``; "sleep" also takes "microbatch" or a ``SLEEP_POINTS`` point. Bad
        arguments raise, so a test never arms nothing."""
        if (kind in STEP_FAULTS and where == "step" or kind == "sleep" and where == "microbatch") and steps >= 1:
            self._step_faults[kind if where == "step" else "sleep_each"] = (at, steps, delay_s)
            return
        if kind == "sleep" and where in SLEEP_POINTS:
            self._sleeps[where] = (at, delay_s)
            return
        if kind not in FAULT_SIGNALS or where not in FAULT_POINTS:
            raise ValueError(f"arm_fault: kind must be one of {list(FAULT_SIGNALS)}, "
                             f"where one of {list(FAULT_POINTS)}")
        if where == "ckpt_write":
            dcp_write_function()  # fail now, not silently at the write, if torch moved it
        self._faults[where] = (at, kind, delay_s)

    @_train
    def leave_generation(self) -> None:
        with self._lock:
            self._leave()

    def _leave(self) -> None:
        if self.runtime is not None:
            from workers.device import release_memory

            device = self.runtime.groups.device
            self.runtime.destroy()
            self.runtime = None
            release_memory(device)  # before the next generation allocates its own
        self.generation, self.world_rank = -1, -1

    def kick(self, peers: list[tuple[str, int]]) -> int:
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
        """
        from workers.groups import abort_nccl
        from workers.sockets import endpoint, listening_ports, shutdown_gloo_sockets

        if self._backend == "nccl" and abort_nccl():
            logger.warning("kick: NCCL communicators aborted")
        local = {port for _, port in self.gloo_listeners}
        remote = set(map(tuple, peers))
        joining = self._joining
        if joining is not None:
            gen, before = joining
            if self._backend == "gloo":
                local |= listening_ports() - before
            remote.add(endpoint(gen.store_addr, gen.store_port))
        elif self._backend == "nccl" and self._store is not None:
            remote.add(endpoint(*self._store))
        return shutdown_gloo_sockets(local, remote)

    def _take_sleep(self, where: str, at: int) -> float:
        """The armed ``SLEEP_POINTS`` delay at ``where`` for ``at`` (once), else 0."""
        armed = self._sleeps.get(where)
        if armed is None or armed[0] != at:
            return 0.0
        del self._sleeps[where]
        logger.warning("fault injection: sleep %.2fs at %s %d", armed[1], where, at)
        return armed[1]

    def _take_fault(self, where: str, at: int) -> tuple[int, str, float] | None:
        fault = self._faults.get(where)
        if fault is None or fault[0] != at:
            return None
        del self._faults[where]
        return fault

    def _arm_step_faults(self, step: int) -> None:
        """Hand the runtime this step's share of the armed "nan" / "slow" / "sleep" faults."""
        def armed(kind: str) -> tuple[int, int, float] | None:
            fault = self._step_faults.get(kind)
            return fault if fault is not None and fault[0] <= step < fault[0] + fault[1] else None

        self.runtime.inject_nan_grad = armed("nan") is not None
        slow, sleep, each = armed("slow"), armed("sleep"), armed("sleep_each")
        self.runtime.inject_busy_s = slow[2] if slow is not None else 0.0
        self.runtime.inject_sleep_s = sleep[2] if sleep is not None else 0.0
        self.runtime.inject_sleep_each_s = each[2] if each is not None else 0.0
        if self.runtime.inject_nan_grad or self.runtime.inject_busy_s or self.runtime.inject_sleep_s or each:
            logger.warning("fault injection at step %d: nan=%s busy=%.2fs sleep=%.2fs sleep/microbatch=%.3fs", step,
                           self.runtime.inject_nan_grad, self.runtime.inject_busy_s, self.runtime.inject_sleep_s,
                           self.runtime.inject_sleep_each_s)

    def _arm_forward_fault(self, step: int) -> None:
        """A one-shot forward hook on this rank's first stage signals the process when that forward
        returns. Unlike a timer ("step" with a delay) it cannot miss the step when the step is fast."""
        fault = self._take_fault("forward", step)
        if fault is None:
            return
        sig = FAULT_SIGNALS[fault[1]]
        module = self.runtime.stages[min(self.runtime.stages)].module

        def signal_after_forward(*_):
            handle.remove()  # one-shot: a SIGSTOPped rank that is continued runs on unhooked
            logger.warning("fault injection: %s after the first forward of step %d", fault[1], step)
            os.kill(os.getpid(), sig)

        handle = module.register_forward_hook(signal_after_forward)

    def _maybe_fire_fault(self, where: str, at: int) -> None:
        fault = self._take_fault(where, at)
        if fault is None:
            return
        _, kind, delay = fault
        logger.warning("fault injection: %s at %s %d", kind, where, at)
        if delay <= 0:
            os.kill(os.getpid(), FAULT_SIGNALS[kind])  # right here, deterministically
        else:
            threading.Timer(delay, os.kill, (os.getpid(), FAULT_SIGNALS[kind])).start()

    def status(self) -> WorkerStatus:
        return WorkerStatus(
            world_rank=self.world_rank,
            pid=os.getpid(),
            generation=self.generation,
            busy=self.busy,
            step=self.step,
            error=self.error,
        )

