"""bench/default_job.py --quick runs the default job through the CLI and writes well-formed JSON (no
timing thresholds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.command_line import run_bench_script


@pytest.mark.slow  # the CLI's embedded local Ray and 4 rank actors: ~1 min idle, more when loaded
@pytest.mark.timeout(900)
def test_default_job_quick_writes_json(tmp_path: Path) -> None:
    result = run_bench_script("default_job.py", tmp_path / "default_job.json", timeout=880)
    assert result["benchmark"] == "default_job" and result["config"]["repeats"] == 1
    run, = result["runs"]
    assert run["steps"] == list(range(1, 9)) and run["generations"] == [1]
    assert run["steady_s"] > 0 and run["step2_ratio"] == pytest.approx(run["step_time_s"][1] / run["steady_s"])
    assert result["step2_ratio"]["per_repeat"] == [round(run["step2_ratio"], 3)]
    assert isinstance(result["goal_met"], bool) and result["repeats_meeting_goal"] in ("0 of 1", "1 of 1")
