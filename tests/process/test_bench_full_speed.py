"""bench/full_speed.py --quick runs end to end and writes well-formed JSON (no timing thresholds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.command_line import run_bench_script


@pytest.mark.slow  # a local Ray, 4 rank actors, a shrink and a grow: ~1 min idle, more when loaded
@pytest.mark.timeout(600)
def test_full_speed_quick_writes_json(tmp_path: Path) -> None:
    result = run_bench_script("full_speed.py", tmp_path / "full_speed.json", "--zero", "0", timeout=580)
    assert result["benchmark"] == "full_speed" and result["final_step"] == 24
    assert [g["dp"] for g in result["generations"]] == [4, 2, 4]
    for g in result["generations"]:
        assert len(g["step_time_s"]) == 8 and g["steady_s"] > 0 and g["step2_ratio"] > 0
    assert isinstance(result["goal_met"], bool)
