"""When each rank posts its point-to-point messages as NCCL batches: lockstep rounds (pure data).

The action lists (``meshspeak.schedule``) are proven deadlock-free for an executor whose sends
return at once and whose receives block (``meshspeak.schedule_sim``): gloo's model. NCCL is
stricter. A rank's P2P ops queue on one stream, and a send larger than NCCL's buffers waits for the
peer's receive; 1F1B neighbours that both send before they receive (rank r: SEND_F then RECV_B,
rank r+1: SEND_B then RECV_F) then wait for each other for good. ``torch.distributed.pipelining``
avoids it by posting sends and receives of one time step together (``batch_isend_irecv``: inside
one ncclGroupStart/End all ops progress together) in lockstep: the message a rank sends in its k-th
batch is received in the peer's k-th batch.

``nccl_batches`` derives such batches from the lists: every rank runs its list in rounds; in a
round it computes up to and including its next run of sends, or up to a receive whose message was
not sent in an earlier round. Its batch for the round holds those sends and the receives of the
messages the other ranks send in the same round, posted where the rank stopped (before the RECV
that will wait for them, after the sends). Within a batch the receives from one peer come in the
order that peer's batch sends them (NCCL matches a pair's messages in posting order), which need not
be the receiver's list order: zbv's V has a rank receive activations and gradients from one
neighbour in another order than the neighbour computes them. The rounds end only if the lists complete in the gloo
model too (otherwise ``ScheduleDeadlock``-like ``ValueError``).

``strict_deadlock`` plays batches in the strictest NCCL model: a rank's batches run one after the
other, and an op completes only when its partner is posted in the peer's current batch (no
buffering, one stream per rank). Real NCCL only relaxes that (buffered small sends), so batches that
complete there complete on NCCL. Lockstep batches always complete there: a rank's k-th batch only
waits for peers' k-th batches.

No torch, no ray: pure stdlib.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from meshspeak.schedule import Action, Op, forward_only, make_schedule, message_key, stage_to_rank

SENDS = (Op.SEND_F, Op.SEND_B)
RECVS = (Op.RECV_F, Op.RECV_B)


@dataclass(frozen=True, slots=True)
class Batch:
    """Post the communication actions ``members`` (indices into the rank's list: its sends in list
    order, then its receives in the order their senders send them) in one ``batch_isend_irecv``
    right before action ``post_at`` (``len(list)``: after the last one)."""

    post_at: int
    members: tuple[int, ...]


def nccl_batches(schedule: Sequence[Sequence[Action]]) -> list[list[Batch]]:
    """Each pp rank's lockstep batches for ``schedule`` (see the module docstring)."""
    pp = len(schedule)
    receiver: dict[tuple, tuple[int, int]] = {}  # message -> (rank, index of its RECV)
    for rank, actions in enumerate(schedule):
        for i, a in enumerate(actions):
            if a.op in RECVS:
                receiver[message_key(a)] = (rank, i)
    pos = [0] * pp
    arrived: set[tuple] = set()  # messages whose receive was posted in an earlier round
    batches: list[list[Batch]] = [[] for _ in range(pp)]
    while any(pos[r] < len(schedule[r]) for r in range(pp)):
        sends: dict[int, list[int]] = {r: [] for r in range(pp)}
        moved = False
        for r, actions in enumerate(schedule):
            i = pos[r]
            while i < len(actions):
                a = actions[i]
                if a.op in RECVS and message_key(a) not in arrived:
                    break
                if a.op in SENDS:
                    while i < len(actions) and actions[i].op in SENDS:
                        sends[r].append(i)
                        i += 1
                    break
                i += 1
            moved |= i != pos[r]
            pos[r] = i
        members = {r: list(idx) for r, idx in sends.items()}
        for r, idx in sends.items():  # receives appended in each sender's send order
            for i in idx:
                key = message_key(schedule[r][i])
                if key not in receiver:
                    raise ValueError(f"rank {r}: {schedule[r][i]} sends {key}, which no rank receives")
                q, j = receiver[key]
                members[q].append(j)
                arrived.add(key)
        if not moved and not any(sends.values()):
            stuck = {r: str(schedule[r][pos[r]]) for r in range(pp) if pos[r] < len(schedule[r])}
            raise ValueError(f"schedule deadlocks before any NCCL batching: blocked at {stuck}")
        for r in range(pp):
            if members[r]:
                batches[r].append(Batch(pos[r], tuple(members[r])))
    return batches


