"""FakeWorkerGroup: the worker-group interface the driver's loop uses, scripted; no Ray, no processes.

It implements what ``Controller``, ``CheckpointCoordinator`` and ``orchestrator.recovery.settle`` call
on ``orchestrator.cluster.worker_group.WorkerGroup`` (submit / collect / call / add / kill / kill_now /
free_slots / lost_ids / draining_nodes / all_done / drain / first_cause, and live_ids / pids / node_ips /
node_ids), with in-memory ranks that answer with the real messages (RankInfo, StepResult, SaveAck, WriteAck, WorkerStatus). Checkpoint
shards are real (tiny) files, so the real catalog validates and commits them.

Time never passes: a call has either answered when it was submitted, or it is still running
(pending) until a kick frees it, or forever (hung). Faults are one-shot, armed per (method, actor, at):

* ``"die"``: the process dies in the call; this and every later call of the actor come back dead;
* ``"hang"``: the process stops (SIGSTOP): the call and status polls never answer;
* ``"raise"``: the method raises (for ``train_step``: a latched ``StepResult(ok=False)``);
* ``"slow"``: alive but no answer before the deadline; answers status polls, returns once kicked.

When a collective call (join, train step, save, load) breaks on one member, the other members of the
same fan-out block until kicked, as real ranks do in a collective whose peer is gone.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from checkpoints.layout import DCP_METADATA, parse_step
from meshspeak.messages import (
    CallOutcome,
    JoinSpec,
    RankInfo,
    RuntimeSpec,
    SaveAck,
    StepResult,
    WorkerStatus,
    WriteAck,
)
from orchestrator.errors import WorkerGroupStartupError

COLLECTIVE = ("join_generation", "train_step", "save_checkpoint", "load_checkpoint", "load_snapshot")
KICKED = "RuntimeError: Connection closed by peer (kicked)"


class FakeRank:
    """One rank actor's behaviour, answering with the real messages."""

    def __init__(self, actor_id: int, node_ip: str) -> None:
        self.actor_id, self.node_ip, self.pid = actor_id, node_ip, 10_000 + actor_id
        self.generation = self.world_rank = -1
        self.world = self.dp_rank = 0
        self.step = 0
        self.dead = self.hung = False
        self.files: dict[str, int] = {}
        self.saving_step: int | None = None
        self.loaded: list[str] = []
        self.bad_at: dict[int, str] = {}  # step -> StepResult.bad (scripted on the group: every rank)
        self.forward_s = 0.4  # StepResult.forward_s, what stragglers are scored on (set it higher for one)
        # In-memory snapshots (workers/snapshots.py): own (gen, step) -> record; held (gen, step, owner).
        self.own: dict[tuple[int, int], dict] = {}
        self.held: dict[tuple[int, int, int], dict] = {}
        self.snapshots_loaded: list[list[dict]] = []

    def ping(self) -> tuple[int, str, str]:
        return self.pid, self.node_ip, f"node-{self.node_ip}"

    def join_generation(self, spec: JoinSpec, runtime: RuntimeSpec) -> RankInfo:
        self.generation, self.world_rank, self.world = spec.generation, spec.world_rank, spec.shape.world
        self.dp_rank = spec.shape.coords(spec.world_rank).dp
        return RankInfo(world_rank=spec.world_rank, pid=self.pid, node_ip=self.node_ip,
                        gloo_listeners=((self.node_ip, 40_000 + self.actor_id),), setup_s=0.01,
                        num_params_local=100)

    def leave_generation(self) -> None:
        self.generation = self.world_rank = -1

    def train_step(self, step: int, actions: Any, split: tuple[int, ...] | None = None) -> StepResult:
        self.step = step
        # Each rank reports 1/world of the loss, so the step's loss is the step number.
        bad = self.bad_at.get(step, "")
        # elastic.rebalance: ``forward_s`` is the time at the even share; a rank's speed is fixed, so its
        # time follows its replica's count.
        forward = self.forward_s if split is None else self.forward_s * split[self.dp_rank] * len(split) / sum(split)
        return StepResult(step=step, world_rank=self.world_rank, ok=True, loss=step / self.world,
                          step_time_s=0.5, compute_s=0.4, bad=bad, skipped=bool(bad), own_s=self.forward_s,
                          forward_s=forward)

    def save_checkpoint(self, path: str, step: int) -> SaveAck:
        os.makedirs(path, exist_ok=True)
        contents = {f"__{self.world_rank}_0.distcp": b"x" * 16}
        if self.world_rank == 0:
            # A pickle that imports nothing: the driver checks a checkpoint's .metadata before a
            # restore (checkpoints/safe_pickle.py), as it would a real DCP one.
            contents[DCP_METADATA] = pickle.dumps({"fake": "metadata"})
        self.files = {name: len(data) for name, data in contents.items()}
        for name, data in contents.items():
            with open(os.path.join(path, name), "wb") as f:
                f.write(data)
        self.saving_step = step
        return SaveAck(stall_s=0.01)

    def wait_checkpoint(self) -> WriteAck:
        return WriteAck(write_s=0.1, files=dict(self.files), stall_s=0.02, staging_s=0.005)

    def load_checkpoint(self, path: str) -> int:
        self.loaded.append(path)
        return parse_step(os.path.basename(path))

    def snapshot(self, generation: int, step: int, keep: tuple = ()) -> float:
        keys = {tuple(k) for k in keep} | {(generation, step)}
        self.own = {k: v for k, v in self.own.items() if k in keys}
        self.own[(generation, step)] = {"generation": generation, "step": step, "rank": self.world_rank}
        return 0.001

    def snapshot_blob(self, generation: int, step: int) -> dict:
        return self.own[(generation, step)]

    def keep_snapshot(self, generation: int, step: int, owner: int, snap, keep: tuple = ()) -> int:
        snap = _resolved(snap)  # Ray resolves a ref passed as an argument
        keys = {tuple(k) for k in keep} | {(generation, step)}
        self.held = {k: v for k, v in self.held.items() if k[:2] in keys}
        self.held[(generation, step, owner)] = dict(snap)
        return 64

    def give_snapshot(self, generation: int, step: int, owner: int) -> dict:
        mine = self.own.get((generation, step))
        if mine is not None and mine["rank"] == owner:
            return mine
        return self.held[(generation, step, owner)]

    def load_snapshot(self, *snaps) -> int:
        snaps = [_resolved(s) for s in snaps]
        self.snapshots_loaded.append(snaps)
        return snaps[0]["step"]

    def status(self) -> WorkerStatus:
        return WorkerStatus(world_rank=self.world_rank, pid=self.pid, generation=self.generation,
                            busy=False, step=self.step, error=None)

    def warm(self) -> None:
        pass

    def arm_fault(self, *args) -> None:  # the real actor's test hook; faults here are armed on the group
        pass


