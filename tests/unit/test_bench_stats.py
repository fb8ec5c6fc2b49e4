"""bench/stats.py: how repeats become a headline (median with spread, per-repeat ratios, how many met the goal)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from stats import paired_ratios, repeats_meeting, spread  # noqa: E402


def test_spread_is_the_median_with_min_max_and_every_repeat_in_order():
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3, "per_repeat": [3.0, 1.0, 2.0]}


def test_spread_of_an_even_count_is_the_mean_of_the_middle_two_never_the_best():
    s = spread([0.86, 0.95, 1.08, 1.20])
    assert s["median"] == pytest.approx((0.95 + 1.08) / 2)
    assert (s["min"], s["max"]) == (0.86, 1.20)


def test_a_repeat_without_the_figure_is_left_out_of_the_median_but_kept_in_place():
    s = spread([None, 4.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (3.0, 2.0, 4.0, 2)
    assert s["per_repeat"] == [None, 4.0, 2.0]


def test_no_figure_in_any_repeat_gives_none():
    assert spread([]) is None and spread([None, None]) is None


def test_spread_rounds_every_number_when_asked():
    s = spread([1.23456, 2.34567, None], ndigits=2)
    assert s == {"median": 1.79, "min": 1.23, "max": 2.35, "n": 2, "per_repeat": [1.23, 2.35, None]}


def test_paired_ratios_pair_repeat_by_repeat():
    assert paired_ratios([2.0, 3.0, None, 1.0], [1.0, 2.0, 5.0, 0.0]) == [2.0, 1.5, None, None]
    with pytest.raises(ValueError, match="one to one"):
        paired_ratios([1.0], [1.0, 2.0])


def test_the_goal_holds_only_when_every_repeat_meets_it():
    # bench/results/ray_train_compare_zero0.json's issue: of 0.86, 0.95, 1.08 only one meets 1.05.
    assert repeats_meeting([0.86, 0.95, 1.08], lambda r: r >= 1.05) == ("1 of 3", False)
    assert repeats_meeting([1.06, 1.10, 1.08], lambda r: r >= 1.05) == ("3 of 3", True)
    assert repeats_meeting([1.06, None, 1.08], lambda r: r >= 1.05) == ("2 of 3", False)
    assert repeats_meeting([], lambda r: True) == ("0 of 0", False)
