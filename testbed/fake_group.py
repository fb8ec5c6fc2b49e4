"""FakeWorkerGroup: the worker-group interface the driver's loop uses, scripted; no Ray, no processes.

It implements ``orchestrator.cluster.group_protocol.WorkerGroupLike`` (what ``Controller``,
``CheckpointCoordinator`` and ``orchestrator.recovery.settle`` use of the Ray-backed ``WorkerGroup``),
with in-memory ranks (``FakeRank``, which implements ``meshspeak.rank_calls.RankCalls``) that answer
with the real messages (RankInfo, StepResult, SaveAck, WriteAck, WorkerStatus); both conformances are
checked by tests/unit/test_group_protocol.py and test_rank_calls.py. Calls and the scripting below
name rank methods through ``RankCalls`` (``group.fail(RankCalls.train_step, ...)``). Checkpoint
shards are real (tiny) files, so the real catalog validates and commits them.

Time never passes: a call has either answered when it was submitted, or it is still running
(pending) until a kick frees it, or forever (hung). Faults are one-shot, armed per (method, actor, at):

* ``"die"``: the process dies in the call; this and every later call of the actor come back dead;
* ``"hang"``: the process stops (SIGSTOP): the call and status polls never answer;
* ``"raise"``: the method raises (for ``train_step``: a latched ``StepResult(ok=False)``);
* ``"slow"``: alive but no answer before the deadline; answers status polls, returns once kicked;
* ``"early"`` (``train_step`` only): the call reached the rank before the step it follows, as Ray may
  deliver a threaded actor's calls: answered ``StepResult(early=True)``, nothing trained.

When a collective call (join, train step, save, load) breaks on one member, the other members of the
same fan-out block until kicked, as real ranks do in a collective whose peer is gone.
"""

from __future__ import annotations

import inspect
from typing import Any

from meshspeak.messages import CallOutcome, StepResult, early_answer
from meshspeak.rank_calls import RankCall, RankCalls, call_name
from orchestrator.errors import WorkerGroupStartupError
from testbed.fake_call import FakeCall
from testbed.fake_rank import FakeRank

__all__ = ["FakeCall", "FakeRank", "FakeWorkerGroup", "KICKED"]

COLLECTIVE = (RankCalls.join_generation, RankCalls.train_step, RankCalls.save_checkpoint, RankCalls.load_checkpoint,
              RankCalls.load_snapshot)
