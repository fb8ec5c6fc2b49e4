"""Pipeline schedules as pure data: what every pp rank does, in order, for one optimizer step.

This module owns the *order* of work in a pipeline step. The driver builds the action lists here and
hands each RankActor its own list; the actor executes it literally, top to bottom, and makes no
scheduling decisions of its own. Keeping the schedule as data means it can be unit-tested, simulated
(`meshspeak.schedule_sim`) and logged without a process group, and that an elastic rebuild only
has to hand out new lists.

The vocabulary (ops, actions, stage placement, how an F or a B is wrapped in its messages) is
``meshspeak.actions``'s, re-exported here; the zero-bubble lists (I/W split backwards) are
``meshspeak.zero_bubble``'s, reached through ``make_schedule``.

No torch, no ray: pure stdlib.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshspeak import zero_bubble
from meshspeak.actions import (
    COMPUTE_OPS,
    GRAD_INPUT_OPS,
    PLACEMENTS,
    SCHEDULE_NAMES,
    ZERO_BUBBLE,
    Action,
    MessageKey,
    Op,
    Schedule,
    backward_actions,
    check_shape,
    forward_actions,
    message_key,
    placement_of,
    stage_to_rank,
    stages_of_rank,
)

__all__ = [
    "COMPUTE_OPS", "GRAD_INPUT_OPS", "PLACEMENTS", "SCHEDULE_NAMES", "ZERO_BUBBLE", "Action", "MessageKey",
    "Op", "Schedule", "gpipe", "interleaved_one_f_one_b", "make_schedule", "message_key", "one_f_one_b",
    "peak_in_flight", "placement_of", "stage_to_rank", "stages_of_rank", "theoretical_bubble",
]


def gpipe(pp: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards (GPipe).

    Backwards run in microbatch order 0..m-1, as torch.distributed.pipelining's ScheduleGPipe does;
    the makespan is the same as reversed order and ascending order keeps the lists easy to read.
    Every rank holds all ``m`` activations at the F/B boundary, so prefer 1F1B unless m <= pp.
    """
    check_shape(pp, num_microbatches, 1)
    schedule: Schedule = []
    for rank in range(pp):
        actions: list[Action] = []
        for mb in range(num_microbatches):
            actions += forward_actions(rank, mb, pp)
        for mb in range(num_microbatches):
            actions += backward_actions(rank, mb, pp)
        schedule.append(actions)
    return schedule


def one_f_one_b(pp: int, num_microbatches: int) -> Schedule:
    """Non-interleaved 1F1B (PipeDream-Flush / Megatron's default).

    Rank ``r`` runs ``min(pp - r - 1, m)`` warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards. At most ``pp - r`` microbatches are in flight on
    rank ``r`` (vs. ``m`` for GPipe) at the same bubble. ``m < pp`` is valid here, it just never
    reaches the steady state; the config layer is the one that rejects it as wasteful.
    """
    check_shape(pp, num_microbatches, 1)
    schedule: Schedule = []
    for rank in range(pp):
        # Earlier ranks must run ahead so the last stage never waits once the pipe is full.
        warmup = min(pp - rank - 1, num_microbatches)
        actions: list[Action] = []
        for mb in range(warmup):  # warm-up
            actions += forward_actions(rank, mb, pp)
        for i in range(num_microbatches - warmup):  # steady state: F of mb warmup+i, B of mb i
            actions += forward_actions(rank, warmup + i, pp)
            actions += backward_actions(rank, i, pp)
        for mb in range(num_microbatches - warmup, num_microbatches):  # cool-down
            actions += backward_actions(rank, mb, pp)
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
    check_shape(pp, num_microbatches, virtual_stages)
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
            actions += forward_actions(stage_of(rank, k, True), microbatch_of(k), num_stages)
        for i in range(total - warmup):  # steady state
            k = warmup + i
            actions += forward_actions(stage_of(rank, k, True), microbatch_of(k), num_stages)
            actions += backward_actions(stage_of(rank, i, False), microbatch_of(i), num_stages)
        for k in range(total - warmup, total):  # cool-down
            actions += backward_actions(stage_of(rank, k, False), microbatch_of(k), num_stages)
        schedule.append(actions)
    return schedule


def make_schedule(name: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule named by ``pipeline.schedule``: "1f1b", "gpipe", "interleaved_1f1b", "zb-h1" or
    "zbv" (the last two: ``meshspeak.zero_bubble``).

    With ``pp == 1`` every schedule but the zero-bubble ones is plain gradient accumulation,
    ``F0 B0 F1 B1 ...``: there is no pipeline to fill, and freeing each microbatch's activations
    before the next forward is free.

    Raises:
        ValueError: unknown name, ``virtual_stages`` other than the schedule's (1; >= 2 for
            interleaved_1f1b; 2 for zbv), or the constraints of the chosen schedule (see each function).
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(
            f"pipeline.schedule={name!r} is not known: choose one of {', '.join(SCHEDULE_NAMES)}"
        )
    check_shape(pp, num_microbatches, virtual_stages)
    if name in ZERO_BUBBLE:
        return zero_bubble.make(name, pp, num_microbatches, virtual_stages)
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
    """Most microbatches whose F is done but whose B (or W) is not, summed over the rank's stages.

    Activation memory of a rank scales with this number (times the per-stage activation size),
    which is what ``elastimesh plan`` uses for its estimate. A split backward holds a microbatch
    until its W: the I frees only what the input gradient alone needed, so this counts the upper
    bound.
    """
    in_flight = peak = 0
    for action in actions:
        if action.op == Op.FORWARD:
            in_flight += 1
            peak = max(peak, in_flight)
        elif action.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT):
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
    check_shape(pp, num_microbatches, virtual_stages)
    return (pp - 1) / (virtual_stages * num_microbatches + pp - 1)
