"""checkpoint.memory_every through the real CLI: a negative value is bad input (exit 2, one line)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testbed.command_line import assert_bad_input, run_cli

pytestmark = pytest.mark.timeout(120)


def test_negative_memory_every_is_bad_input():
    proc = run_cli("train", "--set", "checkpoint.memory_every=-1")
    assert_bad_input(proc, "checkpoint.memory_every")
    line = next(x for x in proc.stderr.splitlines() if "elastimesh: error:" in x)
    assert "must be >= 0" in line, line


def test_memory_keep_below_two_is_bad_input():
    assert_bad_input(run_cli("train", "--set", "checkpoint.memory_keep=1"), "checkpoint.memory_keep", ">= 2")


@pytest.mark.slow  # starts the CLI's embedded local Ray: under a load of ~30 on 2 cores that took > 100 s
@pytest.mark.timeout(400)
def test_snapshots_no_node_can_hold_are_refused_before_any_rank_starts(tmp_path):
    """#36 item 8 through the real CLI (its embedded local Ray): a 51B-parameter model's snapshot and
    staging copies (10 of each rank's state with the defaults) exceed any node's memory; launch says so
    in one line naming checkpoint.memory_keep and the fixes, before any rank (or the metrics file)."""
    metrics = tmp_path / "m.jsonl"
    args = ["train", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", "model.d_model=8192",
            "--set", "model.n_layers=64", "--set", "model.n_heads=64", "--set", f"metrics.path={metrics}"]
    proc = subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, timeout=360)
    assert_bad_input(proc, "checkpoint.memory_keep=3", "10 copies", "Ray node", "checkpoint.memory_every=0",
                     "resources.cpus_per_worker")
    assert not metrics.exists()
