"""The executor's point-to-point calls, recorded per rank: batched on the NCCL path and deadlock-free.

Each pp rank's ``Executor`` runs its real action list on tiny CPU stages with a recording transport
(receives yield zeros), so what is checked is exactly the sequence of calls the executor makes. The
NCCL path must post only ``batch_isend_irecv`` batches, the ones ``meshspeak.p2p_rounds`` plans;
those are then played in the strictest NCCL model (``strict_deadlock``: a rank's batches one after
the other, an op completes only when its partner is posted in the peer's current batch, no
buffering). Real NCCL only relaxes this, so what completes there completes on NCCL. The gloo path's
calls (one op at a time, receives posted ahead) deadlock in that model already at 1F1B pp=2 (both
neighbours send first), which is why NCCL does not take it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshspeak.p2p_rounds import batch_ops, nccl_batches, rank_batches, strict_deadlock
from meshspeak.schedule import COMPUTE_OPS, Op, forward_only, make_schedule, placement_of, stages_of_rank
from workers.p2p import Message, Transport
from workers.pipeline import Executor, Stage, StepData

B, S, D, V = 1, 2, 4, 8


class _Done:
    def wait(self) -> None:
        pass


class RecordingTransport(Transport):
    """Records every call as ("batch" | "isend" | "irecv", [(send, peer), ...]), and the tags."""

    def __init__(self) -> None:
        super().__init__(None)
        self.calls: list[tuple[str, list[tuple[bool, int]]]] = []
        self.tags: list[tuple[bool, int, int]] = []  # (send, peer, tag) on the gloo path

    def isend(self, tensor, peer, tag=0):
        self.calls.append(("isend", [(True, peer)]))
        self.tags.append((True, peer, tag))
        return _Done()

    def irecv(self, tensor, peer, tag=0):
        tensor.zero_()
        self.calls.append(("irecv", [(False, peer)]))
        self.tags.append((False, peer, tag))
        return _Done()

    def batch(self, messages: list[Message]):
        for m in messages:
            if not m.send:
                m.tensor.zero_()
        self.calls.append(("batch", [(m.send, m.peer) for m in messages]))
        return [_Done() for _ in messages]


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, V)

    def forward(self, x):
        return self.proj(x)


def _record(schedule: str, pp: int, m: int, v: int, batched: bool, forward: bool = False,
            transports: list | None = None) -> list[list]:
    """Run every pp rank's action list (``forward``: its forward-only part, as held-out eval runs it,
    under no_grad); returns each rank's recorded calls (``transports``: gets each rank's
    RecordingTransport)."""
    actions = make_schedule(schedule, pp, m, v)
    if forward:
        actions = [forward_only(rank_actions) for rank_actions in actions]
    num_stages = pp * v
    data = StepData(inputs=[torch.randn(B, S, D) for _ in range(m)],
                    targets=[torch.randint(0, V, (B, S)) for _ in range(m)], grad_scale=1.0, report_scale=1.0)
    calls = []
    for rank in range(pp):
        stages = {}
        for s in stages_of_rank(rank, pp, v, placement_of(schedule)):
            last = s == num_stages - 1
            stages[s] = Stage(index=s, module=_Head() if last else nn.Linear(D, D), is_first=s == 0, is_last=last)
        transport = RecordingTransport()
        executor = Executor(stages, num_stages=num_stages, pp=pp, peer_of_pp_index=lambda p: p,
                            boundary_shape=(B, S, D), boundary_dtype=torch.float32, device=torch.device("cpu"),
                            pp_group=None, recv_lookahead=0 if batched else 2, transport=transport,
                            nccl_plan=(lambda acts, r=rank: rank_batches(schedule, pp, v, r, tuple(acts)))
                            if batched else None, placement=placement_of(schedule))
        with torch.set_grad_enabled(not forward):
            loss, timings, _ = executor.run(actions[rank], data)
        assert len(timings) == len(actions[rank])
        assert all(t.end_s >= t.start_s >= 0 for t in timings)
        calls.append(transport.calls)
        if transports is not None:
            transports.append(transport)
    return calls


CASES = [("1f1b", pp, m, 1) for pp in (2, 3, 4) for m in (1, 2, 4, 8)]
CASES += [("gpipe", pp, m, 1) for pp in (2, 4) for m in (1, 4)]
CASES += [("interleaved_1f1b", pp, m, v) for pp in (2, 4) for m in (pp, 2 * pp) for v in (2, 3)]
CASES += [("zb-h1", pp, m, 1) for pp in (2, 3, 4) for m in (pp, 2 * pp)]
CASES += [("zbv", pp, m, 2) for pp in (2, 3, 4) for m in (pp, 2 * pp)]


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), CASES)
def test_nccl_path_posts_only_the_planned_batches_and_they_cannot_deadlock(schedule, pp, m, v):
    calls = _record(schedule, pp, m, v, batched=True)
    assert {kind for rank in calls for kind, _ in rank} == {"batch"}
    actions = make_schedule(schedule, pp, m, v)
    planned = batch_ops(actions, nccl_batches(actions), placement_of(schedule))
    recorded = [[ops for _, ops in rank] for rank in calls]
    assert recorded == planned
    for rank in range(pp):  # every message exactly once
        comms = [a for a in actions[rank] if a.op not in COMPUTE_OPS]
        assert sum(len(ops) for ops in recorded[rank]) == len(comms)
    assert strict_deadlock(recorded) == []


EVAL_CASES = [("1f1b", 1, 4, 1), ("gpipe", 1, 2, 1), ("1f1b", 2, 1, 1), ("1f1b", 2, 4, 1), ("gpipe", 2, 4, 1),
              ("1f1b", 4, 8, 1), ("interleaved_1f1b", 2, 4, 2), ("zb-h1", 2, 4, 1), ("zbv", 2, 4, 2)]


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), EVAL_CASES)
def test_held_out_eval_runs_on_the_nccl_path_with_planned_batches(schedule, pp, m, v):
    """Eval runs each rank's forward-only list (workers/batching.py) through the executor that has the
    NCCL planner (workers/runtime.py, at any pp): planned from every rank's forward-only list, posted
    as batches only, deadlock-free in the strict model; at pp=1 nothing is posted."""
    calls = _record(schedule, pp, m, v, batched=True, forward=True)
    actions = [forward_only(a) for a in make_schedule(schedule, pp, m, v)]
    planned = batch_ops(actions, nccl_batches(actions), placement_of(schedule))
    recorded = [[ops for _, ops in rank] for rank in calls]
    assert recorded == planned
    assert {kind for rank in calls for kind, _ in rank} == ({"batch"} if pp > 1 else set())
    for rank in range(pp):  # every forward message exactly once, and no backward one
        sends = sum(1 for a in actions[rank] if a.op == Op.SEND_F)
        recvs = sum(1 for a in actions[rank] if a.op == Op.RECV_F)
        assert sum(send for batch in recorded[rank] for send, _ in batch) == sends
        assert sum(not send for batch in recorded[rank] for send, _ in batch) == recvs
    assert strict_deadlock(recorded) == []


def test_a_partial_forward_list_is_still_refused():
    forward = forward_only(make_schedule("1f1b", 2, 4)[0])
    with pytest.raises(ValueError, match="nor its forward-only part"):
        rank_batches("1f1b", 2, 1, 0, tuple(forward[:-1]))


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), [("1f1b", 2, 4, 1), ("interleaved_1f1b", 2, 4, 2)])
def test_gloo_posting_would_deadlock_on_nccl(schedule, pp, m, v):
    calls = _record(schedule, pp, m, v, batched=False)
    assert {kind for rank in calls for kind, _ in rank} == {"isend", "irecv"}
    assert strict_deadlock([[ops for _, ops in rank] for rank in calls]) != []


def test_batching_each_run_of_comm_actions_is_not_enough():
    """The obvious local rule (one batch per run of consecutive communication actions) deadlocks
    interleaved 1F1B in the strict model: batches must be planned from every rank's list."""
    actions = make_schedule("interleaved_1f1b", 2, 4, 2)
    runs = []
    for rank_actions in actions:
        rank_runs, run = [], []
        for a in [*rank_actions, None]:
            if a is not None and a.op not in (Op.FORWARD, Op.BACKWARD):
                run.append((a.op in (Op.SEND_F, Op.SEND_B), 1 - actions.index(rank_actions)))
            elif run:
                rank_runs.append(run)
                run = []
        runs.append(rank_runs)
    assert strict_deadlock(runs) != []


