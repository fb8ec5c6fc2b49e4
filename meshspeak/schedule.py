"""Pipeline schedules as pure data: what every pp rank does, in order, for one optimizer step.

This module owns the *order* of work in a pipeline step. The driver builds the action lists here and
hands each RankActor its own list; the actor executes it literally, top to bottom, and makes no
scheduling decisions of its own. Keeping the schedule as data means it can be unit-tested, simulated
(`meshspeak.schedule_sim`) and logged without a process group, and that an elastic rebuild only
has to hand out new lists.

Vocabulary:
  * ``pp`` pipeline ranks, ``virtual_stages`` (v) model chunks per rank, ``num_stages = pp * v``.
  * Stage ``s`` lives on pp rank ``s % pp``: rank ``r`` holds stages ``r, r + pp, r + 2pp, ...``
    (Megatron's interleaved placement; with v == 1 it is simply stage == rank).
  * Every F/B is wrapped in its communication: RECV_F right before an F, SEND_F right after it,
    RECV_B right before a B, SEND_B right after it. The executor posts sends asynchronously and
    blocks on receives, so a list is runnable iff the simulator finds no cycle of waits.
  * The first stage has no RECV_F/SEND_B; the last stage has no SEND_F/RECV_B because the loss is
    computed inside its F and its B starts from that loss.

No torch, no ray: pure stdlib.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

SCHEDULE_NAMES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b")


class Op(StrEnum):
    """One step of a rank's program. Values double as the compact text form (``2F0``)."""

    FORWARD = "F"
    BACKWARD = "B"
    RECV_F = "RECV_F"  # receive the activation entering `stage` for `microbatch` from stage - 1
    SEND_F = "SEND_F"  # send the activation leaving `stage` to stage + 1
    RECV_B = "RECV_B"  # receive the gradient of `stage`'s output from stage + 1
    SEND_B = "SEND_B"  # send the gradient of `stage`'s input to stage - 1


@dataclass(frozen=True, slots=True)
class Action:
    """``op`` on pipeline stage ``stage`` for microbatch ``microbatch`` (all zero-based)."""

    stage: int
    op: Op
    microbatch: int

    def __str__(self) -> str:
        # Same shape as torch.distributed.pipelining's _Action: "2F0", "1SEND_F3".
        return f"{self.stage}{self.op.value}{self.microbatch}"


Schedule = list[list[Action]]

# (kind, src_stage, dst_stage, microbatch); kind is "F" for activations and "B" for gradients.
MessageKey = tuple[str, int, int, int]


def message_key(action: Action) -> MessageKey:
    """The message a send posts or a receive takes: both ends of one hand-off give the same key."""
    stage, mb = action.stage, action.microbatch
    if action.op == Op.SEND_F:
        return ("F", stage, stage + 1, mb)
    if action.op == Op.RECV_F:
        return ("F", stage - 1, stage, mb)
    if action.op == Op.SEND_B:
        return ("B", stage, stage - 1, mb)
    if action.op == Op.RECV_B:
        return ("B", stage + 1, stage, mb)
    raise ValueError(f"{action} is not a communication action")


def stage_to_rank(stage: int, pp: int) -> int:
    """The pp rank that holds ``stage`` (interleaved placement: stage modulo pp)."""
    if pp < 1 or stage < 0:
        raise ValueError(f"need pp >= 1 and stage >= 0, got pp={pp} stage={stage}")
    return stage % pp


