"""How the bench scripts combine their repeats into headlines (no runs: their pure aggregation on made-up
repeats): the median with its spread, and a goal that holds only when every repeat meets it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import data_prepare  # noqa: E402
import pipeline_zero_bubble  # noqa: E402
import ray_train_compare  # noqa: E402
import rebalance  # noqa: E402
import step_overhead  # noqa: E402
import torchft_compare  # noqa: E402


def _round(rebalance_of_bound: float, steady: float) -> dict:
    return {"of_capacity_bound": {"healthy": 1.143, "rebalance": rebalance_of_bound},
            "of_capacity_bound_steady": {"healthy": 1.143, "rebalance": steady}}


def test_rebalance_goal_needs_every_round_not_the_median():
    # bench/results/rebalance.json's device rounds: the median 0.971 meets 0.9, the second round does not.
    out = rebalance.over_rounds([_round(0.971, 0.99), _round(0.61, 1.349), _round(1.884, 1.326)])
    assert out["of_capacity_bound"]["rebalance"] == 0.971
    assert out["of_capacity_bound_spread"]["rebalance"] == {
        "median": 0.971, "min": 0.61, "max": 1.884, "n": 3, "per_repeat": [0.971, 0.61, 1.884]}
    assert out["of_capacity_bound_steady"]["rebalance"] == 1.326
    assert out["rounds_meeting_goal"] == "2 of 3"
    assert out["goal_met_median"] is True and out["goal_met"] is False


def test_rebalance_goal_met_when_every_round_meets_it():
    out = rebalance.over_rounds([_round(0.95, 1.0), _round(0.91, 1.0), _round(0.99, 1.0)])
    assert out["rounds_meeting_goal"] == "3 of 3" and out["goal_met"] is True


def _pair(clean_s: float, faults_s: float, lost: int = 0) -> dict:
    run = {"total_wall_s": faults_s + 5, "samples_lost": lost, "final_loss": 1.0, "kills": [1]}
    return {"clean": {**run, "steps_wall_s": clean_s}, "faults": {**run, "steps_wall_s": faults_s}}


def test_torchft_compare_retained_is_per_repeat_then_the_median():
    runs = {"torchft": [_pair(10, 20, 2), _pair(10, 40, 6), _pair(10, 25, 2)],
            "elastimesh_zero0": [_pair(10, 12), _pair(10, 30), _pair(10, 50)]}
    summary = torchft_compare.summarize(runs)
    ft, ours = summary["torchft"]["retained"], summary["elastimesh_zero0"]["retained"]
    assert ft["per_repeat"] == [0.5, 0.25, 0.4] and ft["median"] == 0.4
    assert ours["median"] == pytest.approx(1 / 3) and (ours["min"], ours["max"]) == (0.2, pytest.approx(10 / 12))
    assert summary["torchft"]["samples_lost"]["median"] == 2
    # The median does not meet torchft's (0.33 < 0.4), and 2 of the 3 repeats did (0.83 >= 0.5, 0.33 >= 0.25).
    assert torchft_compare.goal(summary)["met"] is False
    assert torchft_compare.repeats_meeting(runs) == {"elastimesh_zero0": "2 of 3"}


def _side(*tokens_per_s: float) -> list[dict]:
    return [{"wall_s": 100.0, "tokens": int(100 * t), "tokens_per_s": t} for t in tokens_per_s]


def test_data_prepare_ratio_is_per_round_and_every_round_must_meet_it():
    # Round 2 is slow for prepare only: the ratio of the median rates (0.9) would hide it; per round 0.5 shows.
    runs = {"tokenizers": _side(100.0, 100.0, 100.0), "prepare": _side(90.0, 50.0, 95.0)}
    f = data_prepare.figures(runs, ray_start_s=0.0)
    assert f["ratio_spread"]["per_repeat"] == [0.9, 0.5, 0.95]
    assert f["ratio"] == 0.9 and (f["ratio_spread"]["min"], f["ratio_spread"]["max"]) == (0.5, 0.95)
    assert f["rounds_meeting_goal"] == "2 of 3" and f["goal_met"] is False
    assert f["end_to_end_ratio"] == pytest.approx(0.9)  # median prepare wall 100 s, no Ray start charged


def test_step_overhead_spread_is_over_the_interleaved_blocks():
    # Blocks of 2 steps (the last one short), in the order they ran; block 2 of elastimesh was slowed.
    mesh, plain = [1.0, 1.0, 2.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0, 3.0]
    assert step_overhead.block_ratios(mesh, plain, 2) == [1.0, 2.0, 1.0]
    assert step_overhead.block_ratios(mesh, plain, 1) == [1.0, 1.0, 2.0, 2.0, 1.0]


def test_chaos_goodput_headline_counts_the_start_up():
    import chaos

    # bench/results/chaos.json's figures: 247.7 s of useful steps, a 306.8 s run loop, 318.4 s from the start.
    g = chaos.goodput_figures(247.69, {"run_s": 306.82, "with_startup_s": 318.38})
    assert g["goodput"] == g["goodput_with_startup"] == pytest.approx(0.778, abs=1e-3)
    assert g["goodput_without_startup"] == pytest.approx(0.807, abs=1e-3)


def _rt_run(tokens_per_s: float, loop: float, wall: float) -> dict:
    return {"tokens_per_s_median": tokens_per_s, "loop_tokens_per_s": loop, "total_wall_s": wall}


def test_ray_train_compare_ratios_are_per_repeat_and_the_goal_needs_every_repeat():
    # The zero-0 runs issue 37 quotes: 0.86, 0.95, 1.08 of Ray Train's tokens/s; the median run is the middle one.
    rts = [_rt_run(100.0, 50.0, 10.0)] * 3
    ems = [{"tokens_per_s_median": t, "loop_tokens_per_s": 45.0, "loop_tokens_per_s_lower_bound": 40.0,
            "total_wall_s": 5.0, "cpu_s_median": 0.1, "step_time_s_min": 0.2} for t in (86.0, 95.0, 108.0)]
    out = ray_train_compare.ratios_by_variant({"zero0": ems, "ray_train": rts})["zero0"]
    assert out["steady"]["per_repeat"] == [0.86, 0.95, 1.08] and out["steady"]["median"] == 0.95
    # The loop first step to last on both sides; elastimesh's teardown after it counted apart.
    assert out["loop"]["median"] == 0.9 and out["loop_with_teardown"]["median"] == 0.8
    assert out["total_wall"]["median"] == 0.5
    assert out["repeats_meeting_goal"] == "1 of 3" and out["all_repeats_meet_goal"] is False
    assert ray_train_compare._median_run(ems)["tokens_per_s_median"] == 95.0
    # Of an even count the lower middle run, never the faster one.
    assert ray_train_compare._median_run(ems[:2] + [ems[2]] + [dict(ems[2])])["tokens_per_s_median"] == 95.0


def test_zero_bubble_ratio_per_round_and_the_goal_in_every_round():
    def runs(*per_round_steps):
        return [{"bottleneck_idle_over_busy_per_step": steps} for steps in per_round_steps]

    # Round 2's ZB-H1 is slow (0.05 over 0.12): the pooled median could pass, that round does not.
    samples = {"1f1b": runs([0.12, 0.13, 0.13], [0.12, 0.12], [0.15, 0.15]),
               "zb-h1": runs([0.04, 0.04, 0.05], [0.05, 0.05], [0.04, 0.05])}
    per_round, every_round = pipeline_zero_bubble._per_round(samples)
    ratios = per_round["zb_h1_over_1f1b_bottleneck_per_round"]
    assert ratios["per_repeat"] == [pytest.approx(0.04 / 0.13), pytest.approx(0.05 / 0.12), pytest.approx(0.3)]
    assert ratios["median"] == pytest.approx(0.04 / 0.13)
    assert per_round["rounds_meeting_goal"] == "2 of 3" and every_round is False