KICKED = "RuntimeError: Connection closed by peer (kicked)"


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
        # adopt_started calls a background start waits before it is placed (an actor importing torch)
        self.start_polls = 0
        self._start_polled = 0
        self.lost: set[int] = set()  # actors whose node died (what lost_ids reports while they live)
        self.exited_ids: set[int] = set()  # actors whose process is seen gone before "Ray" reports it
        self.slow_writes = False  # wait_checkpoint answers only when collected, never on a poll
        # A call slower than the driver's wait (a write, a join, a load): method -> how many collects of
        # such calls find them still pending (their ranks alive and answering status) before they answer.
        self.collects_pending: dict[RankCall, int] = {}
        self.log: list[tuple[RankCall, int, tuple]] = []  # (method, actor, args) of every call, in order
        self.killed: list[int] = []
        self.drained: list[FakeCall] = []
        self._faults: dict[tuple[RankCall, int], tuple[int | None, str, str]] = {}
        self.keep_of: dict[int, tuple | None] = {}  # actor -> the snapshot key it was told to keep
        self._calls: list[FakeCall] = []
        self._next_id = 0
        self._start(count)

    # -- scripting --------------------------------------------------------------------------------
    def fail(self, method: RankCall, actor: int, kind: str, at: int | None = None,
             message: str = "RuntimeError: boom") -> None:
        """Arm a one-shot fault (see the module docstring). ``at``: the step for train_step,
        save/wait_checkpoint and keep_snapshot (the step of the snapshot a holder takes in), the
        generation for join_generation and load_checkpoint/load_snapshot; None = next call."""
        assert kind in ("die", "hang", "raise", "slow", "early"), kind
        assert kind != "early" or method is RankCalls.train_step, "early: train_step only"
        call_name(method)  # only entries of RankCalls
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

    def calls(self, method: RankCall) -> list[tuple[int, tuple]]:
        call_name(method)
        return [(actor, args) for m, actor, args in self.log if m is method]

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
        if self.pending_starts and self._start_polled < self.start_polls:
            self._start_polled += 1
            return []
        self._start_polled = 0
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

    def kill(self, actor_ids: list[int]) -> None:
        for actor in actor_ids:
            rank = self.ranks.pop(actor, None)
            if rank is not None:
                rank.dead = True
                self.gone[actor] = rank
                self.killed.append(actor)
            self.pids.pop(actor, None)
            self.node_ids.pop(actor, None)

    def kill_now(self, actor_ids: set[int] | list[int]) -> None:
        self.kill(sorted(actor_ids))

    def driver_node(self) -> str:
        return "node-driver"  # none of the fake actors runs there unless a test moves one

    def exited(self, actor_ids: list[int]) -> set[int]:
        return {a for a in actor_ids if a in self.exited_ids}

    def call(self, actor_ids: list[int], method: RankCall, args: dict[int, tuple] | tuple = (), *,
             timeout_s: float) -> CallOutcome:
        return self.collect(self.submit(actor_ids, method, args), timeout_s)

    def submit(self, actor_ids: list[int], method: RankCall, args: dict[int, tuple] | tuple = ()) -> dict:
        call_name(method)  # only entries of RankCalls
        refs: dict[FakeCall, int] = {}
        for actor in actor_ids:
            call = FakeCall(actor, method, args.get(actor, ()) if isinstance(args, dict) else args)
            _bind(method, call.args)
            self.log.append((method, actor, call.args))
            self._run(call)
            refs[call] = actor
        broken = any(c.state in ("dead", "hung", "failed") or (c.method is RankCalls.train_step and c.state == "done"
                                                                and not c.value.ok and not c.value.early) for c in refs)
        if method in COLLECTIVE and broken:
            for call in refs:
                if call.state == "done" and getattr(call.value, "ok", True):
                    call.state = "blocked"  # waiting in a collective for a peer that is gone
        self._calls.extend(refs)
        if method is RankCalls.train_step:  # the ranks' snapshots and pushes, after the step (snapshot_push.py)
            for call in refs:
                if call.actor in self.ranks:
                    self.ranks[call.actor].take_now(whole=not broken)
                    self.ranks[call.actor].push_taken()
        return refs

    def collect(self, refs: dict, timeout_s: float, *, stop_early=None) -> CallOutcome:
        outcome = CallOutcome()
        slow = {c.method for c in refs if self.collects_pending.get(c.method, 0) > 0}
        for method in slow:
            self.collects_pending[method] -= 1
        for call, actor in refs.items():
            state = self.call_state(call)
            if call.method in slow and state in ("done", "later"):
                state = "pending"
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

    def all_done(self, refs: Any, wait_s: float = 0.0) -> bool:
        return all(self.call_state(c) in ("done", "dead", "failed") for c in refs)

    def drain(self, refs: list) -> list:
        done = [c for c in refs if self.call_state(c) in ("done", "dead", "failed")]
        self.drained.extend(done)
        return [c for c in refs if c not in done]

    def handle(self, actor_id: int) -> Any:
        return actor_id  # what a FakeRank passes to ``push``

    def push(self, holder: int, key: tuple, owner: int, snap: dict) -> FakeCall:
        """A rank's own call on its holder (``keep_snapshot``), logged and faulted like the driver's."""
        call = FakeCall(holder, RankCalls.keep_snapshot, (key, owner, snap))
        self.log.append((RankCalls.keep_snapshot, holder, call.args))
        self._run(call)
        self._calls.append(call)
        return call

    def first_cause(self, refs: Any) -> str | None:
        return next((c.error for c in refs if self.call_state(c) == "failed"), None)

    # -- inside -----------------------------------------------------------------------------------
    def _start(self, count: int) -> list[int]:
        ids = []
        for _ in range(count):
            actor, self._next_id = self._next_id, self._next_id + 1
            self.ranks[actor] = FakeRank(actor, self.node_ip, self)
            self.pids[actor], self.node_ips[actor] = self.ranks[actor].pid, self.node_ip
            self.node_ids[actor] = f"node-{self.node_ip}"
            ids.append(actor)
        return ids

    def call_state(self, call: FakeCall) -> str:
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
        if call.method is RankCalls.kick:
            for other in self._calls:
                if other.actor == call.actor and other.state == "blocked":
                    self._kicked(other, rank)
            call.value = 1
            return
        fault = self._take_fault(call, rank)
        if fault is None:
            try:
                call.value = getattr(rank, call.method.__name__)(*_resolved(call.args))
            except (KeyError, RuntimeError) as exc:  # the method raised (e.g. a ref argument failed)
                call.state, call.error = "failed", f"{type(exc).__name__}: {exc}"
                return
            if call.method is RankCalls.wait_checkpoint and self.slow_writes:
                call.state = "later"
            return
        kind, message = fault
        if kind == "die":
            rank.dead, call.state = True, "dead"
        elif kind == "hang":
            rank.hung, call.state = True, "hung"
        elif kind == "slow":
            call.state = "blocked"
        elif kind == "early":
            step, after = call.args[0], (call.args[2] if len(call.args) > 2 else None)
            call.value = early_answer(step, rank.world_rank, step - 1 if after is None else after, rank.step)
        elif call.method is RankCalls.train_step:  # latched, as RankActor.train_step does
            call.value = StepResult(step=call.args[0], world_rank=rank.world_rank, ok=False, error=message)
        else:
            call.state, call.error = "failed", message

    def _kicked(self, call: FakeCall, rank: FakeRank) -> None:
        """A blocked call whose sockets the driver shut: the collective raises on this rank."""
        if call.method is RankCalls.train_step:
            call.state = "done"
            call.value = StepResult(step=call.args[0], world_rank=rank.world_rank, ok=False, error=KICKED)
        else:
            call.state, call.error = "failed", KICKED

    def _take_fault(self, call: FakeCall, rank: FakeRank) -> tuple[str, str] | None:
        armed = self._faults.get((call.method, call.actor))
        if armed is None:
            return None
        at, kind, message = armed
        where = {RankCalls.train_step: lambda: call.args[0], RankCalls.save_checkpoint: lambda: call.args[1],
                 RankCalls.wait_checkpoint: lambda: rank.saving_step,
                 RankCalls.join_generation: lambda: call.args[0].generation,
                 RankCalls.load_checkpoint: lambda: rank.generation, RankCalls.load_snapshot: lambda: rank.generation,
                 RankCalls.keep_snapshot: lambda: call.args[0][2]}.get(call.method, lambda: None)()
        if at is not None and at != where:
            return None
        del self._faults[(call.method, call.actor)]
        return kind, message


def _bind(method: RankCall, args: tuple) -> None:
    """The arguments fit the table's signature, or TypeError at submit, as Ray's ``.remote`` raises."""
    inspect.signature(method).bind(None, *args)


def _resolved(args: tuple) -> tuple:
    """A call's arguments as the rank sees them: another call's answer where the driver passed that
    call (as Ray resolves a reference argument before the method runs); one that died or failed fails
    this call too (``_run``: a RuntimeError)."""
    out = []
    for arg in args:
        if isinstance(arg, FakeCall):
            if arg.state in ("dead", "hung", "failed", "blocked"):
                raise RuntimeError(f"the argument's call ({arg.method.__name__} on actor {arg.actor}) did not answer")
            arg = arg.value
        out.append(arg)
    return tuple(out)
