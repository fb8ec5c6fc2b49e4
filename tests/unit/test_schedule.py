"""Invariants of the pipeline schedules and of the simulator that checks them (no processes)."""

from __future__ import annotations

import pickle
from collections import defaultdict

import pytest

from meshspeak.schedule import (
    Action,
    Op,
    gpipe,
    interleaved_one_f_one_b,
    make_schedule,
    message_key,
    one_f_one_b,
    peak_in_flight,
    stage_to_rank,
    stages_of_rank,
    theoretical_bubble,
)
from meshspeak.schedule_sim import ScheduleDeadlock, ScheduleError, simulate

PPS = (1, 2, 3, 4, 8)
MICROBATCHES = (1, 2, 4, 8, 16)

# (name, pp, m, v) for every combination the schedules accept.
CASES = [(name, pp, m, 1) for name in ("gpipe", "1f1b") for pp in PPS for m in MICROBATCHES] + [
    ("interleaved_1f1b", pp, m, v)
    for pp in PPS
    if pp > 1
    for m in MICROBATCHES
    if m % pp == 0
    for v in (2, 3)
]
IDS = [f"{name}-pp{pp}-m{m}-v{v}" for name, pp, m, v in CASES]


def _compute(actions: list[Action]) -> list[Action]:
    return [a for a in actions if a.op in (Op.FORWARD, Op.BACKWARD)]


def _text(actions: list[Action]) -> str:
    return " ".join(str(a) for a in actions)


@pytest.mark.parametrize(("name", "pp", "m", "v"), CASES, ids=IDS)
def test_every_stage_runs_one_f_and_one_b_per_microbatch_on_its_own_rank(name, pp, m, v):
    schedule = make_schedule(name, pp, m, v)
    assert len(schedule) == pp
    seen: dict[tuple[int, Op], list[int]] = defaultdict(list)
    for rank, actions in enumerate(schedule):
        assert len(_compute(actions)) == 2 * m * v
        for action in actions:
            assert stage_to_rank(action.stage, pp) == rank
            seen[(action.stage, action.op)].append(action.microbatch)
    for stage in range(pp * v):
        assert sorted(seen[(stage, Op.FORWARD)]) == list(range(m))
        assert sorted(seen[(stage, Op.BACKWARD)]) == list(range(m))


@pytest.mark.parametrize(("name", "pp", "m", "v"), CASES, ids=IDS)
def test_every_forward_precedes_its_backward(name, pp, m, v):
    for actions in make_schedule(name, pp, m, v):
        position = {(a.stage, a.op, a.microbatch): i for i, a in enumerate(actions)}
        for (stage, op, mb), i in position.items():
            if op == Op.BACKWARD:
                assert position[(stage, Op.FORWARD, mb)] < i


@pytest.mark.parametrize(("name", "pp", "m", "v"), CASES, ids=IDS)
def test_comms_wrap_their_compute(name, pp, m, v):
    last = pp * v - 1
    for actions in make_schedule(name, pp, m, v):
        for i, a in enumerate(actions):
            before = actions[i - 1] if i > 0 else None
            after = actions[i + 1] if i + 1 < len(actions) else None
            if a.op == Op.FORWARD:
                assert (before == Action(a.stage, Op.RECV_F, a.microbatch)) == (a.stage > 0)
                assert (after == Action(a.stage, Op.SEND_F, a.microbatch)) == (a.stage < last)
            elif a.op == Op.BACKWARD:
                assert (before == Action(a.stage, Op.RECV_B, a.microbatch)) == (a.stage < last)
                assert (after == Action(a.stage, Op.SEND_B, a.microbatch)) == (a.stage > 0)


