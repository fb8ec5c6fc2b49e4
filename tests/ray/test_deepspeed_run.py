"""A run from a DeepSpeed config equals the same run from the TOML it maps to (the real CLI, twice).

The config is the CIFAR-10 tutorial's from DeepSpeed's documentation (verbatim in
testbed/deepspeed_configs.py; tests/unit/test_deepspeed_config.py checks its mapping key by key); the
TOML is written here by hand from README's mapping, not by the code under test. Both runs train 3
steps at dp=2 on an embedded local Ray; the DeepSpeed one also writes to an MLflow file store, read
back with MLflow's client (the tracker on a real run: the resolved config as params, every step).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.deepspeed_configs import CIFAR10

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]  # 2.5 min at load 50

TOML = """
[mesh]
dp = 2
tp = 1
[train]
steps = 3
global_batch_size = 4        # train_batch_size
micro_batch_size = 2         # train_batch_size // dp // gradient_accumulation_steps (1)
lr = 0.001                   # WarmupLR warmup_max_lr
beta1 = 0.8
beta2 = 0.999
weight_decay = 3e-7
warmup_steps = 1000          # warmup_num_steps
min_lr_ratio = 1.0           # WarmupLR: constant after warm-up
[metrics]
log_every = 2000             # steps_per_print
"""


def train(tmp_path: Path, name: str, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    metrics = tmp_path / f"{name}.jsonl"
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "train", *args, "--no-progress",
                           "--set", f"metrics.path={metrics}"], capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, [json.loads(line) for line in metrics.read_text().splitlines()]


def test_cifar10_deepspeed_run_equals_the_toml_run(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "ds.json").write_text(CIFAR10)
    (tmp_path / "job.toml").write_text(TOML)
    store = tmp_path / "mlruns"  # the DeepSpeed run also goes to MLflow: a tracker on a real run
    ds_proc, ds = train(tmp_path, "ds", "--deepspeed", str(tmp_path / "ds.json"), "--set", "mesh.tp=1",
                        "--set", "train.steps=3", "--set", f"metrics.mlflow_uri={store}")
    _, toml = train(tmp_path, "toml", str(tmp_path / "job.toml"))
    warnings = [line for line in ds_proc.stderr.splitlines() if line.startswith("elastimesh: warning:")]
    assert len(warnings) == 2 and "warmup_type" in warnings[0] and "wall_clock_breakdown" in warnings[1]

    def steps(records):
        return [(r["step"], r["loss"], r["lr"], r["tokens"], r["dp"]) for r in records if "event" not in r]

    assert len(steps(ds)) == 3
    assert steps(ds) == steps(toml)  # the same math, bit for bit

    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store (the run set it too)
    client = MlflowClient(tracking_uri=f"file://{store}")
    (exp,) = [e for e in client.search_experiments() if e.name == "elastimesh"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    params = run.data.params  # the resolved config, DeepSpeed's values in it
    assert (params["train.lr"], params["train.beta1"], params["train.global_batch_size"]) == ("0.001", "0.8", "4")
    history = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(s, pytest.approx(loss)) for s, loss, *_ in steps(ds)]