@functools.lru_cache(maxsize=16)
def rank_batches(schedule: str, pp: int, virtual_stages: int, rank: int, actions: tuple[Action, ...]) -> list[Batch]:
    """Pp rank ``rank``'s batches, given its list from the driver's ``pipeline.schedule``.

    A rank holds only its own list; the plan needs every rank's, which ``make_schedule`` rebuilds
    from the schedule's name (the microbatch count follows from the list). The list is either that
    schedule's or its forward-only part (held-out eval, ``schedule.forward_only``: then every rank
    runs its forward-only part, and the plan is made from those). Any other list is refused rather
    than planned from a guess (a wrong plan could hang NCCL).
    """
    forwards = sum(1 for a in actions if a.op == Op.FORWARD)
    full = make_schedule(schedule, pp, forwards // virtual_stages, virtual_stages) if schedule else None
    if full is not None and tuple(full[rank]) != actions:
        forward = [forward_only(rank_list) for rank_list in full]
        full = forward if tuple(forward[rank]) == actions else None
    if full is None:
        raise ValueError(f"pp rank {rank}'s action list is not pipeline.schedule={schedule!r}'s (pp={pp}, "
                         f"virtual_stages={virtual_stages}) nor its forward-only part: NCCL batches are "
                         "planned from every rank's list")
    return nccl_batches(full)[rank]


def batch_ops(schedule: Sequence[Sequence[Action]], batches: list[list[Batch]],
              placement: str = "loop") -> list[list[list[tuple[bool, int]]]]:
    """Each rank's batches as lists of (is_send, peer pp rank), the form ``strict_deadlock`` plays
    (``placement``: ``schedule.placement_of`` the schedule's name)."""
    pp = len(schedule)
    out = []
    for rank, rank_batches in enumerate(batches):
        ops = []
        for batch in rank_batches:
            ops.append([(a.op in SENDS, _peer(a, pp, placement))
                        for a in (schedule[rank][i] for i in batch.members)])
        out.append(ops)
    return out


def _peer(action: Action, pp: int, placement: str) -> int:
    _, src, dst, _ = message_key(action)
    return stage_to_rank(dst if action.op in SENDS else src, pp, placement)


def strict_deadlock(batches: Sequence[Sequence[Sequence[tuple[bool, int]]]]) -> list[int]:
    """Play every rank's batches (lists of (is_send, peer)) in the strict model; the ranks left stuck.

    The k-th send from r to q is the partner of the k-th receive on q from r (one tag: messages
    between two ranks match in posting order). Returns [] when every batch completes.
    """
    n = len(batches)
    ids: list[list[list[tuple]]] = []
    count: dict[tuple, int] = {}
    for rank in range(n):
        ids.append([])
        for batch in batches[rank]:
            ops = []
            for send, peer in batch:
                pair = (rank, peer) if send else (peer, rank)  # (sender, receiver)
                k = count.get((pair, send), 0)
                count[(pair, send)] = k + 1
                ops.append((pair, k, send))
            ids[rank].append(ops)
    pos = [0] * n
    done: set[tuple] = set()
    while True:
        active = {op for r in range(n) if pos[r] < len(ids[r]) for op in ids[r][pos[r]]}
        done |= {op for op in active if (op[0], op[1], not op[2]) in active}
        moved = False
        for r in range(n):
            if pos[r] < len(ids[r]) and all(op in done for op in ids[r][pos[r]]):
                pos[r] += 1
                moved = True
        if not moved:
            return [r for r in range(n) if pos[r] < len(ids[r])]
