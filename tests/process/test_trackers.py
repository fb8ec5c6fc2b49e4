"""Experiment trackers for real: the driver's MetricsLog feeds MLflow (a local file store, read back
with MLflow's own client) and W&B (offline mode, read back from its run directory); a resume
continues the same tracker run; a tracker that cannot be reached is one warning line and the run
goes on; a tracker key without its extra is one line, exit 2.

The records are a real run's (tests/data/chaos_quick_metrics.jsonl), replayed through ``MetricsLog``
exactly as the controller writes them: W&B runs its own service process, hence tests/process.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from meshspeak.sections import config_to_dict
from orchestrator.config.load import load_config
from orchestrator.metrics import MetricsLog
from orchestrator.tracking.sinks import IDS_FILE, flat_params, open_trackers

pytestmark = pytest.mark.timeout(300)
RECORDED = Path(__file__).resolve().parents[1] / "data" / "chaos_quick_metrics.jsonl"


def replay(cfg, records: list[dict]) -> None:
    """Write ``records`` through a MetricsLog with the job's trackers, as a run would."""
    log = MetricsLog(cfg.metrics, ray_metrics=False, trackers=open_trackers(cfg))
    for rec in records:
        if "event" in rec:
            if rec["event"] != "launch":
                log.event(rec["event"], **{k: v for k, v in rec.items() if k not in ("event", "time")})
        else:
            log.step(dict(rec))  # with its time: the order MLflow's history is read back in
    log.close()


def split_run(records: list[dict], at_step: int) -> tuple[list[dict], list[dict]]:
    """The records up to step ``at_step``'s first record, and the rest (a resumed second process)."""
    cut = next(i for i, r in enumerate(records) if r.get("step") == at_step and "event" not in r)
    return records[:cut], records[cut:]


def test_mlflow_file_store_and_resume(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    store = tmp_path / "mlruns"
    cfg = load_config(None, [f"metrics.mlflow_uri={store}", "metrics.mlflow_experiment=chaos",
                             f"metrics.path={tmp_path / 'm.jsonl'}", f"checkpoint.dir={tmp_path / 'ckpt'}"])
    records = [json.loads(line) for line in RECORDED.read_text().splitlines()]
    first, second = split_run(records, 40)
    replay(cfg, first)
    run_id = json.loads((tmp_path / "ckpt" / IDS_FILE).read_text())["mlflow"]
    replay(cfg, second)  # resumed from the same checkpoint.dir: the same MLflow run goes on
    assert json.loads((tmp_path / "ckpt" / IDS_FILE).read_text())["mlflow"] == run_id

    client = MlflowClient(tracking_uri=f"file://{store}")
    (exp,) = [e for e in client.search_experiments() if e.name == "chaos"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    assert run.data.params == {k: str(v) for k, v in flat_params(cfg).items()}
    steps = [r for r in records if "event" not in r]
    history = client.get_metric_history(run_id, "train/loss")
    # Every step record, re-runs included, in order: (step, loss) as the JSONL has them.
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: (m.timestamp, m.step))] == \
        [(r["step"], pytest.approx(r["loss"])) for r in steps]
    failures = [r for r in records if r.get("event") == "failure"]
    counts = client.get_metric_history(run_id, "events/failure")
    assert len(counts) == len(failures) > 0  # one point per failure event (counted per process)
    stalls = client.get_metric_history(run_id, "event/checkpoint/stall_s")
    expected = [r["stall_s"] for r in records if r.get("event") == "checkpoint"]
    assert sorted(m.value for m in stalls) == pytest.approx(sorted(expected))


def test_wandb_offline_run_directory_and_resume(tmp_path: Path) -> None:
    from testbed.wandb_log import run_contents

    cfg = load_config(None, ["metrics.wandb_project=chaos", "metrics.wandb_mode=offline",
                             f"metrics.path={tmp_path / 'run' / 'm.jsonl'}", f"checkpoint.dir={tmp_path / 'ckpt'}"])
    records = [json.loads(line) for line in RECORDED.read_text().splitlines()]
    first, second = split_run(records, 40)
    replay(cfg, first)
    replay(cfg, second)
    run_id = json.loads((tmp_path / "ckpt" / IDS_FILE).read_text())["wandb"]
    dirs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(dirs) == 2  # one per process; both the same run id, which `wandb sync` joins
    contents = [run_contents(d) for d in dirs]
    assert [c[0] for c in contents] == [run_id, run_id]
    config = contents[0][1]
    assert {k: config[k] for k in flat_params(cfg)} == flat_params(cfg)
    rows = [row for c in contents for row in c[2] if "train/loss" in row]
    steps = [r for r in records if "event" not in r]
    assert [(row["train/step"], row["train/loss"]) for row in rows] == \
        [(r["step"], pytest.approx(r["loss"])) for r in steps]
    evicts = [row for c in contents for row in c[2] if "events/evict" in row]
    assert len(evicts) == sum(r.get("event") == "evict" for r in records)


def test_unreachable_tracker_is_one_warning_and_the_run_goes_on(tmp_path: Path, caplog) -> None:
    # A closed port: MLflow's client is refused; the records still reach the JSONL.
    cfg = load_config(None, ["metrics.mlflow_uri=http://127.0.0.1:9", f"metrics.path={tmp_path / 'm.jsonl'}"])
    records = [json.loads(line) for line in RECORDED.read_text().splitlines()][:40]
    with caplog.at_level(logging.WARNING, logger="orchestrator.tracking.sinks"):
        replay(cfg, records)
    warned = [r for r in caplog.records if r.name == "orchestrator.tracking.sinks"]
    assert len(warned) == 1 and "metrics.mlflow_uri=http://127.0.0.1:9" in warned[0].getMessage()
    assert "training goes on" in warned[0].getMessage() and "\n" not in warned[0].getMessage()
    written = (tmp_path / "m.jsonl").read_text().splitlines()
    assert len(written) == len(records)  # launch + the 39 replayed


@pytest.mark.parametrize("key,extra", [("metrics.mlflow_uri=mlruns", "mlflow"), ("metrics.wandb_project=p", "wandb")])
def test_tracker_key_without_its_extra_is_exit_2(tmp_path: Path, key: str, extra: str) -> None:
    code = (f"import sys; sys.modules[{extra!r}] = None; from orchestrator.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "train", "--set", key, "--set",
                           f"metrics.path={tmp_path / 'm.jsonl'}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "elastimesh: error:" in line]
    assert len(lines) == 1 and f"elastimesh[{extra}]" in lines[0] and key.split("=")[0] in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "m.jsonl").exists()


def test_params_are_the_resolved_config() -> None:
    cfg = load_config(None, ["train.lr=0.01"])
    params = flat_params(cfg)
    assert params["train.lr"] == 0.01 and len(params) == sum(len(t) for t in config_to_dict(cfg).values())
