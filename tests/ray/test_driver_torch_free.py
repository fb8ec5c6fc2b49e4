"""A whole run, with a rank killed in it, in a driver that may not import torch (issue 35).

The driver is a subprocess whose import system ends it (exit 3, the import's stack on stderr) the
moment anything imports torch: the actor classes it ships, an answer or an error a rank hands it
(``RankError``), a snapshot's or checkpoint's acknowledgement. It runs the CLI's job (checkpoints and
in-memory snapshots on) and then a run whose rank 1 is SIGKILLed at step 3 (the failure path: dead
calls, survivors' latched errors, the rebuild and its restore), at dp=2 without the pipeline: the CLI
run has it, and two actors fewer keep the test short."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]

DRIVER = r'''
import os, sys, traceback
from pathlib import Path


class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            sys.stderr.write("torch imported in the driver:\n" + "".join(traceback.format_stack()))
            sys.stderr.flush()
            os._exit(3)
        return None


sys.meta_path.insert(0, NoTorch())
import ray

ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
tmp = Path(sys.argv[1])
from orchestrator.cli import main

sets = ["mesh.dp=2", "mesh.pp=2", "mesh.tp=1", "train.steps=6", "checkpoint.every=3",
        f"checkpoint.dir={tmp / 'cli-ckpt'}", f"metrics.path={tmp / 'cli.jsonl'}"]
assert main(["train", "--no-progress", *[a for s in sets for a in ("--set", s)]]) == 0

from testbed.fault_runs import run_with_fault
from workers.store import StoreHost

host = StoreHost.remote()
store = ray.get(host.address.remote(), timeout=60)
# dp=2 alone (the CLI run above had the pipeline): two actors fewer to start, the same failure path.
_, summary, _ = run_with_fault(tmp, store, ["mesh.dp=2", "mesh.pp=1", "mesh.tp=1"], "kill", 1, 3)
assert summary.restarts >= 1, summary
print("DRIVER_MODULES", sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
'''


@pytest.mark.timeout(420)
def test_a_run_with_a_failure_never_imports_torch_in_the_driver(tmp_path):
    out = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path)], capture_output=True, text=True,
                         timeout=400, cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "DRIVER_MODULES []" in out.stdout, out.stdout[-2000:]
