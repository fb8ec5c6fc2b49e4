"""`elastimesh report` through the real CLI: the figures are valid PNGs of the expected size, the
HTML page holds them, report.json and the printed table carry the accounting's figures; it reads a
run still going, an ``s3://`` copy (moto's S3 API on localhost), and bad input is one line, exit 2.

The metrics are those of a real run with faults (``tests/data/chaos_quick_metrics.jsonl``, see
tests/unit/test_report_goodput.py, which checks the figures themselves).
"""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.report.goodput import BUCKETS, account
from orchestrator.report.page import table_rows
from orchestrator.report.plots import FIGURES, SIZE_PX

pytestmark = pytest.mark.timeout(240)
RECORDED = Path(__file__).resolve().parents[1] / "data" / "chaos_quick_metrics.jsonl"


def run_report(*args: str, env=None, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"{prelude}import sys; from orchestrator.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "report", *args], capture_output=True, text=True,
                          timeout=200, env=env)


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def assert_bad_input(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("elastimesh: error:"), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_report_writes_figures_page_and_figures_of_the_accounting(tmp_path: Path) -> None:
    out = tmp_path / "rep"
    proc = run_report(str(RECORDED), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    for name in FIGURES:
        data = (out / f"{name}.png").read_bytes()
        assert png_size(data) == SIZE_PX, name
        assert len(data) > 10_000, name  # drawn, not blank
    page = (out / "report.html").read_text()
    for name in FIGURES:  # self-contained: every figure embedded, byte for byte
        encoded = base64.b64encode((out / f"{name}.png").read_bytes()).decode("ascii")
        assert f"data:image/png;base64,{encoded}" in page
    assert "src=\"http" not in page and "<script" not in page

    records = [json.loads(line) for line in RECORDED.read_text().splitlines()]
    ledger = account(records)
    doc = json.loads((out / "report.json").read_text())
    assert doc["wall_s"] == pytest.approx(records[-1]["time"] - records[0]["time"])
    assert sum(doc["seconds"][b] for b in BUCKETS) == pytest.approx(doc["wall_s"], rel=0.01)
    assert doc["seconds"] == pytest.approx(ledger.seconds)
    assert doc["steps"]["rerun"] == ledger.steps_rerun and doc["restarts"] == ledger.restarts
    for what, seconds, share in table_rows(ledger):  # the printed table says the same
        assert seconds in proc.stdout and share in proc.stdout, what
    assert "report.html" in proc.stdout


def test_report_of_a_run_still_going(tmp_path: Path) -> None:
    lines = RECORDED.read_text().splitlines(keepends=True)
    cut = len(lines) // 2
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(lines[:cut]) + lines[cut][:17])  # the last line half written
    proc = run_report(str(path), "--out", str(tmp_path / "rep"))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    ledger = account([json.loads(line) for line in lines[:cut]])
    assert doc["seconds"] == pytest.approx(ledger.seconds) and doc["finished"] is False


def test_report_reads_s3(tmp_path: Path) -> None:
    from testbed.s3 import MotoS3

    moto = MotoS3()
    try:
        fs = moto.filesystem()
        fs.mkdir("runs")
        fs.put(str(RECORDED), "runs/run1/metrics.jsonl")
        env = {**os.environ, "AWS_ENDPOINT_URL": moto.url, "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
        proc = run_report("s3://runs/run1/metrics.jsonl", "--out", str(tmp_path / "rep"), env=env)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads((tmp_path / "rep" / "report.json").read_text())
        assert doc["metrics"] == "s3://runs/run1/metrics.jsonl"
        assert doc["seconds"] == pytest.approx(account(
            [json.loads(line) for line in RECORDED.read_text().splitlines()]).seconds)
        missing = run_report("s3://runs/run2/metrics.jsonl", "--out", str(tmp_path / "rep2"), env=env)
        assert_bad_input(missing, "s3://runs/run2/metrics.jsonl", "no such metrics file")
    finally:
        moto.close()


def test_report_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    assert_bad_input(run_report(str(tmp_path / "nope.jsonl")), "nope.jsonl", "no such metrics file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("this is not json\n")
    assert_bad_input(run_report(str(bad), "--out", str(tmp_path / "r")), "line 1 is not JSON")
    # matplotlib not installed: the report says which extra to install, and writes nothing.
    proc = run_report(str(RECORDED), "--out", str(tmp_path / "none"), prelude="import sys; sys.modules['matplotlib'] = None; ")
    assert_bad_input(proc, "matplotlib", "elastimesh[report]")
    assert not (tmp_path / "none").exists()
