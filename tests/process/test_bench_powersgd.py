"""Smoke test of bench/powersgd_convergence.py --quick: it runs and writes the keys docs/design.md reads.

Marked slow: two 20-step runs of spawned gloo ranks at dp=2 (~10 s idle). No thresholds: a 20-step
gap says nothing about convergence (the 200-step figures are the bench's, the slow test's in
tests/distributed/test_powersgd.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_powersgd_convergence_quick(tmp_path):
    out = tmp_path / "powersgd.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "powersgd_convergence.py"), "--quick", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"failed:\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(out.read_text())
    assert result["benchmark"] == "powersgd_convergence" and result["quick"] is True
    assert {(r["variant"], r["steps"]) for r in result["runs"]} == {("plain", 20), ("r2", 20)}
    (row,) = result["summary"]
    assert row["variant"] == "r2" and row["plain_loss"] > 0 and row["powersgd_loss"] > 0
    # measured bytes: rank 2 sends far fewer on compressed steps, and the plain steps count in the mean
    assert row["bytes_ratio"] >= 4 and 1 < row["bytes_ratio_mean"] < row["bytes_ratio"]
    assert isinstance(row["met"], bool)
