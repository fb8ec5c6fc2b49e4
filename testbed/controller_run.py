"""A controller on a fake worker group, for the controller's unit tests: ``Run`` (the controller, its
metrics file and checkpoint root in tmp, a settable clock) and the ``make`` fixture that builds them
and closes them after the test (``testbed/fake_group.py`` scripts the ranks and their faults).

``window`` is the number of steps in flight (orchestrator/control/window.py): 1 by default, so each
``advance()`` call makes one step's calls and a test can follow them call by call; the window's own
tests ask for more."""

from __future__ import annotations

import json

import pytest

from checkpoints.catalog import list_checkpoints
from orchestrator.config.load import load_config
from orchestrator.control.controller import Controller, State
from orchestrator.metrics import MetricsLog
from testbed.fake_group import FakeWorkerGroup


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Run:
    """A controller on a fake group, with its metrics file and checkpoint root in tmp."""

    def __init__(self, tmp_path, overrides, actors: int | None, capacity: int, window: int = 1) -> None:
        self.metrics_path = tmp_path / "m.jsonl"
        self.ckpt = tmp_path / "ckpt"
        self.cfg = load_config(None, [
            "mesh.dp=4", "mesh.tp=1", "mesh.pp=1", "train.steps=6", "checkpoint.every=2",
            # These tests are about storage checkpoints; in-memory snapshots: test_controller_snapshots.py.
            "checkpoint.memory_every=0",
            f"checkpoint.dir={self.ckpt}", f"metrics.path={self.metrics_path}", *overrides])
        self.group = FakeWorkerGroup(self.cfg.mesh.world if actors is None else actors, capacity=capacity)
        self.clock = Clock()
        self.metrics = MetricsLog(self.cfg.metrics, progress_total=None, ray_metrics=False)
        self.c = Controller(self.cfg, self.group, metrics=self.metrics, store_address=("127.0.0.1", 29500),
                            use_gpu=False, data_path="builtin", clock=self.clock, steps_in_flight=window)

    def steps(self, n: int, state: State = State.RUNNING) -> None:
        for _ in range(n):
            assert self.c.advance() == state, self.c.error

    def records(self) -> list[dict]:
        return [json.loads(line) for line in open(self.metrics_path)]

    def events(self, kind: str) -> list[dict]:
        return [r for r in self.records() if r.get("event") == kind]

    def committed(self) -> list[int]:
        return [i.step for i in list_checkpoints(str(self.ckpt)) if i.valid]

    def close(self) -> None:
        self.c.ckpt.close()
        self.metrics.close()


@pytest.fixture
def make(tmp_path):
    runs = []

    def make(*overrides, actors=None, capacity=0, window=1) -> Run:
        runs.append(Run(tmp_path, overrides, actors, capacity, window))
        return runs[-1]

    yield make
    for run in runs:
        run.close()
