"""bench/torchft_compare.py end to end at a small size: torchft 0.2.0 (4 replica processes and its
Lighthouse) beside elastimesh's CLI at dp=4, each fault-free and with one replica SIGKILLed at step 5
and brought back. Checks the JSON's shape and that both sides trained all their steps through the
fault, never a timing (the figures depend on the machine and its load)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.command_line import run_bench_script

pytest.importorskip("torchft")


@pytest.mark.slow  # 4 runs: two of 4 torchft processes, two of an embedded Ray with 4 rank actors (minutes)
@pytest.mark.timeout(1500)
def test_torchft_compare_quick_writes_json(tmp_path: Path) -> None:
    result = run_bench_script("torchft_compare.py", tmp_path / "torchft_compare.json",
                              "--sides", "torchft,elastimesh_zero0", timeout=1480)
    assert result["benchmark"] == "torchft_compare" and result["quick"] is True
    steps = result["config"]["steps"]
    assert result["config"]["fault_steps"] == [5] and steps == 12
    for side in ("torchft", "elastimesh_zero0"):
        (pair,) = result["runs"][side]
        clean, faults = pair["clean"], pair["faults"]
        # Both trained every step, fault-free and through one SIGKILL of a replica it started.
        assert len(clean["losses"]) == len(faults["losses"]) == steps
        assert clean["kills"] == [] and len(faults["kills"]) == 1
        assert faults["losses"][-1] < faults["losses"][0] and clean["losses"][-1] < clean["losses"][0]
        assert clean["samples_lost"] == 0
        assert clean["steps_wall_s"] > 0 and faults["steps_wall_s"] > 0
        summary = result["summary"][side]
        for key in ("retained", "steps_wall_s_clean", "samples_lost", "final_loss_rel_diff"):
            # bench/stats.py's spread: the median with its spread, and every repeat's own figure (one here).
            assert set(summary[key]) == {"median", "min", "max", "n", "per_repeat"} and summary[key]["n"] == 1
            assert summary[key]["per_repeat"] == [summary[key]["median"]]
        assert clean["loadavg_after"] is None or len(clean["loadavg_after"]) == 3
    em = result["runs"]["elastimesh_zero0"][0]["faults"]
    # elastimesh keeps the math exact: the step in flight re-ran on the full global batch (logged twice
    # only if its first try had been logged), no sample dropped.
    assert em["failures"] >= 1 and em["samples_lost"] == 0 and em["steps_rerun"] <= 1
    assert em["losses"][:5] == result["runs"]["elastimesh_zero0"][0]["clean"]["losses"][:5]
    ft = result["runs"]["torchft"][0]["faults"]
    # torchft went on without the dead group: some step committed with fewer than 4 groups.
    assert ft["steps_short_of_groups"] >= 1 and ft["samples_lost"] >= 2
    assert isinstance(result["goal_met"], bool) and result["repeats_meeting_goal"]["elastimesh_zero0"] in (
        "0 of 1", "1 of 1")
