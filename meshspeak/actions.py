"""The vocabulary of pipeline action lists (pure data): ops, actions, messages, stage placement.

``meshspeak.schedule`` builds the classic lists (GPipe, 1F1B, interleaved 1F1B) from it and
``meshspeak.zero_bubble`` the zero-bubble ones (ZB-H1, ZB-V); both use the helpers at the end that
wrap a compute action in its communication. A module of its own so that the two builders share it
without importing each other (``make_schedule`` dispatches to both).

  * ``pp`` pipeline ranks, ``virtual_stages`` (v) model chunks per rank, ``num_stages = pp * v``.
  * Stage ``s`` lives on pp rank ``s % pp``: rank ``r`` holds stages ``r, r + pp, r + 2pp, ...``
    (Megatron's interleaved placement; with v == 1 it is simply stage == rank).
  * ``placement`` "v" (the zbv schedule, 2 stages per rank) instead puts stage ``s`` on rank ``s``
    for ``s < pp`` and on rank ``2pp - 1 - s`` after: rank ``r`` holds stages ``r`` and ``2pp-1-r``,
    so rank 0 holds the first and the last stage and rank pp-1 the two middle ones.
  * Every F/B is wrapped in its communication: RECV_F right before an F, SEND_F right after it,
    RECV_B right before a B, SEND_B right after it. The executor posts sends asynchronously and
    blocks on receives, so a list is runnable iff the simulator finds no cycle of waits. Neighbouring
    stages on one rank (the V's turn) hand over in memory: no message, no action.
  * The first stage has no RECV_F/SEND_B; the last stage has no SEND_F/RECV_B because the loss is
    computed inside its F and its B starts from that loss.
  * Zero-bubble schedules split a B into I (the gradient of the stage's input, wrapped in B's
    communication) and W (its weights' gradient, no communication), which can run later, in what
    would have been a bubble.

No torch, no ray: pure stdlib.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

SCHEDULE_NAMES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b", "zb-h1", "zbv")
ZERO_BUBBLE: tuple[str, ...] = ("zb-h1", "zbv")  # the schedules whose backwards are split into I and W
PLACEMENTS: tuple[str, ...] = ("loop", "v")


class Op(StrEnum):
    """One step of a rank's program. Values double as the compact text form (``2F0``)."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"  # zero-bubble: the gradient of the stage's input only (sent upstream)
    BACKWARD_WEIGHT = "W"  # zero-bubble: the gradient of the stage's weights, after its I
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


# Ops that compute (the rest communicate), and those that end a stage's work on a microbatch.
COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
GRAD_INPUT_OPS = (Op.BACKWARD, Op.BACKWARD_INPUT)  # produce the gradient SEND_B sends


def placement_of(schedule: str) -> str:
    """How ``schedule`` places stages on pp ranks: "v" for zbv, else "loop" (stage modulo pp)."""
    return "v" if schedule == "zbv" else "loop"


def stage_to_rank(stage: int, pp: int, placement: str = "loop") -> int:
    """The pp rank that holds ``stage``: stage modulo pp ("loop"), or the V of zbv ("v", 2pp stages)."""
    if pp < 1 or stage < 0:
        raise ValueError(f"need pp >= 1 and stage >= 0, got pp={pp} stage={stage}")
    if placement == "loop":
        return stage % pp
    if placement != "v" or stage >= 2 * pp:
        raise ValueError(f"placement {placement!r} has no stage {stage} at pp={pp} (\"v\": 2pp stages)")
    return stage if stage < pp else 2 * pp - 1 - stage


def stages_of_rank(rank: int, pp: int, virtual_stages: int = 1, placement: str = "loop") -> list[int]:
    """The stages held by pp rank ``rank``, in model order: ``[rank, rank + pp, ...]`` ("loop") or
    ``[rank, 2pp - 1 - rank]`` ("v", which needs ``virtual_stages == 2``)."""
    check_shape(pp, 1, virtual_stages)
    if not 0 <= rank < pp:
        raise ValueError(f"pp rank must be in [0, {pp}), got {rank}")
    if placement == "v":
        if virtual_stages != 2:
            raise ValueError(f"the V placement holds 2 stages per rank, got virtual_stages={virtual_stages}")
        return [rank, 2 * pp - 1 - rank]
    return [rank + chunk * pp for chunk in range(virtual_stages)]


def check_shape(pp: int, num_microbatches: int, virtual_stages: int) -> None:
    if pp < 1 or num_microbatches < 1 or virtual_stages < 1:
        raise ValueError(
            "need pp >= 1, num_microbatches >= 1 and virtual_stages >= 1, got "
            f"pp={pp} num_microbatches={num_microbatches} virtual_stages={virtual_stages}"
        )


def forward_actions(stage: int, microbatch: int, num_stages: int, rank_of=None) -> list[Action]:
    """F with its comms: the input arrives right before it, the output leaves right after.

    ``rank_of(stage)`` (None: every stage on its own rank) tells which neighbours share this
    stage's rank: those hand over in memory, without a message.
    """
    actions = [Action(stage, Op.FORWARD, microbatch)]
    if stage > 0 and not _same_rank(stage, stage - 1, rank_of):
        actions.insert(0, Action(stage, Op.RECV_F, microbatch))
    if stage < num_stages - 1 and not _same_rank(stage, stage + 1, rank_of):
        actions.append(Action(stage, Op.SEND_F, microbatch))
    return actions


def backward_actions(stage: int, microbatch: int, num_stages: int, rank_of=None,
                     op: Op = Op.BACKWARD) -> list[Action]:
    """B (or a zero-bubble I) with its comms; the last stage's starts from its own loss, so it
    receives nothing."""
    actions = [Action(stage, op, microbatch)]
    if stage < num_stages - 1 and not _same_rank(stage, stage + 1, rank_of):
        actions.insert(0, Action(stage, Op.RECV_B, microbatch))
    if stage > 0 and not _same_rank(stage, stage - 1, rank_of):
        actions.append(Action(stage, Op.SEND_B, microbatch))
    return actions


def _same_rank(a: int, b: int, rank_of) -> bool:
    return rank_of is not None and rank_of(a) == rank_of(b)