def test_gloo_path_posts_receives_ahead_and_sends_when_reached():
    calls = _record("1f1b", 2, 4, 1, batched=False)
    assert [kind for kind, _ in calls[1]][:2] == ["irecv", "irecv"]  # lookahead 2 before any compute
    batched = _record("1f1b", 2, 4, 1, batched=True)
    for rank in range(2):  # the same messages as the NCCL path
        assert sorted(op for _, ops in calls[rank] for op in ops) == sorted(op for _, ops in batched[rank] for op in ops)


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), [("1f1b", 3, 4, 1), ("zb-h1", 3, 4, 1), ("zbv", 3, 6, 2)])
def test_gloo_messages_carry_tags_that_pair_each_send_with_its_receive(schedule, pp, m, v):
    """gloo matches a receive by (peer, tag): zbv's receives from one neighbour come in another order
    than its sends (meshspeak/p2p_rounds.py), which one shared tag would pair wrongly."""
    transports: list = []
    _record(schedule, pp, m, v, batched=False, transports=transports)
    sent = sorted((rank, peer, tag) for rank, t in enumerate(transports) for send, peer, tag in t.tags if send)
    received = sorted((peer, rank, tag) for rank, t in enumerate(transports) for send, peer, tag in t.tags
                      if not send)
    assert sent == received and len(set(sent)) == len(sent)  # each message its own tag


def test_a_list_that_is_not_the_named_schedule_is_refused():
    one_f_one_b = make_schedule("1f1b", 2, 4)
    with pytest.raises(ValueError, match="not pipeline.schedule='gpipe'"):
        rank_batches("gpipe", 2, 1, 0, tuple(one_f_one_b[0]))


def test_plans_for_every_schedule_shape_are_lockstep_and_post_in_time():
    for name, pps, vs in [("1f1b", (1, 2, 3, 4, 8), (1,)), ("gpipe", (2, 3, 4), (1,)),
                          ("interleaved_1f1b", (2, 3, 4), (2, 3, 4)), ("zb-h1", (2, 3, 4), (1,)),
                          ("zbv", (2, 3, 4), (2,))]:
        for pp in pps:
            for v in vs:
                for m in range(1, 13):
                    try:
                        actions = make_schedule(name, pp, m, v)
                    except ValueError:
                        continue
                    plan = nccl_batches(actions)
                    assert strict_deadlock(batch_ops(actions, plan, placement_of(name))) == [], (name, pp, m, v)
                    for rank, batches in enumerate(plan):
                        posts = [b.post_at for b in batches]
                        assert posts == sorted(posts)
                        for b in batches:
                            for i in b.members:  # a receive before it is needed, a send after it is made
                                is_send = actions[rank][i].op in (Op.SEND_F, Op.SEND_B)
                                assert (b.post_at > i) if is_send else (b.post_at <= i)
