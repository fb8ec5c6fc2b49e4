"""The pure analysis behind bench/pipeline_bubble.py: hand-off latencies (no processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from pipeline_analysis import _handoff_latencies, _parse, _quantiles_ms  # noqa: E402

from meshspeak.schedule import Action, Op  # noqa: E402


def test_handoff_latencies_split_waiting_and_late_receives():
    send_f, recv_f = Action(0, Op.SEND_F, 0), Action(1, Op.RECV_F, 0)
    send_b, recv_b = Action(1, Op.SEND_B, 0), Action(0, Op.RECV_B, 0)
    spans = {
        send_f: (10.0, 10.001), recv_f: (9.0, 10.004),  # receiver waited: 4 ms after the send
        send_b: (20.0, 20.001), recv_b: (21.0, 21.002),  # send came first: the receive took 2 ms
    }
    waiting, late = _handoff_latencies(spans)
    assert waiting == [pytest.approx(0.004)] and late == [pytest.approx(0.002)]
    assert _quantiles_ms(waiting)["median"] == pytest.approx(4.0)
    assert _quantiles_ms([]) == {"n": 0}


def test_parse_reads_action_text_back():
    for action in (Action(2, Op.FORWARD, 0), Action(1, Op.SEND_F, 13), Action(11, Op.RECV_B, 7)):
        assert _parse(str(action)) == action


def test_bottleneck_bubble_is_the_schedule_theory_at_equal_costs():
    """The paper's bubble rate on the simulator: idle over compute of the busiest rank is (p-1)/m for
    1F1B and (p-1)/(3m) for ZB-H1 at F = I = W, and the stage imbalance that the rank-averaged bubble
    counts does not enter it."""
    from pipeline_analysis import _bottleneck

    from meshspeak.schedule import make_schedule
    from meshspeak.schedule_sim import simulate

    for pp, m in ((2, 8), (4, 16)):
        ofob = simulate(make_schedule("1f1b", pp, m), pp, f_cost=1.0, b_cost=2.0)
        zb = simulate(make_schedule("zb-h1", pp, m), pp, f_cost=1.0, i_cost=1.0, w_cost=1.0)
        assert _bottleneck(ofob) == pytest.approx((pp - 1) / m)
        assert _bottleneck(zb) == pytest.approx((pp - 1) / (3 * m))

    # The last stage 10% slower: the faster ranks wait for it under any schedule. The busiest rank's
    # idle is unchanged by that, while the rank-averaged idle grows for both schedules alike.
    def slow_last(a, base):
        return base * (1.1 if a.stage == 1 else 1.0)

    costs = {Op.FORWARD: 1.0, Op.BACKWARD: 2.0, Op.BACKWARD_INPUT: 1.0, Op.BACKWARD_WEIGHT: 1.0}
    sims = {name: simulate(make_schedule(name, 2, 8), 2, cost=lambda a: slow_last(a, costs[a.op]))
            for name in ("1f1b", "zb-h1")}  # fmt: skip
    averaged = {k: s.bubble_fraction / (1 - s.bubble_fraction) for k, s in sims.items()}
    assert averaged["zb-h1"] / averaged["1f1b"] > 0.4  # the common waiting pulls it towards 1
    assert _bottleneck(sims["zb-h1"]) / _bottleneck(sims["1f1b"]) == pytest.approx(1 / 3, abs=0.02)


def test_formula_ratio_reads_the_stages_after_the_first():
    from pipeline_zero_bubble import formula_ratio

    # The first stage's I is empty and its W the whole backward: it must not enter the formula.
    per_stage = {"F_s_per_stage": [9.0, 1.0, 1.0], "I_s_per_stage": [0.0, 1.0, 1.0],
                 "W_s_per_stage": [9.0, 1.0, 1.0]}  # fmt: skip
    assert formula_ratio(per_stage) == pytest.approx(1 / 3)
    per_stage["I_s_per_stage"] = [0.0, 1.36, 1.36]  # I above W: the schedule cannot reach a third
    assert formula_ratio(per_stage) > 1 / 3
