"""The zero-bubble schedules as data (meshspeak/zero_bubble.py): order, counts, memory, bubble (no processes)."""

from __future__ import annotations

from collections import Counter

import pytest

from meshspeak.p2p_rounds import batch_ops, nccl_batches, strict_deadlock
from meshspeak.schedule import (
    COMPUTE_OPS,
    Action,
    Op,
    make_schedule,
    message_key,
    peak_in_flight,
    placement_of,
    stage_to_rank,
    stages_of_rank,
    theoretical_bubble,
)
from meshspeak.schedule_sim import ScheduleError, simulate
from meshspeak.zero_bubble import zb_h1, zbv

# Every (pp, m) the config accepts (m >= pp) and the smaller m the schedules still run.
SHAPES = [(pp, m) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 7, 8, 16)]
CASES = [(name, pp, m) for name in ("zb-h1", "zbv") for pp, m in SHAPES]
IDS = [f"{name}-pp{pp}-m{m}" for name, pp, m in CASES]


def _v(name: str) -> int:
    return 2 if name == "zbv" else 1


def _make(name: str, pp: int, m: int):
    return make_schedule(name, pp, m, _v(name))


def _text(actions) -> str:
    return " ".join(str(a) for a in actions if a.op in COMPUTE_OPS)


@pytest.mark.parametrize(("name", "pp", "m"), CASES, ids=IDS)
def test_every_stage_runs_one_f_i_and_w_per_microbatch_on_its_own_rank(name, pp, m):
    schedule = _make(name, pp, m)
    placement = placement_of(name)
    counts: Counter = Counter()
    for rank, actions in enumerate(schedule):
        assert sum(a.op in COMPUTE_OPS for a in actions) == 3 * m * _v(name)
        assert not any(a.op == Op.BACKWARD for a in actions)  # every backward is split
        for a in actions:
            assert stage_to_rank(a.stage, pp, placement) == rank
            counts[(a.stage, a.op, a.microbatch)] += 1
    for stage in range(pp * _v(name)):
        for op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
            assert [counts[(stage, op, mb)] for mb in range(m)] == [1] * m, (stage, op)


@pytest.mark.parametrize(("name", "pp", "m"), CASES, ids=IDS)
def test_each_microbatch_runs_f_then_i_then_w(name, pp, m):
    for actions in _make(name, pp, m):
        at = {(a.stage, a.op, a.microbatch): i for i, a in enumerate(actions)}
        for (stage, op, mb), i in at.items():
            if op == Op.BACKWARD_WEIGHT:
                assert at[(stage, Op.FORWARD, mb)] < at[(stage, Op.BACKWARD_INPUT, mb)] < i


@pytest.mark.parametrize(("name", "pp", "m"), CASES, ids=IDS)
def test_comms_wrap_f_and_i_and_never_a_w_or_a_hand_off_on_one_rank(name, pp, m):
    num_stages = pp * _v(name)
    rank_of = lambda s: stage_to_rank(s, pp, placement_of(name))  # noqa: E731
    for actions in _make(name, pp, m):
        for i, a in enumerate(actions):
            before = actions[i - 1] if i > 0 else None
            after = actions[i + 1] if i + 1 < len(actions) else None
            prev_remote = a.stage > 0 and rank_of(a.stage - 1) != rank_of(a.stage)
            next_remote = a.stage < num_stages - 1 and rank_of(a.stage + 1) != rank_of(a.stage)
            if a.op == Op.FORWARD:
                assert (before == Action(a.stage, Op.RECV_F, a.microbatch)) == prev_remote
                assert (after == Action(a.stage, Op.SEND_F, a.microbatch)) == next_remote
            elif a.op == Op.BACKWARD_INPUT:
                assert (before == Action(a.stage, Op.RECV_B, a.microbatch)) == next_remote
                assert (after == Action(a.stage, Op.SEND_B, a.microbatch)) == prev_remote
            elif a.op == Op.BACKWARD_WEIGHT:
                assert after is None or after.op in COMPUTE_OPS or after.op in (Op.RECV_F, Op.RECV_B)