@pytest.mark.parametrize(("name", "pp", "m", "v"), CASES, ids=IDS)
def test_simulator_completes_and_every_send_is_received(name, pp, m, v):
    schedule = make_schedule(name, pp, m, v)
    result = simulate(schedule, pp, v)  # raises on deadlock or on an unreceived message
    sends = [a for r in schedule for a in r if a.op in (Op.SEND_F, Op.SEND_B)]
    recvs = [a for r in schedule for a in r if a.op in (Op.RECV_F, Op.RECV_B)]
    # Each message is one (boundary, microbatch, direction): pp*v - 1 boundaries, both directions.
    assert len(sends) == len(recvs) == 2 * (pp * v - 1) * m
    assert {(a.stage, a.op, a.microbatch) for a in sends} == {
        (a.stage - 1, Op.SEND_F, a.microbatch) if a.op == Op.RECV_F
        else (a.stage + 1, Op.SEND_B, a.microbatch)
        for a in recvs
    }
    for rank_busy in result.busy:
        for earlier, later in zip(rank_busy, rank_busy[1:]):
            assert earlier.end <= later.start  # a rank computes one thing at a time
    assert result.makespan == max(iv.end for rank_busy in result.busy for iv in rank_busy)


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 16), (4, 8)])
def test_per_action_costs_equal_to_f_and_b_give_the_theory(pp, m):
    schedule = make_schedule("1f1b", pp, m)
    result = simulate(schedule, pp, cost=lambda a: 1.0 if a.op == Op.FORWARD else 2.0)
    assert result.bubble_fraction == pytest.approx(theoretical_bubble(pp, m))
    assert result.makespan == pytest.approx(3.0 * (m + pp - 1))


def test_a_slow_action_costs_the_whole_pipeline():
    """What bench/pipeline_analysis.py replays measured durations for: 1F1B's steady state has no slack."""
    schedule = make_schedule("1f1b", 2, 8)
    slow = Action(1, Op.BACKWARD, 3)  # the last stage's B of microbatch 3 takes 4 units instead of 2
    base = simulate(schedule, 2, cost=lambda a: 1.0 if a.op == Op.FORWARD else 2.0).makespan
    result = simulate(schedule, 2, cost=lambda a: 4.0 if a == slow else (1.0 if a.op == Op.FORWARD else 2.0))
    assert result.makespan == pytest.approx(base + 2.0)  # all of the extra time is lost
    assert result.bubble_fraction > theoretical_bubble(2, 8)
    with pytest.raises(ValueError, match="must be >= 0"):
        simulate(schedule, 2, cost=lambda a: -1.0)


@pytest.mark.parametrize(("name", "pp", "m", "v"), CASES, ids=IDS)
def test_per_rank_pair_receives_come_in_the_order_of_the_sends(name, pp, m, v):
    """gloo and NCCL match point-to-point messages between two ranks in posting order (the executor
    uses one tag), so the k-th receive on b from a must be the k-th send from a to b."""
    schedule = make_schedule(name, pp, m, v)
    sent: dict[tuple[int, int], list] = defaultdict(list)
    received: dict[tuple[int, int], list] = defaultdict(list)
    for actions in schedule:
        for a in actions:
            if a.op in (Op.FORWARD, Op.BACKWARD):
                continue
            key = message_key(a)  # (kind, src stage, dst stage, microbatch)
            pair = (stage_to_rank(key[1], pp), stage_to_rank(key[2], pp))
            (sent if a.op in (Op.SEND_F, Op.SEND_B) else received)[pair].append(key)
    assert sent == received


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("m", MICROBATCHES)
def test_one_f_one_b_is_warmup_then_steady_then_cooldown(pp, m):
    for stage, actions in enumerate(one_f_one_b(pp, m)):
        warmup = min(pp - stage - 1, m)
        ops = "".join(a.op.value for a in _compute(actions))
        assert ops == "F" * warmup + "FB" * (m - warmup) + "B" * warmup
        assert [a.microbatch for a in _compute(actions) if a.op == Op.FORWARD] == list(range(m))
        assert [a.microbatch for a in _compute(actions) if a.op == Op.BACKWARD] == list(range(m))


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("m", MICROBATCHES)
def test_one_f_one_b_bounds_activations_by_pp_and_beats_gpipe(pp, m):
    for rank, (ofob, gp) in enumerate(zip(one_f_one_b(pp, m), gpipe(pp, m))):
        assert peak_in_flight(ofob) == min(pp - rank, m) <= pp
        assert peak_in_flight(gp) == m
        if m > pp:
            assert peak_in_flight(ofob) < peak_in_flight(gp)


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("m", MICROBATCHES)
@pytest.mark.parametrize(("f_cost", "b_cost"), [(1.0, 2.0), (1.0, 1.0)])
def test_simulated_bubble_matches_theory_for_1f1b_and_gpipe(pp, m, f_cost, b_cost):
    # With uniform per-stage costs and free comms the makespan is (m + pp - 1) * (f + b) for both,
    # whatever the f/b ratio, so the fraction is exactly (pp - 1) / (m + pp - 1).
    for schedule in (one_f_one_b(pp, m), gpipe(pp, m)):
        result = simulate(schedule, pp, f_cost=f_cost, b_cost=b_cost)
        assert result.makespan == pytest.approx((m + pp - 1) * (f_cost + b_cost), abs=1e-9)
        assert result.bubble_fraction == pytest.approx(theoretical_bubble(pp, m), abs=1e-9)


