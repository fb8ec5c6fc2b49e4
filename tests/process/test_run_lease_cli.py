"""Two drivers on one checkpoint.dir through the real CLI (#36 item 6, checkpoints/lease.py).

A first `elastimesh train` holds the run lease while it trains and saves; a second one on the same
directory exits 2 with one line naming the holder (its host and pid), and the first one's checkpoints
are left byte for byte. The first driver is then SIGKILLed (its whole process group: the driver and
the local Ray it started); a third driver waits out the lease (checkpoint.lease_s), takes it over and
resumes from the newest committed checkpoint to the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoints.catalog import list_checkpoints
from testbed.command_line import assert_bad_input

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
JOB = ["--set", "mesh.dp=1", "--set", "mesh.tp=1", "--set", "checkpoint.every=2", "--set", "checkpoint.lease_s=6",
       "--set", "checkpoint.memory_every=0"]


def _train(ckpt: Path, metrics: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "orchestrator", "train", *JOB, "--set", f"train.steps={steps}",
            "--set", f"checkpoint.dir={ckpt}", "--set", f"metrics.path={metrics}"]


def _committed(ckpt: Path) -> dict[int, str]:
    """step -> a digest of every file of that committed checkpoint."""
    out = {}
    for info in list_checkpoints(str(ckpt)):
        if info.valid:
            files = sorted(p for p in Path(info.path).rglob("*") if p.is_file())
            out[info.step] = hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()
    return out


def test_a_second_driver_is_refused_and_a_dead_drivers_lease_is_taken_over(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = subprocess.Popen(_train(ckpt, tmp_path / "first.jsonl", 100_000), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    assert first.pid > 1
    try:
        deadline = time.monotonic() + 400
        while len(_committed(ckpt)) < 2:  # trains and saves: it holds the lease
            assert first.poll() is None and time.monotonic() < deadline, "the first driver never saved twice"
            time.sleep(1)
        second = subprocess.run(_train(ckpt, tmp_path / "second.jsonl", 10), capture_output=True, text=True,
                                timeout=300)
        assert_bad_input(second, "in use by another driver", f":{first.pid}:")
        os.killpg(first.pid, signal.SIGKILL)  # the first driver and the local Ray it started: our group
        first.wait(timeout=60)
        before = _committed(ckpt)
        newest = max(before)
        third = subprocess.run(_train(ckpt, tmp_path / "third.jsonl", newest + 4), capture_output=True,
                               text=True, timeout=600)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert third.returncode == 0, third.stderr[-3000:]
    starts = [r for r in map(json.loads, open(tmp_path / "third.jsonl")) if r.get("event") == "start"]
    assert starts[-1]["resumed_from_step"] == newest
    after = _committed(ckpt)
    assert all(after.get(step, digest) == digest for step, digest in before.items())  # none rewritten
    assert max(after) == newest + 4 and not (ckpt / "LEASE.json").exists()  # released at the end
