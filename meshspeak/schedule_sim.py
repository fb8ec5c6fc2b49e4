"""Runs pipeline schedules on paper: proves they cannot deadlock and measures their bubble.

This module owns the executor *model* that every list from ``meshspeak.schedule`` must satisfy,
so a schedule bug shows up in a unit test instead of as a hung gloo/NCCL receive. The model is the
one the workers implement: each pp rank runs its list strictly in order; SEND_F/SEND_B are posted
asynchronously (they return at once and put a message in a mailbox keyed by
``(kind, src_stage, dst_stage, microbatch)``); RECV_F/RECV_B block until that message exists; F and
B take ``f_cost`` / ``b_cost`` time units, a zero-bubble I / W ``i_cost`` / ``w_cost`` (B's halves by
default), and communication takes none. Stages on one rank (zbv's V) hand over in memory: the F (I)
of the later (earlier) stage needs its neighbour's F (I) done earlier in the same list.

Because a rank's clock only moves through its own compute and the timestamps of the messages it
receives, the result does not depend on the order in which the simulator visits the ranks.

No torch, no ray: pure stdlib.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshspeak.schedule import GRAD_INPUT_OPS, Action, MessageKey, Op, message_key, stage_to_rank

SENDS = (Op.SEND_F, Op.SEND_B)
RECVS = (Op.RECV_F, Op.RECV_B)


class ScheduleError(ValueError):
    """A schedule breaks the executor contract (wrong rank, missing input, unmatched message)."""


class ScheduleDeadlock(ScheduleError):
    """No rank can make progress: every unfinished rank is blocked in a receive.

    Attributes:
        blocked: pp rank -> the receive it is stuck at, for every rank that has not finished.
    """

    def __init__(self, blocked: dict[int, Action]) -> None:
        self.blocked = dict(blocked)
        waits = ", ".join(
            f"rank {rank} blocks at {action} (waits for {_matching_send(action)})"
            for rank, action in sorted(self.blocked.items())
        )
        super().__init__(f"schedule deadlocks: {waits}")

    def __reduce__(self) -> tuple[type[ScheduleDeadlock], tuple[dict[int, Action]]]:
        # The message is derived from `blocked`, so rebuild from that when crossing processes.
        return (type(self), (self.blocked,))


@dataclass(frozen=True, slots=True)
class BusyInterval:
    """A rank computing ``action`` (an F or a B) from ``start`` to ``end``."""

    start: float
    end: float
    action: Action


@dataclass(frozen=True, slots=True)
class SimResult:
    """Timeline of one simulated step.

    ``bubble_fraction`` is ``1 - total busy time / (pp * makespan)``: the share of the step's
    rank-time spent waiting, comparable with ``schedule.theoretical_bubble``.
    """

    busy: tuple[tuple[BusyInterval, ...], ...]  # per pp rank, in execution order
    makespan: float
    bubble_fraction: float


def simulate(
    schedule: Sequence[Sequence[Action]],
    pp: int,
    virtual_stages: int = 1,
    *,
    f_cost: float = 1.0,
    b_cost: float = 2.0,
    cost: Callable[[Action], float] | None = None,
    i_cost: float | None = None,
    w_cost: float | None = None,
    placement: str = "loop",
) -> SimResult:
    """Execute ``schedule`` (index = pp rank) under the async-send / blocking-receive model.

    Args:
        schedule: one ordered action list per pp rank, as built by ``meshspeak.schedule``.
        pp: number of pipeline ranks.
        virtual_stages: model chunks per rank; there are ``pp * virtual_stages`` stages.
        f_cost: time of one F on one stage.
        b_cost: time of one B on one stage (about 2x F for a transformer).
        i_cost, w_cost: time of a zero-bubble I and W (default: ``b_cost / 2`` each).
        placement: how stages sit on ranks (``schedule.placement_of``: "v" for zbv).
        cost: instead of ``f_cost``/``b_cost``, the time of each F or B action (>= 0), e.g. the
            durations measured on a real run, to replay that run with free communication.

    Returns:
        The per-rank busy intervals, the makespan and the bubble fraction.

    Raises:
        ScheduleDeadlock: every unfinished rank waits for a message that will never be sent.
        ScheduleError: an action sits on a rank that does not hold its stage, computes before its
            input arrived, sends something twice, leaves a message unreceived, or a microbatch is
            forwarded without being backwarded (or I'd without its W).
    """
    i_cost = b_cost / 2 if i_cost is None else i_cost
    w_cost = b_cost / 2 if w_cost is None else w_cost
    _check_arguments(schedule, pp, virtual_stages, f_cost=f_cost, b_cost=b_cost, i_cost=i_cost, w_cost=w_cost)
    num_stages = pp * virtual_stages
    rank_of = _rank_of(pp, placement, num_stages)
    for rank, actions in enumerate(schedule):
        for action in actions:
            _check_placement(action, rank, num_stages, rank_of)

    if cost is None:
        by_op = {Op.FORWARD: f_cost, Op.BACKWARD: b_cost, Op.BACKWARD_INPUT: i_cost, Op.BACKWARD_WEIGHT: w_cost}
        cost = lambda action: by_op[action.op]  # noqa: E731
    machine = _Machine(num_stages, cost, pp, rank_of)
    _run_every_rank(schedule, machine)
    machine.check_finished()
    return _timeline(machine, pp)


def _check_arguments(schedule: Sequence[Sequence[Action]], pp: int, virtual_stages: int, *, f_cost: float,
                     b_cost: float, i_cost: float, w_cost: float) -> None:
    """The mesh sizes are >= 1, every cost > 0, and there is one list per pp rank."""
    if pp < 1 or virtual_stages < 1:
        raise ValueError(f"need pp >= 1 and virtual_stages >= 1, got pp={pp} v={virtual_stages}")
    if min(f_cost, b_cost, i_cost, w_cost) <= 0:
        raise ValueError(f"costs must be > 0, got f_cost={f_cost} b_cost={b_cost} i_cost={i_cost} "
                         f"w_cost={w_cost}")
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} rank lists, expected pp={pp}")


def _run_every_rank(schedule: Sequence[Sequence[Action]], machine: _Machine) -> None:
    """Run each rank's list as far as it can go, round after round, until no rank moves; a rank left
    short of its end is blocked in a receive (``ScheduleDeadlock``)."""
    position = [0] * len(schedule)
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in enumerate(schedule):
            while position[rank] < len(actions) and machine.run(rank, actions[position[rank]]):
                position[rank] += 1
                progressed = True

    blocked = {r: schedule[r][i] for r, i in enumerate(position) if i < len(schedule[r])}
    if blocked:
        raise ScheduleDeadlock(blocked)


def _timeline(machine: _Machine, pp: int) -> SimResult:
    """The finished simulation's busy intervals, makespan and bubble fraction."""
    makespan = max(machine.clock)
    total_busy = sum(iv.end - iv.start for rank_busy in machine.busy for iv in rank_busy)
    bubble = 1.0 - total_busy / (pp * makespan) if makespan > 0 else 0.0
    return SimResult(
        busy=tuple(tuple(rank_busy) for rank_busy in machine.busy),
        makespan=makespan,
        bubble_fraction=bubble,
    )


class _Machine:
    """Mutable state of one simulation: clocks, mailbox and what has been computed."""

    def __init__(self, num_stages: int, cost: Callable[[Action], float], pp: int,
                 rank_of: Callable[[int], int]) -> None:
        self.last_stage = num_stages - 1
        self.cost = cost
        self.rank_of = rank_of
        self.clock = [0.0] * pp
        self.busy: list[list[BusyInterval]] = [[] for _ in range(pp)]
        self.mailbox: dict[MessageKey, float] = {}  # message -> time it was posted
        self.sent: set[MessageKey] = set()
        self.received: set[MessageKey] = set()
        self.computed: set[tuple[int, Op, int]] = set()  # (stage, F/B/I/W, microbatch)

    def run(self, rank: int, action: Action) -> bool:
        """Run ``action`` on ``rank``; False: it is a receive whose message has not arrived yet."""
        stage, op, mb = action.stage, action.op, action.microbatch
        if op in (Op.RECV_F, Op.RECV_B):
            key = message_key(action)
            if key in self.received:
                raise ScheduleError(f"rank {rank}: {action} receives a message a second time")
            if key not in self.mailbox:
                return False
            self.clock[rank] = max(self.clock[rank], self.mailbox.pop(key))
            self.received.add(key)
        elif op in (Op.SEND_F, Op.SEND_B):
            if op == Op.SEND_F:
                self._require((stage, Op.FORWARD, mb), rank, action, "its F before")
            else:
                self._require_grad_input(stage, mb, rank, action)
            key = message_key(action)
            if key in self.sent:
                raise ScheduleError(f"rank {rank}: {action} sends a message a second time")
            self.sent.add(key)
            self.mailbox[key] = self.clock[rank]
        else:
            self._check_inputs(rank, action)
            # A B and an I of one (stage, microbatch) both compute its input gradient.
            twins = GRAD_INPUT_OPS if op in GRAD_INPUT_OPS else (op,)
            if any((stage, twin, mb) in self.computed for twin in twins):
                raise ScheduleError(f"rank {rank}: {action} runs a second time")
            duration = self.cost(action)
            if duration < 0:
                raise ValueError(f"cost of {action} must be >= 0, got {duration}")
            start = self.clock[rank]
            self.clock[rank] = start + duration
            self.busy[rank].append(BusyInterval(start, self.clock[rank], action))
            self.computed.add((stage, op, mb))
        return True

    def _check_inputs(self, rank: int, action: Action) -> None:
        stage, mb = action.stage, action.microbatch
        if action.op == Op.FORWARD:
            if stage > 0 and self.rank_of(stage - 1) == rank:  # handed over in memory
                self._require((stage - 1, Op.FORWARD, mb), rank, action, f"stage {stage - 1}'s F before")
            elif stage > 0:
                self._need_message(("F", stage - 1, stage, mb), rank, action)
            return
        if action.op == Op.BACKWARD_WEIGHT:
            self._require((stage, Op.BACKWARD_INPUT, mb), rank, action, "its I before")
            return
        self._require((stage, Op.FORWARD, mb), rank, action, "its F before")
        if stage < self.last_stage and self.rank_of(stage + 1) == rank:
            self._require_grad_input(stage + 1, mb, rank, action)
        elif stage < self.last_stage:  # the last stage's B starts from the loss its F computed
            self._need_message(("B", stage + 1, stage, mb), rank, action)

    def _require_grad_input(self, stage: int, mb: int, rank: int, action: Action) -> None:
        if not any((stage, op, mb) in self.computed for op in GRAD_INPUT_OPS):
            raise ScheduleError(f"rank {rank}: {action} needs stage {stage}'s B or I of microbatch {mb} "
                                "before it")

    def _need_message(self, key: MessageKey, rank: int, action: Action) -> None:
        if key not in self.received:
            raise ScheduleError(f"rank {rank}: {action} runs before its input {key} was received")

    def _require(self, done: tuple[int, Op, int], rank: int, action: Action, what: str) -> None:
        if done not in self.computed:
            raise ScheduleError(f"rank {rank}: {action} needs {what} it")

    def check_finished(self) -> None:
        if self.mailbox:
            left = ", ".join(f"{k}" for k in sorted(self.mailbox))
            raise ScheduleError(f"messages sent but never received: {left}")
        forwarded = {(s, mb) for s, op, mb in self.computed if op == Op.FORWARD}
        backwarded = {(s, mb) for s, op, mb in self.computed if op in (Op.BACKWARD, Op.BACKWARD_WEIGHT)}
        split = {(s, mb) for s, op, mb in self.computed if op == Op.BACKWARD_INPUT}
        if split - backwarded:
            raise ScheduleError(f"(stage, microbatch) given an I but never its W: {sorted(split - backwarded)}")
        if forwarded != backwarded:
            missing = sorted(forwarded - backwarded)
            raise ScheduleError(f"(stage, microbatch) forwarded but never backwarded: {missing}")


def _matching_send(action: Action) -> str:
    if action.op == Op.RECV_F:
        return str(Action(action.stage - 1, Op.SEND_F, action.microbatch))
    if action.op == Op.RECV_B:
        return str(Action(action.stage + 1, Op.SEND_B, action.microbatch))
    return "nothing"  # only receives block; kept total so the message can always be built


def _rank_of(pp: int, placement: str, num_stages: int) -> Callable[[int], int]:
    if placement == "v" and num_stages != 2 * pp:
        raise ValueError(f"the V placement holds 2 stages per rank: got {num_stages} stages for pp={pp}")
    return lambda stage: stage_to_rank(stage, pp, placement)


def _check_placement(action: Action, rank: int, num_stages: int, rank_of: Callable[[int], int]) -> None:
    """Structural checks that need no execution: right rank, no comm past either pipeline end, no
    message between two stages of one rank."""
    if not isinstance(action, Action) or action.op not in tuple(Op):
        raise ScheduleError(f"rank {rank}: {action!r} is not an Action with a known Op")
    if not 0 <= action.stage < num_stages or action.microbatch < 0:
        raise ScheduleError(f"rank {rank}: {action} is out of range ({num_stages} stages)")
    if rank_of(action.stage) != rank:
        raise ScheduleError(f"rank {rank}: {action} belongs to rank {rank_of(action.stage)}")
    if action.stage == 0 and action.op in (Op.RECV_F, Op.SEND_B):
        raise ScheduleError(f"rank {rank}: {action}: the first stage has no previous stage")
    if action.stage == num_stages - 1 and action.op in (Op.SEND_F, Op.RECV_B):
        raise ScheduleError(f"rank {rank}: {action}: the last stage has no next stage")
    if action.op in SENDS or action.op in RECVS:
        _, src, dst, _ = message_key(action)
        if rank_of(src) == rank_of(dst):
            raise ScheduleError(f"rank {rank}: {action}: stages {src} and {dst} share a rank and hand "
                                "over in memory, not by a message")