@pytest.mark.parametrize(
    ("name", "pp", "m", "v"), [c for c in CASES if c[0] == "interleaved_1f1b"], ids=str
)
def test_interleaved_shrinks_the_bubble(name, pp, m, v):
    interleaved = simulate(make_schedule(name, pp, m, v), pp, v).bubble_fraction
    plain = simulate(one_f_one_b(pp, m), pp).bubble_fraction
    assert interleaved < plain
    # Under the uniform-cost model Megatron's (p - 1) / (v*m + p - 1) is exact, not just a bound.
    assert interleaved == pytest.approx(theoretical_bubble(pp, m, v), abs=1e-9)


def test_interleaved_follows_megatron_chunk_order():
    # pp=2, v=2, m=4, rank 0 holds stages 0 and 2; warm-up = (2-0-1)*2 + (2-1)*2 = 4 forwards.
    rank0, rank1 = (_compute(r) for r in interleaved_one_f_one_b(2, 4, 2))
    assert _text(rank0) == "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    assert _text(rank1) == "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"


@pytest.mark.parametrize(
    ("name", "pp", "m", "v"), [c for c in CASES if c[0] == "interleaved_1f1b"], ids=str
)
def test_interleaved_warmup_depth(name, pp, m, v):
    for rank, actions in enumerate(make_schedule(name, pp, m, v)):
        warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, m * v)
        ops = "".join(a.op.value for a in _compute(actions))
        steady = m * v - warmup
        assert ops == "F" * warmup + "FB" * steady + "B" * warmup


def test_interleaved_with_one_virtual_stage_is_plain_1f1b():
    assert interleaved_one_f_one_b(4, 8, 1) == one_f_one_b(4, 8)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b"])
@pytest.mark.parametrize("m", MICROBATCHES)
def test_single_rank_is_gradient_accumulation(name, m):
    (actions,) = make_schedule(name, 1, m)
    expected = [Action(0, op, mb) for mb in range(m) for op in (Op.FORWARD, Op.BACKWARD)]
    assert actions == expected
    assert peak_in_flight(actions) == 1
    assert simulate([actions], 1).bubble_fraction == 0.0