@pytest.mark.parametrize(("name", "pp", "m"), CASES, ids=IDS)
def test_simulator_runs_them_to_the_end(name, pp, m):
    schedule = _make(name, pp, m)
    result = simulate(schedule, pp, _v(name), placement=placement_of(name))  # raises on deadlock
    sends = sum(a.op in (Op.SEND_F, Op.SEND_B) for r in schedule for a in r)
    # Message boundaries: every stage boundary but the V's turn (stages pp-1, pp share rank pp-1).
    boundaries = pp - 1 if name == "zb-h1" else 2 * pp - 2
    assert sends == 2 * boundaries * m
    for busy in result.busy:
        assert all(a.end <= b.start for a, b in zip(busy, busy[1:]))


@pytest.mark.parametrize(("name", "pp", "m"), CASES, ids=IDS)
def test_nccl_lockstep_batches_complete_and_match_messages_in_order(name, pp, m):
    schedule = _make(name, pp, m)
    placement = placement_of(name)
    batches = nccl_batches(schedule)
    assert strict_deadlock(batch_ops(schedule, batches, placement)) == []
    # NCCL matches a pair's messages in posting order: what a rank posts to a peer, in order, is
    # what that peer posts to receive from it.
    posted: dict[tuple[int, int, bool], list] = {}
    for rank, rank_batches in enumerate(batches):
        for batch in rank_batches:
            for i in batch.members:
                a = schedule[rank][i]
                _, src, dst, _ = message_key(a)
                send = a.op in (Op.SEND_F, Op.SEND_B)
                pair = (rank, stage_to_rank(dst, pp, placement)) if send else (stage_to_rank(src, pp, placement), rank)
                posted.setdefault((*pair, send), []).append(message_key(a))
    for (src, dst, send), keys in posted.items():
        if send:
            assert posted[(src, dst, False)] == keys


@pytest.mark.parametrize(("pp", "m"), SHAPES)
def test_zb_h1_holds_what_1f1b_holds_at_its_peak(pp, m):
    """ZB-H1's promise: the same peak activation memory as 1F1B (rank 0's ``min(pp, m)``
    microbatches), every rank now up to that peak; a microbatch counts until its W."""
    ofob = [peak_in_flight(r) for r in make_schedule("1f1b", pp, m)]
    zb = [peak_in_flight(r) for r in zb_h1(pp, m)]
    assert max(zb) == max(ofob) == min(pp, m)
    assert zb == [min(pp, m)] * pp


@pytest.mark.parametrize(("pp", "m"), SHAPES)
def test_zbv_holds_what_1f1b_holds_in_half_size_chunks(pp, m):
    """zbv's stages are half of 1F1B's (2 per rank): 2pp chunk-microbatches are pp stage-microbatches."""
    ofob = max(peak_in_flight(r) for r in make_schedule("1f1b", pp, m))
    assert max(peak_in_flight(r) for r in zbv(pp, m)) == 2 * ofob


@pytest.mark.parametrize(("pp", "m"), [(pp, m) for pp, m in SHAPES if m >= pp])
def test_zb_h1_bubble_is_a_third_of_1f1b(pp, m):
    """With F = I = W = 1 (B = 2) each 1F1B rank idles 3(pp-1) units, each ZB-H1 rank pp-1; as a
    fraction of the step that is (pp-1)/(3m+pp-1)."""
    ofob = simulate(make_schedule("1f1b", pp, m), pp, f_cost=1, b_cost=2)
    zb = simulate(zb_h1(pp, m), pp, f_cost=1, i_cost=1, w_cost=1)
    idle = lambda r: r.makespan * pp * r.bubble_fraction / pp  # noqa: E731 - per rank
    assert idle(ofob) == pytest.approx(3 * (pp - 1))
    assert idle(zb) == pytest.approx(pp - 1)
    assert zb.bubble_fraction == pytest.approx((pp - 1) / (3 * m + pp - 1))
    assert ofob.bubble_fraction == pytest.approx(theoretical_bubble(pp, m))


@pytest.mark.parametrize(("pp", "m"), [(pp, m) for pp, m in SHAPES if m >= pp])
def test_zbv_bubble_is_no_larger_than_zb_h1(pp, m):
    """Same work per rank (two half stages), so the bubbles compare directly; the V fills more of
    it once there are 2pp microbatches to fill it with."""
    h1 = simulate(zb_h1(pp, m), pp).bubble_fraction
    v = simulate(zbv(pp, m), pp, 2, placement="v").bubble_fraction
    assert v <= h1 + 1e-12
    if m >= 2 * pp - 1:  # idle / compute: (pp-1)/(6m), half of ZB-H1's (pp-1)/(3m)
        assert v / (1 - v) == pytest.approx((pp - 1) / (6 * m))


