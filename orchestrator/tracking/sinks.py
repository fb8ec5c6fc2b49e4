"""Tracker sinks: one background writer per tracker the job asks for, fed by ``MetricsLog``.

Only the driver writes (``orchestrator.metrics.MetricsLog`` is the one place records go). Each
tracker gets its own daemon thread and queue: a tracker that is slow or cannot be reached never
holds a training step up, and its first error is one warning line after which that tracker is
off for the run; the run itself never fails because of a tracker.

Resume: the tracker's run id is stored in ``checkpoint.dir`` (``trackers.json``, next to the step
directories, read through the checkpoint storage so ``s3://`` works too). A run that resumes from
that directory continues the same MLflow run / W&B run id; without ``checkpoint.dir`` (nothing to
resume from) or with ``checkpoint.resume = false`` every run starts a new tracker run.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from typing import Any

from meshspeak.sections import JobConfig, config_to_dict
from orchestrator.errors import UserInputError

logger = logging.getLogger(__name__)

IDS_FILE = "trackers.json"
CLOSE_WAIT_S = 60.0  # at the end of a run: how long queued records may still take to go out
EXTRAS = {"mlflow": ("mlflow", "metrics.mlflow_uri"), "wandb": ("wandb", "metrics.wandb_project")}


def wanted(metrics_cfg) -> list[str]:
    """The trackers the [metrics] section turns on, in a fixed order."""
    return [name for name, on in (("mlflow", metrics_cfg.mlflow_uri), ("wandb", metrics_cfg.wandb_project)) if on]


def check_trackers(metrics_cfg) -> None:
    """Each tracker asked for has its package (bad input otherwise: one line, exit 2), before Ray starts."""
    import importlib.util

    for name in wanted(metrics_cfg):
        module, key = EXTRAS[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UserInputError(f"{key} needs the {module} package: pip install 'elastimesh[{name}]', "
                                 f"or unset {key}")


def flat_params(cfg: JobConfig) -> dict[str, Any]:
    """The resolved config as tracker params: {"section.key": value}."""
    return {f"{section}.{k}": v for section, table in config_to_dict(cfg).items() for k, v in table.items()}


class RunIds:
    """The tracker run ids of this run, kept in ``checkpoint.dir`` for a resume to continue them."""

    def __init__(self, cfg: JobConfig) -> None:
        self.root = cfg.checkpoint.dir
        self.ids: dict[str, str] = {}
        self._lock = threading.Lock()
        if self.root and cfg.checkpoint.resume:
            try:
                storage, path = self._where()
                if storage.exists(path):
                    self.ids = dict(json.loads(storage.read_text(path)))
            except Exception as exc:  # unreadable: start new tracker runs, say so once
                logger.warning("%s: cannot read the tracker run ids (%s): new tracker runs", IDS_FILE, exc)

    def _where(self):
        from checkpoints.storage import storage_for

        storage = storage_for(self.root)
        return storage, storage.join(self.root, IDS_FILE)

    def get(self, name: str) -> str | None:
        return self.ids.get(name)

    def put(self, name: str, run_id: str) -> None:
        with self._lock:
            self.ids[name] = run_id
            if not self.root:
                return
            storage, path = self._where()
            storage.makedirs(self.root)
            storage.write_text_atomic(path, json.dumps(self.ids, indent=1))


class TrackerSink:
    """Feeds one tracker backend from a queue on a daemon thread (see the module docstring).

    ``backend`` has ``start(params, run_id) -> run_id``, ``log(rows)``, ``finish(status)``; it is
    started on the thread too, so an unreachable server delays nothing but its own records.
    """

    def __init__(self, name: str, backend, setting: str, params: dict[str, Any], ids: RunIds) -> None:
        self.name, self.backend, self.setting = name, backend, setting
        self._queue: queue.Queue = queue.Queue()
        self._failed = False
        self._thread = threading.Thread(target=self._work, args=(params, ids), name=f"tracker-{name}", daemon=True)
        self._thread.start()

    def step(self, rec: dict) -> None:
        self._put(("step", dict(rec)))

    def event(self, rec: dict) -> None:
        self._put(("event", dict(rec)))

    def close(self, status: str = "FINISHED") -> None:
        self._put(("close", status))
        self._thread.join(CLOSE_WAIT_S)

    def _put(self, item) -> None:
        if not self._failed:
            self._queue.put(item)

    def _work(self, params: dict[str, Any], ids: RunIds) -> None:
        try:
            run_id = self.backend.start(params, ids.get(self.name))
            ids.put(self.name, run_id)
            while True:
                kind, payload = self._queue.get()
                if kind == "close":
                    self.backend.finish(payload)
                    return
                self.backend.log(kind, payload)
        except Exception as exc:  # the run goes on without this tracker: one line, no traceback
            self._failed = True
            why = " ".join(str(exc).split())[:200] or type(exc).__name__
            logger.warning("%s=%s: %s tracking is off for this run (%s: %s); training goes on", self.setting,
                           getattr(self.backend, "where", ""), self.name, type(exc).__name__, why)


def open_trackers(cfg: JobConfig) -> list[TrackerSink]:
    """A started sink per tracker the job asks for (their extras were checked: ``check_trackers``)."""
    names = wanted(cfg.metrics)
    if not names:
        return []
    from orchestrator.tracking.backends import MlflowBackend, WandbBackend

    ids, params = RunIds(cfg), flat_params(cfg)
    sinks = []
    for name in names:
        backend = MlflowBackend(cfg.metrics) if name == "mlflow" else WandbBackend(cfg.metrics)
        sinks.append(TrackerSink(name, backend, EXTRAS[name][1], params, ids))
    return sinks
