"""An in-process worker group for ``bench/scale.py``'s simulated part: the real ``Controller`` drives
thousands of ranks that answer after simulated latencies, with no processes and no Ray (of
testbed/fake_rank.py's fake rank family: a save leaves the family's files).

``SimGroup`` implements ``orchestrator.cluster.group_protocol.WorkerGroupLike``. A call's answers come
``latency_s[call]`` after it was submitted (the figures part one measured on real Ray); the waiting
is wall time, not CPU. Each rank's answers are built once and reused (a step's snapshot
acknowledgement is set on them in place), so what the process spends per step is the controller's
and the group's bookkeeping: ``SimGroup.cpu_s`` is the group's share (measured inside its own
methods), the rest is the controller's. ``kill_at(step, actor)`` makes an actor die in that step.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from meshspeak.messages import (
    CallOutcome,
    RankInfo,
    RestoreAck,
    SaveAck,
    SnapshotAck,
    SnapshotInventory,
    StepResult,
    WorkerStatus,
    WriteAck,
)
from meshspeak.rank_calls import RankCalls, call_name
from testbed.fake_rank import write_fake_shards


class SimGroup:
    def __init__(self, count: int, *, latency_s: dict[str, float], nodes: int = 16) -> None:
        self.pids = {a: 10_000 + a for a in range(count)}
        self.node_ips = {a: f"10.0.{a % nodes}.1" for a in range(count)}
        self.node_ids = {a: f"node-{a % nodes}" for a in range(count)}
        self.latency_s = latency_s
        self.cpu_s = 0.0  # the group's own CPU, inside its methods
        self._live = set(range(count))
        self._sorted: list[int] | None = None
        self._batches: dict[int, tuple[str, tuple, dict, float]] = {}
        self._ids = itertools.count()
        self._result: dict[int, StepResult] = {}
        self._world: dict[int, int] = {}  # actor -> world rank, of the current generation
        self._generation = 0
        self._taken: list[tuple] = []  # snapshot keys taken, newest last
        self._kill: tuple[int, int] | None = None
        self._dead: set[int] = set()

    # -- scripting --------------------------------------------------------------------------------
    def kill_at(self, step: int, actor: int) -> None:
        self._kill = (step, actor)

    # -- WorkerGroupLike --------------------------------------------------------------------------
    @property
    def live_ids(self) -> list[int]:
        if self._sorted is None:
            self._sorted = sorted(self._live)
        return self._sorted

    @property
    def starting(self) -> int:
        return 0

    @property
    def lost_ids(self) -> list[int]:
        return []  # no node dies under the simulated group: ranks are killed one by one

    def add(self, count: int, *, wait_s: float | None = None, strategy: str = "PACK") -> list[int]:
        raise RuntimeError("the simulated cluster is full")

    def start_background(self, count: int, *, strategy: str = "PACK") -> None:
        pass

    def adopt_started(self) -> list[int]:
        return []

    def free_slots(self) -> int:
        return 0

    def draining_nodes(self) -> dict[str, float | None]:
        return {}

    def kill(self, actor_ids: list[int]) -> None:
        for actor in actor_ids:
            self._live.discard(actor)
            self._dead.add(actor)
        self._sorted = None

    def kill_now(self, actor_ids: set[int] | list[int]) -> None:
        self.kill(list(actor_ids))

    def driver_node(self) -> str:
        return "node-driver"  # the simulated actors are all on nodes of their own

    def exited(self, actor_ids: list[int]) -> set[int]:
        return set()  # in-process ranks: a death is reported at once

    def handle(self, actor_id: int) -> Any:
        return actor_id

    def call(self, actor_ids: list[int], method, args: dict[int, tuple] | tuple = (), *,
             timeout_s: float) -> CallOutcome:
        return self.collect(self.submit(actor_ids, method, args), timeout_s)

    def submit(self, actor_ids: list[int], method, args: dict[int, tuple] | tuple = ()) -> dict:
        t0 = time.thread_time()
        name = call_name(method)
        batch = next(self._ids)
        self._batches[batch] = (name, args, {}, time.monotonic() + self.latency_s.get(name, 0.0))
        if name == "join_generation":
            self._joined(args)
        refs = {(batch, a): a for a in actor_ids}
        self.cpu_s += time.thread_time() - t0
        return refs

    def collect(self, refs: dict, timeout_s: float, *, stop_early=None) -> CallOutcome:
        outcome = CallOutcome()
        if not refs:
            return outcome
        batch = next(iter(refs))[0]
        name, args, _, due = self._batches[batch]
        left = due - time.monotonic()
        if left > 0:
            time.sleep(left)  # the simulated latency: wall time, no CPU
        t0 = time.thread_time()
        if name == "train_step":
            self._stepped(args[0])
        answer = self._answer(name, args)
        live, results = self._live, outcome.results
        for ref, actor in refs.items():
            if actor in live:
                results[actor] = answer(actor)
            else:
                outcome.dead[actor] = "ActorDiedError"
        self.cpu_s += time.thread_time() - t0
        return outcome

    def all_done(self, refs: Any, wait_s: float = 0.0) -> bool:
        return True

    def drain(self, refs: list) -> list:
        return []

    def first_cause(self, refs: Any) -> str | None:
        return None

    # -- the ranks' answers ------------------------------------------------------------------------
    def _joined(self, args: dict) -> None:
        self._generation += 1
        self._world = {actor: a[0].world_rank for actor, a in args.items()}
        self._result = {actor: StepResult(step=0, world_rank=rank, ok=True, loss=1.0 / len(args), step_time_s=1.0,
                                          compute_s=0.9, forward_s=0.4)
                        for actor, rank in self._world.items()}
        self._taken = []
        self._files: dict[int, dict[str, int]] = {}  # actor -> the shard files of its last save

    def _stepped(self, step: int) -> None:
        """Step ``step`` ran: its snapshot is taken, the previous step's acknowledged (in place)."""
        if self._kill is not None and self._kill[0] == step:
            self.kill([self._kill[1]])
            self._kill = None
        acks = (SnapshotAck(key=self._taken[-1], stall_s=0.001, nbytes=1 << 20),) if self._taken else ()
        for result in self._result.values():
            object.__setattr__(result, "snapshots", acks)
        self._taken = (self._taken + [(self._generation, 0, step)])[-3:]

    def _save_shard(self, actor: int, path: str) -> SaveAck:
        """What a save leaves on disk for the commit to check (the run ends with a save of its last step)."""
        self._files[actor] = write_fake_shards(path, self._world[actor])
        return SaveAck(stall_s=0.0)

    def _answer(self, name: str, args):
        if name == "train_step":
            return self._result.__getitem__
        if name == "join_generation":
            return lambda actor: RankInfo(world_rank=self._world[actor], pid=self.pids[actor], node_ip=self.node_ips[actor],
                                          gloo_listeners=((self.node_ips[actor], 40_000),), setup_s=0.01,
                                          num_params_local=1)
        if name == "snapshot_inventory":  # asked before the next generation joins: the current one's
            world, taken = self._world, self._taken
            keys = taken[:-1]  # the newest take's push is still under way

            def inventory(actor):
                if actor not in world:
                    return SnapshotInventory(own=(), held=())
                rank = world[actor]
                return SnapshotInventory(own=tuple((k, rank) for k in keys),
                                         held=tuple((k, (rank - 1) % len(world)) for k in keys))
            return inventory
        if name == "load_snapshot":
            step = args[0].key[2]
            return lambda actor: RestoreAck(step=step, fetched_bytes=1 << 20, shard_bytes=1 << 20)
        if name == "status":
            return lambda actor: WorkerStatus(world_rank=0, pid=self.pids[actor], generation=self._generation,
                                              busy=False, step=0, error=None)
        if name == "save_checkpoint":  # (path, step): each rank a small shard, rank 0 the .metadata too
            return lambda actor: self._save_shard(actor, args[0])
        if name == "wait_checkpoint":
            return lambda actor: WriteAck(write_s=0.0, files=self._files.pop(actor, {}), stall_s=0.0, staging_s=0.0)
        if name == "give_snapshot":  # what a keep_snapshot is handed; the inventories do not change
            return lambda actor: None
        if name == "keep_snapshot":
            return lambda actor: 1 << 20
        if name in ("kick", "warm", "leave_generation", "wait_snapshots"):
            return lambda actor: ()
        raise ValueError(f"the simulated ranks do not answer {name}")


assert set(RankCalls.__dict__) >= {"train_step", "join_generation", "snapshot_inventory", "load_snapshot"}