def stages_of_rank(rank: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """The stages held by pp rank ``rank``, in model order: ``[rank, rank + pp, ...]``."""
    _check_shape(pp, 1, virtual_stages)
    if not 0 <= rank < pp:
        raise ValueError(f"pp rank must be in [0, {pp}), got {rank}")
    return [rank + chunk * pp for chunk in range(virtual_stages)]


def gpipe(pp: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards (GPipe).

    Backwards run in microbatch order 0..m-1, as torch.distributed.pipelining's ScheduleGPipe does;
    the makespan is the same as reversed order and ascending order keeps the lists easy to read.
    Every rank holds all ``m`` activations at the F/B boundary, so prefer 1F1B unless m <= pp.
    """
    _check_shape(pp, num_microbatches, 1)
    schedule: Schedule = []
    for rank in range(pp):
        actions: list[Action] = []
        for mb in range(num_microbatches):
            actions += _forward(rank, mb, pp)
        for mb in range(num_microbatches):
            actions += _backward(rank, mb, pp)
        schedule.append(actions)
    return schedule


def one_f_one_b(pp: int, num_microbatches: int) -> Schedule:
    """Non-interleaved 1F1B (PipeDream-Flush / Megatron's default).

    Rank ``r`` runs ``min(pp - r - 1, m)`` warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards. At most ``pp - r`` microbatches are in flight on
    rank ``r`` (vs. ``m`` for GPipe) at the same bubble. ``m < pp`` is valid here, it just never
    reaches the steady state; the config layer is the one that rejects it as wasteful.
    """
    _check_shape(pp, num_microbatches, 1)
    schedule: Schedule = []
    for rank in range(pp):
        # Earlier ranks must run ahead so the last stage never waits once the pipe is full.
        warmup = min(pp - rank - 1, num_microbatches)
        actions: list[Action] = []
        for mb in range(warmup):  # warm-up
            actions += _forward(rank, mb, pp)
        for i in range(num_microbatches - warmup):  # steady state: F of mb warmup+i, B of mb i
            actions += _forward(rank, warmup + i, pp)
            actions += _backward(rank, i, pp)
        for mb in range(num_microbatches - warmup, num_microbatches):  # cool-down
            actions += _backward(rank, mb, pp)
        schedule.append(actions)
    return schedule


def interleaved_one_f_one_b(pp: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron-style interleaved 1F1B over ``virtual_stages`` model chunks per rank.

    Each rank walks ``m * v`` forward and ``m * v`` backward "virtual microbatches" k. Microbatches
    go through the rank's chunks in groups of ``pp``: for k, the chunk is ``(k % (pp*v)) // pp``
    (reversed for backwards) and the microbatch is ``(k // (pp*v)) * pp + k % pp`` — Megatron's
    ``get_model_chunk_id`` / ``get_microbatch_id_in_model_chunk``. The warm-up is
    ``(pp - r - 1) * 2 + (v - 1) * pp`` forwards, capped at ``m * v``.

    ``virtual_stages == 1`` returns plain 1F1B: Megatron also only takes this path for v > 1, and
    its doubled warm-up would only cost memory without v > 1 to pay for it.

    Raises:
        ValueError: ``m % pp != 0`` (the grouping above needs whole groups of pp microbatches), or
            ``pp == 1`` with ``virtual_stages > 1`` (nothing to interleave on a single rank).
    """
    _check_shape(pp, num_microbatches, virtual_stages)
    if virtual_stages == 1:
        return one_f_one_b(pp, num_microbatches)
    if pp == 1:
        raise ValueError(
            f"pipeline.virtual_stages={virtual_stages} needs pp >= 2: a single pp rank has no "
            "bubble to shrink; set pipeline.virtual_stages=1"
        )
    if num_microbatches % pp:
        raise ValueError(
            f"interleaved_1f1b needs num_microbatches divisible by pp, got "
            f"num_microbatches={num_microbatches} pp={pp}; use a multiple of {pp}"
        )
    v, total = virtual_stages, num_microbatches * virtual_stages
    num_stages = pp * v

    def stage_of(rank: int, k: int, forward: bool) -> int:
        chunk = (k % (pp * v)) // pp
        # Backwards leave the model from the last chunk, so they walk the chunks in reverse.
        return (chunk if forward else v - 1 - chunk) * pp + rank

    def microbatch_of(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    schedule: Schedule = []
    for rank in range(pp):
        warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
        actions: list[Action] = []
        for k in range(warmup):  # warm-up
            actions += _forward(stage_of(rank, k, True), microbatch_of(k), num_stages)
        for i in range(total - warmup):  # steady state
            k = warmup + i
            actions += _forward(stage_of(rank, k, True), microbatch_of(k), num_stages)
            actions += _backward(stage_of(rank, i, False), microbatch_of(i), num_stages)
        for k in range(total - warmup, total):  # cool-down
            actions += _backward(stage_of(rank, k, False), microbatch_of(k), num_stages)
        schedule.append(actions)
    return schedule


def make_schedule(name: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule named by ``pipeline.schedule``: "1f1b", "gpipe" or "interleaved_1f1b".

    With ``pp == 1`` every schedule is plain gradient accumulation, ``F0 B0 F1 B1 ...``: there is no
    pipeline to fill, and freeing each microbatch's activations before the next forward is free.

    Raises:
        ValueError: unknown name, ``virtual_stages > 1`` with a non-interleaved schedule, or the
            constraints of the chosen schedule (see each function).
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(
            f"pipeline.schedule={name!r} is not known: choose one of {', '.join(SCHEDULE_NAMES)}"
        )
    _check_shape(pp, num_microbatches, virtual_stages)
    if virtual_stages > 1 and name != "interleaved_1f1b":
        raise ValueError(
            f"pipeline.virtual_stages={virtual_stages} needs pipeline.schedule='interleaved_1f1b', "
            f"got {name!r}; set pipeline.virtual_stages=1"
        )
    if name == "interleaved_1f1b":
        return interleaved_one_f_one_b(pp, num_microbatches, virtual_stages)
    if pp == 1 or name == "1f1b":
        return one_f_one_b(pp, num_microbatches)  # for pp == 1 this is F0 B0 F1 B1 ...
    return gpipe(pp, num_microbatches)


FORWARD_OPS = (Op.RECV_F, Op.FORWARD, Op.SEND_F)


def forward_only(actions: Sequence[Action]) -> list[Action]:
    """The forward work of a rank's list, in its order (held-out eval: workers/batching.py).

    Dropping actions cannot deadlock a list that was deadlock-free with them: a forward receive's
    matching send is still preceded only by forward work on its sender.
    """
    return [a for a in actions if a.op in FORWARD_OPS]


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most microbatches whose F is done but whose B is not, summed over the rank's stages.

    Activation memory of a rank scales with this number (times the per-stage activation size),
    which is what ``elastimesh plan`` uses for its estimate.
    """
    in_flight = peak = 0
    for action in actions:
        if action.op == Op.FORWARD:
            in_flight += 1
            peak = max(peak, in_flight)
        elif action.op == Op.BACKWARD:
            in_flight -= 1
    return peak


def theoretical_bubble(pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of one step: ``(pp - 1) / (v * m + pp - 1)``.

    Source: Narayanan et al. 2021 (Megatron-LM, "Efficient Large-Scale Language Model Training on
    GPU Clusters", §2.2): the bubble *time* relative to the ideal compute time is ``(p - 1) / m``
    for GPipe and 1F1B and ``(p - 1) / (v * m)`` interleaved. We report the bubble as a fraction of
    the whole step instead, ``bubble / (ideal + bubble)``, which is what the simulator measures and
    gives ``(p - 1) / (m + p - 1)`` for v == 1. Assumes uniform stage costs and free communication.
    """
    _check_shape(pp, num_microbatches, virtual_stages)
    return (pp - 1) / (virtual_stages * num_microbatches + pp - 1)


def _check_shape(pp: int, num_microbatches: int, virtual_stages: int) -> None:
    if pp < 1 or num_microbatches < 1 or virtual_stages < 1:
        raise ValueError(
            "need pp >= 1, num_microbatches >= 1 and virtual_stages >= 1, got "
            f"pp={pp} num_microbatches={num_microbatches} virtual_stages={virtual_stages}"
        )


def _forward(stage: int, microbatch: int, num_stages: int) -> list[Action]:
    """F with its comms: the input arrives right before it, the output leaves right after."""
    actions = [Action(stage, Op.FORWARD, microbatch)]
    if stage > 0:
        actions.insert(0, Action(stage, Op.RECV_F, microbatch))
    if stage < num_stages - 1:
        actions.append(Action(stage, Op.SEND_F, microbatch))
    return actions


def _backward(stage: int, microbatch: int, num_stages: int) -> list[Action]:
    """B with its comms; the last stage's B starts from its own loss, so it receives nothing."""
    actions = [Action(stage, Op.BACKWARD, microbatch)]
    if stage < num_stages - 1:
        actions.insert(0, Action(stage, Op.RECV_B, microbatch))
    if stage > 0:
        actions.append(Action(stage, Op.SEND_B, microbatch))
    return actions
