"""A rank actor without torch, for ``bench/scale.py``, of testbed/fake_rank.py's fake rank family (the
step order, snapshot retention, save files and checkpoint step are the family's): it implements ``meshspeak.rank_calls.RankCalls``
with the real messages and the real call pattern, and only the training is pretend.

* ``train_step`` sleeps the configured step time on the training thread and answers a ``StepResult``
  of realistic size (per-action timings for ``actions`` pipeline actions); steps are queued as the
  driver sends them and checked for order, as ``workers/actor.py`` does. A ``kick`` ends the step
  under way with an error that later steps of the generation repeat, as a real rank's collectives
  fail once the driver shut its sockets.
* Every ``snapshot_every`` steps it takes a snapshot of ``snapshot_bytes`` (a fresh numpy array: the
  bytes the real rank's copy produces) and pushes it itself to the holder the driver named, on a
  thread of its own (``holder.keep_snapshot.remote``: the bytes go owner node -> holder node); one
  push at a time, acknowledged with the next step's result, as ``workers/snapshot_push.py``.
* A holder copies what it keeps; ``snapshot_inventory`` answers what it holds; ``load_snapshot``
  fetches from the provider of one old rank a shard's worth of pieces (``snapshot_pieces``).
* Checkpoint saves write one small file per rank so the driver's two-phase commit runs for real.

Concurrency groups as the real actor's: WorkerGroup declares them (meshspeak.rank_calls).

Ray's workers import this module from the driver's working directory (``testbed`` is not installed):
run the bench from the repository root, as ``bench/README.md`` does.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import ray

from meshspeak.messages import (
    ActionTiming,
    GenerationOrders,
    JoinSpec,
    RankInfo,
    RestoreAck,
    RestoreSource,
    RuntimeSpec,
    SaveAck,
    SnapshotAck,
    SnapshotInventory,
    SplitOrders,
    StepResult,
    WorkerStatus,
    WriteAck,
)
from meshspeak.rank_calls import SNAPSHOT_GROUP, TRAIN_GROUP, RankCalls, call_name
from testbed.fake_rank import checkpoint_step, refused, retained, write_fake_shards


class FakeRankActor:
    def __init__(self, actor_id: int, step_s: float = 1.0, snapshot_bytes: int = 1 << 20, actions: int = 16) -> None:
        self.actor_id, self.step_s, self.snapshot_bytes, self.n_actions = actor_id, step_s, snapshot_bytes, actions
        self.generation = self.world_rank = -1
        self.life = self.step = 0
        self.orders: GenerationOrders | None = None
        self.error: str | None = None
        self.files: dict[str, int] = {}
        self.own: dict[tuple, tuple[np.ndarray, int]] = {}  # key -> (bytes, the world rank it had)
        self.held: dict[tuple, np.ndarray] = {}
        self._lock = threading.Lock()
        self._acks: list[SnapshotAck] = []
        self._pushing = threading.Event()
        self._kicked = threading.Event()  # the driver's kick: the generation's "collectives" are broken
        # Seconds this rank's training thread sat idle before each step (since its previous step
        # ended): the time it waited for the driver's next call (``idle_before``).
        self._last_end: float | None = None
        self.idle: dict[int, tuple[float, float]] = {}

    # -- life and health --------------------------------------------------------------------------
    def ping(self) -> tuple[int, str, str, int]:
        from meshspeak.pids import pid_namespace

        return os.getpid(), ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), pid_namespace()

    def warm(self, family: str = "") -> None:
        pass

    def status(self) -> WorkerStatus:
        return WorkerStatus(world_rank=self.world_rank, pid=os.getpid(), generation=self.generation,
                            busy=False, step=self.step, error=self.error)

    def kick(self, peers: list[tuple[str, int]], gone: list[tuple[str, int]] = (), generation: int | None = None) -> int:
        """As the real kick shuts the generation's sockets: the step under way fails now and every
        later one of the generation refuses (a real rank's next collective would fail)."""
        self._kicked.set()
        return 1

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def train_threads(self) -> int:
        return 1

    def arm_fault(self, at: int, kind: str, delay_s: float = 0.3, where: str = "step", steps: int = 1) -> None:
        pass

    def disarm_faults(self) -> None:
        pass

    # -- generations and steps --------------------------------------------------------------------
    @ray.method(concurrency_group=TRAIN_GROUP)
    def join_generation(self, gen: JoinSpec, spec: RuntimeSpec, orders: GenerationOrders) -> RankInfo:
        self.generation, self.world_rank, self.orders = gen.generation, gen.world_rank, orders
        self.life = self.step = 0
        self.error = None
        self._kicked.clear()
        self._last_end, self.idle = None, {}
        return RankInfo(world_rank=gen.world_rank, pid=os.getpid(), node_ip=ray.util.get_node_ip_address(),
                        gloo_listeners=(), setup_s=0.0, num_params_local=self.snapshot_bytes // 4)

    @ray.method(concurrency_group=TRAIN_GROUP)
    def leave_generation(self, generation: int | None = None) -> None:
        if generation is None or generation == self.generation:
            self.generation = self.world_rank = -1

    @ray.method(concurrency_group=TRAIN_GROUP)
    def train_step(self, step: int, keep: tuple = (), after: int | None = None,
                   split: SplitOrders | None = None) -> StepResult:
        if self.error is None:  # an out-of-order call latches its error, as a real rank's does
            refusal = refused(step, after, self.step, self.world_rank)
            if refusal is not None and refusal.early:
                return refusal
            self.error = None if refusal is None else refusal.error
        if self.error is not None:
            return StepResult(step=step, world_rank=self.world_rank, ok=False, error=self.error)
        t0 = time.perf_counter()
        if self._last_end is not None:  # (idle seconds, when the step before ended: wall clock)
            self.idle[step] = (t0 - self._last_end, time.time() - (t0 - self._last_end))
        if self._kicked.wait(self.step_s):  # "a peer died": the step's collective raises
            self.error = "RuntimeError: Connection closed by peer (kicked)"
            return StepResult(step=step, world_rank=self.world_rank, ok=False, error=self.error)
        wall = time.perf_counter() - t0
        self._last_end = t0 + wall
        self.step = step
        self._retain(tuple(keep) or None)
        with self._lock:
            acks, self._acks = tuple(self._acks), []
        every = self.orders.snapshot_every
        if every and step % every == 0 and self.orders.holder is not None and not self._pushing.is_set():
            self._pushing.set()
            key = (self.generation, self.life, step)
            self.own[key] = (np.full(self.snapshot_bytes, step % 251, dtype=np.uint8), self.world_rank)
            threading.Thread(target=self._push, args=(key,), daemon=True).start()
        timings = tuple(ActionTiming(f"{i % 2}F{i // 2}", i * wall / self.n_actions, (i + 1) * wall / self.n_actions)
                        for i in range(self.n_actions))
        return StepResult(step=step, world_rank=self.world_rank, ok=True, loss=1.0 / max(1, self.world_rank + 1),
                          step_time_s=wall, compute_s=wall * 0.9, timings=timings, own_s=0.001, forward_s=wall / 2,
                          snapshots=acks)

    def idle_before(self) -> dict[int, tuple[float, float]]:
        """Step -> (seconds the training thread waited for that step's call after the step before
        ended, when that step ended by the wall clock), in the current generation (bench/scale.py
        reads it directly: not a rank call)."""
        return dict(self.idle)

    def _push(self, key: tuple) -> None:
        try:
            holder = self.orders.holder
            snap, rank = self.own[key]
            nbytes = ray.get(getattr(holder, call_name(RankCalls.keep_snapshot)).remote(key, rank, snap), timeout=600)
            with self._lock:
                self._acks.append(SnapshotAck(key=key, stall_s=0.0, nbytes=int(nbytes)))
        except Exception:
            pass
        finally:
            self._pushing.clear()

    def _retain(self, keep: tuple | None) -> None:
        with self._lock:  # the holder's keep_snapshot adds to ``held`` on another thread
            self.own, self.held = retained(self.own, self.held, keep)

    @ray.method(concurrency_group=TRAIN_GROUP)
    def eval_step(self, path: str, batch: int, mask_eos_id: int | None) -> dict:
        return {"loss": 1.0, "count": 1}

    @ray.method(concurrency_group=TRAIN_GROUP)
    def full_state(self) -> dict:
        return {}

    # -- checkpoints ------------------------------------------------------------------------------
    @ray.method(concurrency_group=TRAIN_GROUP)
    def save_checkpoint(self, path: str, step: int) -> SaveAck:
        self.files = write_fake_shards(path, self.world_rank)
        return SaveAck(stall_s=0.0)

    def wait_checkpoint(self) -> WriteAck:
        return WriteAck(write_s=0.0, files=dict(self.files), stall_s=0.0, staging_s=0.0)

    @ray.method(concurrency_group=TRAIN_GROUP)
    def load_checkpoint(self, path: str) -> int:
        self.step = checkpoint_step(path)
        self.life += 1
        return self.step

    # -- snapshots --------------------------------------------------------------------------------
    @ray.method(concurrency_group=SNAPSHOT_GROUP)
    def keep_snapshot(self, key: tuple, owner: int, snap) -> int:
        copy = np.array(snap, copy=True)  # ours: the bytes the holder owns
        with self._lock:
            self.held[(tuple(key), owner)] = copy
        return copy.nbytes

    @ray.method(concurrency_group=SNAPSHOT_GROUP)
    def give_snapshot(self, key: tuple, owner: int):
        key = tuple(key)
        with self._lock:
            own = self.own.get(key)
            return own[0] if own is not None and own[1] == owner else self.held[(key, owner)]

    def wait_snapshots(self, timeout_s: float) -> tuple:
        deadline = time.monotonic() + timeout_s
        while self._pushing.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        return tuple(self.own)

    def snapshot_inventory(self, run_id: str = "") -> SnapshotInventory:
        with self._lock:
            return SnapshotInventory(own=tuple((k, rank) for k, (_, rank) in self.own.items()), held=tuple(self.held))

    @ray.method(concurrency_group=SNAPSHOT_GROUP)
    def snapshot_meta(self, key: tuple, owner: int):
        return {"bytes": self.snapshot_bytes}

    @ray.method(concurrency_group=SNAPSHOT_GROUP)
    def snapshot_pieces(self, key: tuple, owner: int, requests: list) -> list:
        key = tuple(key)
        with self._lock:
            snap = self.held[(key, owner)] if (key, owner) in self.held else self.own[key][0]
        return [snap]

    @ray.method(concurrency_group=TRAIN_GROUP)
    def load_snapshot(self, source: RestoreSource) -> RestoreAck:
        """A shard's worth of pieces from the provider of old rank ``world_rank % old world``."""
        rank, actor, handle = source.providers[self.world_rank % len(source.providers)]
        if actor == self.actor_id:
            key = tuple(source.key)
            piece = self.held[(key, rank)] if (key, rank) in self.held else self.own[key][0]
        else:
            piece = ray.get(getattr(handle, call_name(RankCalls.snapshot_pieces)).remote(source.key, rank, [None]),
                            timeout=600)[0]
        self.step, self.life = source.key[2], self.life + 1
        return RestoreAck(step=source.key[2], fetched_bytes=int(piece.nbytes), shard_bytes=self.snapshot_bytes)
