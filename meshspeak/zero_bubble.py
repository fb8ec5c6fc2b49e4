"""Zero-bubble pipeline schedules as pure data: ZB-H1 and ZB-V (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, sections 3 and 6).

Both split each backward into I, the gradient of the stage's input (what the previous stage waits
for: it carries B's RECV_B/SEND_B), and W, the gradient of the stage's weights (needed only by the
optimizer step, so it can run later, where 1F1B would sit idle). Same vocabulary and executor model
as ``meshspeak.actions``; the simulator (``meshspeak.schedule_sim``) proves them deadlock-free.

* ZB-H1 (``zb_h1``), one stage per rank: 1F1B's warm-up (``pp - r - 1`` forwards on rank ``r``) and
  steady F/I pairs, but rank ``r`` holds back its first ``r`` W's and runs them in the cool-down,
  where 1F1B's rank ``r`` idles. Rank ``r`` then holds at most ``pp`` microbatches (1F1B: ``pp - r``),
  i.e. every rank holds what 1F1B's rank 0 does: the same peak activation memory as 1F1B. With equal
  F, I and W costs the bubble is ``(pp - 1) / (3m + pp - 1)`` of the step, a third of 1F1B's
  ``3(pp - 1)`` idle units per rank (the paper's ``(p - 1)(T_F + T_B - T_W)`` vs
  ``(p - 1)(T_F + T_B + T_W)``).
* ZB-V (``zbv``), two stages per rank in a V (``actions.stages_of_rank(..., placement="v")``): the
  forward runs down the ranks on chunk 0 and back up on chunk 1, so rank 0 holds the first and the
  last stage and the loss's backward starts on the rank that started the forward. The phases follow
  the paper's Figure 8 (and ``torch.distributed.pipelining.ScheduleZBVZeroBubble``, which orders the
  same actions): warm-up forwards of chunk 0, then chunk 0/1 forward pairs, then F/I/W triples of
  chunk 1, a steady state alternating chunk 0 and chunk 1 F-I-W, and a cool-down of I's with the
  W's left at the end. It is built for ``max(m, 2pp - 1)`` microbatches and the actions of the
  extra ones are dropped (the paper needs ``m >= 2pp - 1`` to fill the V; dropping only removes work,
  and the simulator checks every (pp, m) the config accepts). With equal F, I and W costs its idle
  time is ``(pp - 1) / (6m)`` of its compute for ``m >= 2pp - 1``, half of ZB-H1's.

Why written here rather than taken from torch: torch's schedules are lists for its own runtime
(``_Action`` with its own communication pass); ours are the driver's data, wrapped in our
communication actions and checked by our simulator (meshspeak/actions.py's module docstring).

No torch, no ray: pure stdlib.
"""

from __future__ import annotations

from functools import partial

from meshspeak.actions import (
    ZERO_BUBBLE,
    Action,
    Op,
    Schedule,
    backward_actions,
    check_shape,
    forward_actions,
    stage_to_rank,
)