def test_swapped_actions_deadlock_and_name_the_blocked_receives():
    schedule = one_f_one_b(2, 2)
    rank0 = schedule[0]
    assert _text(rank0) == "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1"
    # Waiting for mb 0's gradient before sending its activation is a cycle with rank 1.
    rank0[1], rank0[4] = rank0[4], rank0[1]
    with pytest.raises(ScheduleDeadlock) as info:
        simulate(schedule, 2)
    assert info.value.blocked == {0: Action(0, Op.RECV_B, 0), 1: Action(1, Op.RECV_F, 0)}
    assert "rank 0 blocks at 0RECV_B0 (waits for 1SEND_B0)" in str(info.value)
    assert "rank 1 blocks at 1RECV_F0 (waits for 0SEND_F0)" in str(info.value)
    copy = pickle.loads(pickle.dumps(info.value))  # crosses the Ray boundary intact
    assert copy.blocked == info.value.blocked and str(copy) == str(info.value)


def test_simulator_rejects_malformed_schedules():
    forward_only = (Op.FORWARD, Op.SEND_F, Op.RECV_F)
    dropped_recv = one_f_one_b(2, 2)
    dropped_recv[0].remove(Action(0, Op.RECV_B, 1))
    with pytest.raises(ScheduleError, match="input"):  # B of mb 1 runs without its gradient
        simulate(dropped_recv, 2)

    dropped_send = one_f_one_b(2, 2)
    dropped_send[1] = [a for a in dropped_send[1] if a.op != Op.SEND_B]
    with pytest.raises(ScheduleDeadlock):  # rank 0 waits for gradients nobody sends
        simulate(dropped_send, 2)

    duplicate_send = one_f_one_b(2, 1)
    duplicate_send[0].append(Action(0, Op.SEND_F, 0))
    with pytest.raises(ScheduleError, match="second time"):
        simulate(duplicate_send, 2)

    unreceived = one_f_one_b(2, 2)  # rank 1 forgets microbatch 1 entirely
    unreceived[1] = [a for a in unreceived[1] if a.microbatch == 0]
    unreceived[0] = [a for a in unreceived[0] if a.microbatch == 0 or a.op in forward_only]
    with pytest.raises(ScheduleError, match=r"never received: \('F', 0, 1, 1\)"):
        simulate(unreceived, 2)

    wrong_rank = one_f_one_b(2, 1)
    wrong_rank[0].insert(0, Action(1, Op.FORWARD, 0))
    with pytest.raises(ScheduleError, match="belongs to rank 1"):
        simulate(wrong_rank, 2)

    no_backward = [[a for a in r if a.microbatch == 0 or a.op in forward_only] for r in gpipe(2, 2)]
    with pytest.raises(ScheduleError, match="never backwarded"):
        simulate(no_backward, 2)


def test_unknown_schedule_name():
    with pytest.raises(ValueError) as info:
        make_schedule("x", 2, 4)
    assert str(info.value) == (
        "pipeline.schedule='x' is not known: choose one of 1f1b, gpipe, interleaved_1f1b, zb-h1, zbv"
    )


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("interleaved_1f1b", 4, 6, 2), "divisible by pp"),
        (("interleaved_1f1b", 1, 4, 2), "needs pp >= 2"),
        (("1f1b", 2, 4, 2), "needs pipeline.schedule='interleaved_1f1b'"),
        (("gpipe", 2, 0), "num_microbatches >= 1"),
        (("1f1b", 0, 4), "pp >= 1"),
    ],
)
def test_invalid_shapes_are_rejected(args, match):
    with pytest.raises(ValueError, match=match):
        make_schedule(*args)


def test_action_text_and_placement_helpers():
    assert str(Action(2, Op.FORWARD, 0)) == "2F0"
    assert str(Action(1, Op.SEND_F, 3)) == "1SEND_F3"
    assert [stage_to_rank(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert stages_of_rank(1, 4, 3) == [1, 5, 9]
    assert stages_of_rank(0, 1) == [0]
    with pytest.raises(ValueError):
        stages_of_rank(4, 4)


def test_theoretical_bubble_values():
    assert theoretical_bubble(1, 8) == 0.0
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble(4, 8, 2) == pytest.approx(3 / 19)
