"""The CLI and the benchmark scripts run as a user runs them: in a child interpreter.

* :func:`run_cli` / :func:`assert_bad_input`: ``python -m orchestrator ARGS`` and the bad-input
  contract (exit 2, one ``elastimesh: error:`` line naming the key or file and the fix, no traceback).
* :func:`run_bench_script`: ``python bench/NAME.py --quick --out OUT`` and the JSON it wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=100, cwd=cwd)


def assert_bad_input(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2 and exactly one error line, holding every one of ``needles``; no traceback."""
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "elastimesh: error:" in line]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def run_bench_script(name: str, out: Path, *args: str, timeout: float = 110) -> dict:
    """Run ``bench/NAME --quick --out OUT ARGS`` (one intra-op thread); it must exit 0 and write ``out``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / name), "--quick", "--out", str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    assert out.is_file(), f"{name} wrote nothing to {out}"
    return json.loads(out.read_text())