def make(name: str, pp: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """``zb_h1`` or ``zbv`` by name, with the virtual-stage count each one needs (1 or 2)."""
    if name not in ZERO_BUBBLE:
        raise ValueError(f"{name!r} is not a zero-bubble schedule ({', '.join(ZERO_BUBBLE)})")
    need = 2 if name == "zbv" else 1
    if virtual_stages != need:
        raise ValueError(
            f"pipeline.schedule={name!r} needs pipeline.virtual_stages={need}, got {virtual_stages}: "
            f"set pipeline.virtual_stages={need}"
        )
    return zbv(pp, num_microbatches) if name == "zbv" else zb_h1(pp, num_microbatches)


def _need_pipeline(name: str, pp: int) -> None:
    if pp < 2:
        raise ValueError(f"pipeline.schedule={name!r} needs pp >= 2, got pp={pp}: a single pp rank has "
                         "no bubble to fill; use pipeline.schedule='1f1b'")


def zb_h1(pp: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with each B split into I and W, rank ``r``'s first ``r`` W's held back."""
    check_shape(pp, num_microbatches, 1)
    _need_pipeline("zb-h1", pp)
    m = num_microbatches
    schedule: Schedule = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, m)
        actions: list[Action] = []
        weights = iter(range(m))  # W's run in microbatch order

        def input_grad(k: int) -> None:
            actions.extend(backward_actions(rank, k, pp, op=Op.BACKWARD_INPUT))
            if k >= rank:  # the first `rank` W's wait for the cool-down
                actions.append(Action(rank, Op.BACKWARD_WEIGHT, next(weights)))

        for mb in range(warmup):  # warm-up
            actions += forward_actions(rank, mb, pp)
        for i in range(m - warmup):  # steady state: F of mb warmup+i, I (and maybe a W)
            actions += forward_actions(rank, warmup + i, pp)
            input_grad(i)
        for k in range(m - warmup, m):  # cool-down
            input_grad(k)
        actions += [Action(rank, Op.BACKWARD_WEIGHT, mb) for mb in weights]  # the held-back W's
        schedule.append(actions)
    return schedule


def zbv(pp: int, num_microbatches: int) -> Schedule:
    """ZB-V over ``2 pp`` stages in the V placement (see the module docstring for the phases)."""
    check_shape(pp, num_microbatches, 2)
    _need_pipeline("zbv", pp)
    m = num_microbatches
    full = max(m, 2 * pp - 1)
    num_stages = 2 * pp
    rank_of = partial(stage_to_rank, pp=pp, placement="v")
    schedule: Schedule = []
    for rank in range(pp):
        down, up = rank, num_stages - 1 - rank  # chunk 0 (forward going down) and chunk 1 (back up)
        count = {(stage, op): 0 for stage in (down, up) for op in (Op.FORWARD, Op.BACKWARD_INPUT)}
        program: list[tuple[int, Op]] = []  # (stage, op) in order; microbatches are counted below

        def f(stage: int) -> None:
            program.append((stage, Op.FORWARD))

        def i_w(stage: int) -> None:
            program.extend([(stage, Op.BACKWARD_INPUT), (stage, Op.BACKWARD_WEIGHT)])

        for _ in range(2 * (pp - rank) - 1):  # warm-up on chunk 0
            f(down)
        for _ in range(rank):  # both chunks forward
            f(up)
            f(down)
        for _ in range(pp - rank):  # chunk 1 starts its backwards
            f(up)
            i_w(up)
        forwards = {down: 2 * (pp - rank) - 1 + rank, up: pp}
        while forwards[up] < forwards[down] or forwards[down] < full:  # steady state
            if forwards[down] < full:
                f(down)
                forwards[down] += 1
            i_w(down)
            f(up)
            forwards[up] += 1
            i_w(up)
        for _ in range(rank):  # cool-down: I's first, their W's at the end
            program.extend([(down, Op.BACKWARD_INPUT), (up, Op.BACKWARD_INPUT)])
        for _ in range(pp - rank):
            i_w(down)
        actions: list[Action] = []
        weights = {down: 0, up: 0}
        for stage, op in program + _remaining_weights(program, down, up):
            if op == Op.BACKWARD_WEIGHT:
                mb = weights[stage]
                weights[stage] += 1
            else:
                mb = count[(stage, op)]
                count[(stage, op)] += 1
            if mb >= m:  # a microbatch only there to fill the V: dropped
                continue
            if op == Op.FORWARD:
                actions += forward_actions(stage, mb, num_stages, rank_of)
            elif op == Op.BACKWARD_INPUT:
                actions += backward_actions(stage, mb, num_stages, rank_of, op=Op.BACKWARD_INPUT)
            else:
                actions.append(Action(stage, op, mb))
        schedule.append(actions)
    return schedule


def _remaining_weights(program: list[tuple[int, Op]], down: int, up: int) -> list[tuple[int, Op]]:
    """The W's not yet in ``program``: chunk 1's first, then chunk 0's (as in the paper's tail)."""
    out = []
    for stage in (up, down):
        inputs = sum(1 for s, op in program if s == stage and op == Op.BACKWARD_INPUT)
        weights = sum(1 for s, op in program if s == stage and op == Op.BACKWARD_WEIGHT)
        out += [(stage, Op.BACKWARD_WEIGHT)] * (inputs - weights)
    return out