def test_zb_h1_order_for_two_ranks():
    rank0, rank1 = (_text(r) for r in zb_h1(2, 4))
    # Rank 0: 1F1B's one warm-up forward, W right after each I. Rank 1: its first W held back.
    assert rank0 == "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3"
    assert rank1 == "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3"


def test_zbv_places_a_v_and_hands_over_at_its_turn():
    assert [stage_to_rank(s, 4, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert stages_of_rank(0, 4, 2, "v") == [0, 7] and stages_of_rank(3, 4, 2, "v") == [3, 4]
    rank0, rank1 = zbv(2, 4)
    assert _text(rank1).startswith("1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0")
    assert Action(1, Op.SEND_F, 0) not in rank1 and Action(2, Op.RECV_F, 0) not in rank1  # in memory
    assert _text(rank0).startswith("0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1")  # loss on rank 0
    with pytest.raises(ValueError, match="2 stages per rank"):
        stages_of_rank(0, 4, 3, "v")
    with pytest.raises(ValueError, match="no stage 8"):
        stage_to_rank(8, 4, "v")


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("zbv", 2, 4, 1), "needs pipeline.virtual_stages=2"),
        (("zb-h1", 2, 4, 2), "needs pipeline.virtual_stages=1"),
        (("zb-h1", 1, 4, 1), "needs pp >= 2"),
        (("zbv", 1, 4, 2), "needs pp >= 2"),
    ],
)
def test_invalid_zero_bubble_shapes_are_rejected(args, match):
    with pytest.raises(ValueError, match=match):
        make_schedule(*args)


def test_simulator_rejects_broken_split_backwards():
    w_first = zb_h1(2, 2)
    i, w = w_first[0].index(Action(0, Op.BACKWARD_INPUT, 0)), w_first[0].index(Action(0, Op.BACKWARD_WEIGHT, 0))
    w_first[0][i], w_first[0][w] = w_first[0][w], w_first[0][i]
    with pytest.raises(ScheduleError, match="0W0 needs its I before"):
        simulate(w_first, 2)

    no_w = zb_h1(2, 2)
    no_w[1].remove(Action(1, Op.BACKWARD_WEIGHT, 1))
    with pytest.raises(ScheduleError, match=r"an I but never its W: \[\(1, 1\)\]"):
        simulate(no_w, 2)

    both = zb_h1(2, 1)
    both[1].append(Action(1, Op.BACKWARD, 0))
    with pytest.raises(ScheduleError, match="second time"):
        simulate(both, 2)

    message_on_one_rank = zbv(2, 2)
    message_on_one_rank[1].insert(3, Action(1, Op.SEND_F, 0))
    with pytest.raises(ScheduleError, match="share a rank"):
        simulate(message_on_one_rank, 2, 2, placement="v")

    with pytest.raises(ScheduleError, match="belongs to rank"):  # the V read as the loop placement
        simulate(zbv(2, 2), 2, 2)


def test_peak_in_flight_counts_a_microbatch_until_its_w():
    f, i, w = (Action(0, op, 0) for op in (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT))
    f1 = Action(0, Op.FORWARD, 1)
    assert peak_in_flight([f, i, f1, w]) == 2
    assert peak_in_flight([f, i, w, f1]) == 1


def test_plan_shows_the_v_and_the_simulated_bubble():
    from orchestrator.config.load import load_config
    from orchestrator.plan.mesh_plan import describe, make_plan

    cfg = load_config(None, ["mesh.pp=2", "mesh.dp=1", "mesh.tp=1", "pipeline.schedule=zbv",
                             "pipeline.virtual_stages=2", "train.global_batch_size=8", "train.micro_batch_size=1"])
    info = describe(cfg, make_plan(cfg))
    assert [s["pp_rank"] for s in info["stages"]] == [0, 1, 1, 0]
    assert info["bubble_estimate"] == pytest.approx(simulate(zbv(2, 8), 2, 2, placement="v").bubble_fraction)
    # Rank 0 holds the loss's stage (logits) and both ranks 2pp = 4 half-stage microbatches at the peak.
    assert [info["memory_per_rank"][r]["peak_microbatches_in_flight"] for r in (0, 1)] == [4, 4]
    assert info["memory_per_rank"][0]["activations"] > info["memory_per_rank"][1]["activations"]
