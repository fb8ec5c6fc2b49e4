"""Smoke tests of the data benchmarks' --quick modes: they run and write the keys the notes read.

Marked slow: data_prepare starts a local Ray, data_memory two fresh rank processes (~30 s idle each).
No thresholds: the figures depend on the machine and its load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(name: str, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / name), "--quick", "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_data_prepare_quick(tmp_path):
    r = _run("data_prepare.py", tmp_path / "p.json")
    assert r["benchmark"] == "data_prepare" and r["quick"] is True
    assert r["ratio"] > 0 and r["tokens_per_s"]["prepare"] > 0 and r["tokens_per_s"]["tokenizers"] > 0
    assert isinstance(r["goal_met"], bool) and r["ray_start_s"] > 0
    # prepare adds one EOS per document to the library's own token count
    assert r["runs"]["prepare"][0]["tokens"] == r["runs"]["tokenizers"][0]["tokens"] + r["config"]["documents"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_data_memory_quick(tmp_path):
    r = _run("data_memory.py", tmp_path / "m.json")
    assert r["benchmark"] == "data_memory" and r["quick"] is True
    assert r["corpus"]["num_tokens"] > 5_000_000 and r["corpus"]["row_groups"] > 50
    for side in ("builtin", "big"):
        s = r["sides"][side]
        assert len(s["rss_after_step_mb"]) == 4 and s["start_s"] > 0 and all(x > 0 for x in s["losses"])
    assert r["sides"]["big"]["mask_eos_id"] == 0 and r["sides"]["builtin"]["mask_eos_id"] is None
    assert isinstance(r["goal_met"], bool)
