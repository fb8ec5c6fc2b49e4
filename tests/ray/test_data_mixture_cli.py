"""`elastimesh train` with a data.mix through the real CLI (a fresh interpreter, an embedded Ray): a
relative mix path is resolved on the driver, every step record carries the per-source counters, and
`elastimesh report` prints the data mixture table."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from testbed.command_line import run_cli

# ~85 s on 2 busy cores (an embedded Ray and its actor start in the child): slow. The same checks
# without processes: tests/unit/test_data_mixture.py (check_job_data, the counters, the report table).
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(400)]

STEPS, G, SEQ = 3, 8, 16


def test_train_with_a_mixture_then_report(tmp_path):
    rows = [list(range(i, i + 50)) for i in range(0, 200, 50)]  # 200 byte tokens: 12 samples of 16
    (tmp_path / "code").mkdir()
    pq.write_table(pa.table({"tokens": pa.array(rows, type=pa.list_(pa.int32()))}), tmp_path / "code" / "a.parquet")
    sets = ['data.mix=[{path = "builtin", weight = 3}, {path = "code", weight = 1}]', "mesh.dp=1", "mesh.tp=1",
            f"train.steps={STEPS}", f"train.global_batch_size={G}", f"model.seq_len={SEQ}", "metrics.path=m.jsonl"]
    # Not run_cli (100 s): an embedded Ray and an actor take longer than that on 2 busy cores.
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "train", *[a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in map(json.loads, open(tmp_path / "m.jsonl")) if "loss" in r and "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    samples = np.asarray([[s["samples"] for s in r["sources"]] for r in steps])
    np.testing.assert_array_equal(samples, [[6, 2], [12, 4], [18, 6]])  # 3 : 1 of 8 per step
    assert steps[-1]["sources"][1]["path"] == str(tmp_path / "code")  # resolved on the driver
    assert steps[-1]["sources"][1]["epoch"] == 0 and steps[-1]["sources"][1]["tokens"] == 6 * SEQ
    report = run_cli("report", "m.jsonl", "--out", "rep", cwd=tmp_path)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "data mixture" in report.stdout and "builtin" in report.stdout
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["sources"] == steps[-1]["sources"]
