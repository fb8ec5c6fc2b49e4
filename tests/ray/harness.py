"""Run the real Controller on a test's actor pool and compare with the single-process reference."""

from __future__ import annotations

import json
from functools import lru_cache

import numpy as np

from orchestrator.config import load_config
from orchestrator.controller import Controller
from orchestrator.metrics import MetricsLog


def make_controller(cfg, group, store_address, data_path: str = "builtin") -> Controller:
    from workers.data import open_source

    metrics = MetricsLog(cfg.metrics, progress_total=None, ray_metrics=False)
    return Controller(cfg, group, metrics=metrics, store_address=store_address, use_gpu=False,
                      data_path=open_source(data_path).name)


def mesh_params(controller: Controller) -> dict[str, np.ndarray]:
    """Unsharded parameters gathered from the controller's current generation."""
    gen = controller.generation
    outcome = controller.group.call(list(gen.members.values()), "full_state", timeout_s=120)
    assert outcome.ok, outcome
    params: dict[str, np.ndarray] = {}
    for part in outcome.results.values():
        params.update(part)
    return params


@lru_cache(maxsize=16)
def _reference(overrides: tuple[str, ...], steps: int):
    from workers.reference import ReferenceTrainer

    cfg = load_config(None, list(overrides))
    trainer = ReferenceTrainer(cfg.model, cfg.train)
    return trainer.run(1, steps), trainer.params()


def reference(overrides, steps: int):
    """(per-step losses, final params) of the single-process run; the mesh keys don't change it."""
    model_keys = tuple(o for o in overrides if not o.startswith(("mesh.", "elastic.", "checkpoint.", "metrics.", "pipeline.")))
    return _reference(model_keys, steps)


def assert_matches_reference(losses: dict[int, float], params, overrides, steps: int) -> None:
    ref_losses, ref_params = reference(overrides, steps)
    got = [losses[s] for s in range(1, steps + 1)]
    np.testing.assert_allclose(got, ref_losses, rtol=1e-5, atol=0)
    if params is not None:
        assert set(params) == set(ref_params)
        for name, value in ref_params.items():
            np.testing.assert_allclose(params[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


def last_losses(metrics_path) -> dict[int, float]:
    """Per-step loss from the JSONL file; re-run steps are logged again and the last record wins."""
    out: dict[int, float] = {}
    for line in open(metrics_path):
        rec = json.loads(line)
        if "step" in rec and "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def events(metrics_path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, open(metrics_path)) if r.get("event") == kind]
