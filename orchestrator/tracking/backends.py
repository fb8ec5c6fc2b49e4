"""The trackers' clients behind one interface: ``start(params, run_id) -> run_id``, ``log(kind, rec)``,
``finish(status)``; ``orchestrator.tracking.sinks.TrackerSink`` calls them from its own thread.

What goes where (both trackers alike): the resolved config as params; a step record's numbers as
``train/<field>`` at its step; an event as ``event/<kind>/<field>`` for its numbers (at its ``step``
when it has one, else at the newest step) plus ``events/<kind>``, its running count. Re-run steps
after a recovery are logged again at the same step, as in the JSONL.
"""

from __future__ import annotations

import os
from typing import Any

STEP_FIELDS = ("loss", "lr", "tokens", "step_time_s", "tokens_per_s", "dp", "pp", "tp", "generation", "bubble",
               "loss_scale", "dp_bytes")


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    return float(value) if isinstance(value, (int, float)) else None


class Rows:
    """Turns JSONL records into (key, value, step, time) rows; counts events; tracks the newest step."""

    def __init__(self) -> None:
        self.step = 0
        self.counts: dict[str, int] = {}

    def rows(self, kind: str, rec: dict) -> list[tuple[str, float, int, float]]:
        when = float(rec.get("time", 0.0))
        if kind == "step":
            self.step = int(rec["step"])
            return [(f"train/{k}", v, self.step, when) for k in STEP_FIELDS
                    if (v := _number(rec.get(k))) is not None]
        name = rec.get("event", "event")
        step = rec.get("step") if isinstance(rec.get("step"), int) else self.step
        self.counts[name] = self.counts.get(name, 0) + 1
        out = [(f"events/{name}", float(self.counts[name]), step, when)]
        for k, v in rec.items():
            if k not in ("event", "time", "step") and (n := _number(v)) is not None:
                out.append((f"event/{name}/{k}", n, step, when))
        return out


class MlflowBackend:
    """An MLflow run through ``MlflowClient`` (``metrics.mlflow_uri``, ``metrics.mlflow_experiment``)."""

    def __init__(self, metrics_cfg) -> None:
        self.where = metrics_cfg.mlflow_uri
        self.experiment = metrics_cfg.mlflow_experiment
        self.rows = Rows()
        self.client = None
        self.run_id = ""

    def start(self, params: dict[str, Any], run_id: str | None) -> str:
        uri = self.where
        if "://" not in uri or uri.startswith("file://"):
            # A directory store: MLflow 3 keeps it in maintenance mode and refuses it unless this is
            # set; a user who gives a directory asks for exactly that store.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            if "://" not in uri:
                uri = "file://" + os.path.abspath(uri)
        # Bound the client's retries: an unreachable server is one warning, not minutes of backoff.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=uri)
        known: dict[str, str] = {}
        if run_id:  # a resume: the same run, RUNNING again; only params it lacks are added
            run = self.client.get_run(run_id)
            known = dict(run.data.params)
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
        else:
            found = self.client.get_experiment_by_name(self.experiment)
            exp_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
            self.run_id = self.client.create_run(exp_id).info.run_id
        fresh = [Param(k, str(v)) for k, v in params.items() if k not in known]
        for i in range(0, len(fresh), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=fresh[i:i + 100])
        return self.run_id

    def log(self, kind: str, rec: dict) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(k, v, int(t * 1000), s) for k, v, s, t in self.rows.rows(kind, rec)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


class WandbBackend:
    """A W&B run (``metrics.wandb_project``, ``metrics.wandb_mode``); its files go under ``wandb/``
    beside ``metrics.path``. Every row carries ``train/step``, the x-axis of every metric, so re-run
    steps are kept (W&B drops rows whose own step goes backwards)."""

    def __init__(self, metrics_cfg) -> None:
        self.where = metrics_cfg.wandb_project
        self.mode = metrics_cfg.wandb_mode
        self.dir = os.path.dirname(os.path.abspath(metrics_cfg.path or "metrics.jsonl"))
        self.rows = Rows()
        self.run = None

    def start(self, params: dict[str, Any], run_id: str | None) -> str:
        import wandb

        os.makedirs(self.dir, exist_ok=True)
        self.run = wandb.init(project=self.where, id=run_id, resume="allow",  # id None: W&B makes one
                              mode=self.mode, dir=self.dir, config=params, allow_val_change=True,
                              settings=wandb.Settings(silent=True, console="off", init_timeout=60))
        self.run.define_metric("train/step")
        for prefix in ("train/*", "event/*", "events/*"):
            self.run.define_metric(prefix, step_metric="train/step")
        return self.run.id

    def log(self, kind: str, rec: dict) -> None:
        rows = self.rows.rows(kind, rec)
        if rows:
            self.run.log({"train/step": rows[0][2], **{k: v for k, v, _, _ in rows}})

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