def _resolved(value: Any) -> Any:
    """What Ray hands a method for a ref passed as an argument: the value, or the call's error."""
    if isinstance(value, FakeCall):
        if value.state not in ("done", "later"):
            raise RuntimeError(f"argument {value.method} of actor {value.actor} is {value.state}")
        return value.value
    return value


class FakeCall:
    """One call on one actor; also its ref (hashed by identity), as WorkerGroup's refs are."""

    def __init__(self, actor: int, method: str, args: tuple) -> None:
        self.actor, self.method, self.args = actor, method, args
        self.state = "done"  # done | later (done, but a poll says not yet) | dead | failed | blocked | hung
        self.value: Any = None
        self.error = ""


class FakeWorkerGroup:
    """``count`` actors (ids 0..count-1) on ``node_ip``; ``capacity`` more may be started by ``add``."""

    def __init__(self, count: int, *, node_ip: str = "10.0.0.1", capacity: int = 0) -> None:
        self.ranks: dict[int, FakeRank] = {}  # the live actors (WorkerGroup.actors)
        self.gone: dict[int, FakeRank] = {}  # killed actors
        self.pids: dict[int, int] = {}
        self.node_ips: dict[int, str] = {}
        self.node_ids: dict[int, str] = {}  # "node-<ip>"; a test may move actors to other nodes
        self.draining: dict[str, float | None] = {}  # what draining_nodes() answers (scripted)
        self.node_ip = node_ip
        self.capacity = capacity
        self.pending_starts = 0  # start_background: asked for, not placed yet
        self.lost: set[int] = set()  # actors whose node died (what lost_ids reports while they live)
        self.slow_writes = False  # wait_checkpoint answers only when collected, never on a poll
        self.log: list[tuple[str, int, tuple]] = []  # (method, actor, args) of every call, in order
        self.killed: list[int] = []
        self.drained: list[FakeCall] = []
        self._faults: dict[tuple[str, int], tuple[int | None, str, str]] = {}
        self._calls: list[FakeCall] = []
        self._next_id = 0
        self._start(count)

    # -- scripting --------------------------------------------------------------------------------
    def fail(self, method: str, actor: int, kind: str, at: int | None = None,
             message: str = "RuntimeError: boom") -> None:
        """Arm a one-shot fault (see the module docstring). ``at``: the step for train_step and
        save/wait_checkpoint, the generation for join_generation and load_checkpoint; None = next call."""
        assert kind in ("die", "hang", "raise", "slow"), kind
        self._faults[(method, actor)] = (at, kind, message)

    def finish_writes(self) -> None:
        """Background checkpoint writes that were still running (``slow_writes``) end now."""
        for call in self._calls:
            if call.state == "later":
                call.state = "done"

    def bad_step(self, step: int, reason: str = "grad_norm") -> None:
        """Every rank reports ``step`` as bad (skipped: loss or grad norm not finite), each time it runs."""
        for rank in self.ranks.values():
            rank.bad_at[step] = reason

    def calls(self, method: str) -> list[tuple[int, tuple]]:
        return [(actor, args) for m, actor, args in self.log if m == method]

    # -- WorkerGroup's interface ------------------------------------------------------------------
    @property
    def live_ids(self) -> list[int]:
        return sorted(self.ranks)

    def add(self, count: int, *, wait_s: float | None = None, strategy: str = "PACK") -> list[int]:
        if count > self.capacity:
            raise WorkerGroupStartupError(f"could not place {count} workers (the fake cluster has room "
                                          f"for {self.capacity})")
        self.capacity -= count
        return self._start(count)

    def start_background(self, count: int, *, strategy: str = "PACK") -> None:
        self.pending_starts += count  # placed (and answering) once the fake cluster has room

    @property
    def starting(self) -> int:
        return self.pending_starts

    def adopt_started(self) -> list[int]:
        placed = min(self.pending_starts, self.capacity)
        self.pending_starts -= placed
        self.capacity -= placed
        return self._start(placed)

    def free_slots(self) -> int:
        return self.capacity

    @property
    def lost_ids(self) -> list[int]:
        """Live actors on a node that died (scripted: ``lost``)."""
        return sorted(a for a in self.ranks if a in self.lost)

    def draining_nodes(self) -> dict[str, float | None]:
        return dict(self.draining)

    def kill(self, actor_ids) -> None:
        for actor in actor_ids:
            rank = self.ranks.pop(actor, None)
            if rank is not None:
                rank.dead = True
                self.gone[actor] = rank
                self.killed.append(actor)
            self.pids.pop(actor, None)
            self.node_ids.pop(actor, None)

    def kill_now(self, actor_ids) -> None:
        self.kill(sorted(actor_ids))

    def call(self, actor_ids, method: str, args: dict | tuple = (), *, timeout_s: float) -> CallOutcome:
        return self.collect(self.submit(actor_ids, method, args), timeout_s)

    def submit(self, actor_ids, method: str, args: dict | tuple = ()) -> dict:
        refs: dict[FakeCall, int] = {}
        for actor in actor_ids:
            call = FakeCall(actor, method, args.get(actor, ()) if isinstance(args, dict) else args)
            self.log.append((method, actor, call.args))
            self._run(call)
            refs[call] = actor
        broken = any(c.state in ("dead", "hung", "failed") or (c.method == "train_step" and c.state == "done"
                                                                and not c.value.ok) for c in refs)
        if method in COLLECTIVE and broken:
            for call in refs:
                if call.state == "done" and getattr(call.value, "ok", True):
                    call.state = "blocked"  # waiting in a collective for a peer that is gone
        self._calls.extend(refs)
        return refs

    def collect(self, refs: dict, timeout_s: float, *, stop_early=None) -> CallOutcome:
        outcome = CallOutcome()
        for call, actor in refs.items():
            state = self._state(call)
            if state in ("done", "later"):
                call.state = "done"
                outcome.results[actor] = call.value
            elif state == "dead":
                outcome.dead[actor] = "ActorDiedError"
            elif state == "failed":
                outcome.failed[actor] = call.error
            else:
                outcome.pending.append(actor)
                outcome.pending_refs[call] = actor
        return outcome

    def all_done(self, refs) -> bool:
        return all(self._state(c) in ("done", "dead", "failed") for c in refs)

    def drain(self, refs: list) -> list:
        done = [c for c in refs if self._state(c) in ("done", "dead", "failed")]
        self.drained.extend(done)
        return [c for c in refs if c not in done]

    def first_cause(self, refs) -> str | None:
        return next((c.error for c in refs if self._state(c) == "failed"), None)

    # -- inside -----------------------------------------------------------------------------------
    def _start(self, count: int) -> list[int]:
        ids = []
        for _ in range(count):
            actor, self._next_id = self._next_id, self._next_id + 1
            self.ranks[actor] = FakeRank(actor, self.node_ip)
            self.pids[actor], self.node_ips[actor] = self.ranks[actor].pid, self.node_ip
            self.node_ids[actor] = f"node-{self.node_ip}"
            ids.append(actor)
        return ids

    def _state(self, call: FakeCall) -> str:
        if call.state in ("blocked", "hung", "later") and call.actor not in self.ranks:
            return "dead"  # killed while the call ran
        return call.state

    def _run(self, call: FakeCall) -> None:
        rank = self.ranks.get(call.actor)
        if rank is None or rank.dead:
            call.state = "dead"
            return
        if rank.hung:
            call.state = "hung"
            return
        if call.method == "kick":
            for other in self._calls:
                if other.actor == call.actor and other.state == "blocked":
                    self._kicked(other, rank)
            call.value = 1
            return
        fault = self._take_fault(call, rank)
        if fault is None:
            try:
                call.value = getattr(rank, call.method)(*call.args)
            except (KeyError, RuntimeError) as exc:  # the method raised (e.g. a ref argument failed)
                call.state, call.error = "failed", f"{type(exc).__name__}: {exc}"
                return
            if call.method == "wait_checkpoint" and self.slow_writes:
                call.state = "later"
            return
        kind, message = fault
        if kind == "die":
            rank.dead, call.state = True, "dead"
        elif kind == "hang":
            rank.hung, call.state = True, "hung"
        elif kind == "slow":
            call.state = "blocked"
        elif call.method == "train_step":  # latched, as RankActor.train_step does
            call.value = StepResult(step=call.args[0], world_rank=rank.world_rank, ok=False, error=message)
        else:
            call.state, call.error = "failed", message

    def _kicked(self, call: FakeCall, rank: FakeRank) -> None:
        """A blocked call whose sockets the driver shut: the collective raises on this rank."""
        if call.method == "train_step":
            call.state = "done"
            call.value = StepResult(step=call.args[0], world_rank=rank.world_rank, ok=False, error=KICKED)
        else:
            call.state, call.error = "failed", KICKED

    def _take_fault(self, call: FakeCall, rank: FakeRank) -> tuple[str, str] | None:
        armed = self._faults.get((call.method, call.actor))
        if armed is None:
            return None
        at, kind, message = armed
        where = {"train_step": lambda: call.args[0], "save_checkpoint": lambda: call.args[1],
                 "wait_checkpoint": lambda: rank.saving_step,
                 "join_generation": lambda: call.args[0].generation,
                 "load_checkpoint": lambda: rank.generation, "load_snapshot": lambda: rank.generation,
                 "snapshot": lambda: call.args[1], "keep_snapshot": lambda: call.args[1]}.get(call.method, lambda: None)()
        if at is not None and at != where:
            return None
        del self._faults[(call.method, call.actor)]
        return kind, message
