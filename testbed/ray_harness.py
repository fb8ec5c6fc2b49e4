"""Run the real Controller on a test's actor pool and compare with the single-process reference."""

from __future__ import annotations

import json
from functools import lru_cache

import numpy as np

from meshspeak.rank_calls import RankCalls
from orchestrator.config.load import load_config
from orchestrator.control.controller import Controller
from orchestrator.metrics import MetricsLog


def make_controller(cfg, group, store_address, data_path: str = "builtin") -> Controller:
    from meshdata import open_source
    from meshdata.masks import boundary_eos

    metrics = MetricsLog(cfg.metrics, progress_total=None, ray_metrics=False)
    eval_path = open_source(cfg.eval.path).name if cfg.eval.path else ""
    eval_eos = boundary_eos(cfg.data.mask_document_boundaries, open_source(eval_path)) if eval_path else None
    return Controller(cfg, group, metrics=metrics, store_address=store_address, use_gpu=False,
                      data_path=open_source(data_path).name, eval_path=eval_path, eval_mask_eos_id=eval_eos)


def mesh_params(controller: Controller) -> dict[str, np.ndarray]:
    """Unsharded parameters gathered from the controller's current generation."""
    gen = controller.generation
    outcome = controller.group.call(list(gen.members.values()), RankCalls.full_state, timeout_s=120)
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


# Every element within 1e-5 (absolute + relative), as the acceptance asks. The Ray tests train at
# lr 1e-3 (TEST_LR), not the default 3e-3, for margin: AdamW turns summation-order noise in a
# near-zero gradient into a full step of ~lr for that element, so the fp32 reference itself ends
# 8e-6 away from an fp64 run of the same 10 steps at lr 3e-3, and 2.7e-6 at lr 1e-3 (measured on
# this stack). TP and DP change the summation order, so at 3e-3 a correct mesh lands ~1.2e-5 away on
# a few elements of 16k. A misplaced or stale shard is off by ~1e-2 on most elements.
TEST_LR = "train.lr=1e-3"
PARAM_TOL = 1e-5


def assert_params_match(params: dict[str, np.ndarray], ref_params: dict[str, np.ndarray]) -> None:
    assert set(params) == set(ref_params)
    for name, want in ref_params.items():
        got = params[name]
        assert got.shape == want.shape, f"{name}: shape {got.shape} != reference {want.shape}"
        excess = np.abs(got - want) - PARAM_TOL * (1 + np.abs(want))
        rel_l2 = float(np.linalg.norm(got - want) / max(float(np.linalg.norm(want)), 1e-30))
        assert excess.max() <= 0, (
            f"{name}: {int((excess > 0).sum())}/{want.size} elements off by more than {PARAM_TOL} "
            f"(largest {float(np.abs(got - want).max()):.3g}; relative L2 of the tensor {rel_l2:.3g})"
        )


def assert_matches_reference(losses: dict[int, float], params, overrides, steps: int) -> None:
    ref_losses, ref_params = reference(overrides, steps)
    got = [losses[s] for s in range(1, steps + 1)]
    np.testing.assert_allclose(got, ref_losses, rtol=1e-5, atol=0)
    if params is not None:
        assert_params_match(params, ref_params)


def last_losses(metrics_path) -> dict[int, float]:
    """Per-step loss from the JSONL file; re-run steps are logged again and the last record wins."""
    out: dict[int, float] = {}
    for line in open(metrics_path):
        rec = json.loads(line)
        if "step" in rec and "loss" in rec and "event" not in rec:  # not an "eval" event
            out[rec["step"]] = rec["loss"]
    return out


def events(metrics_path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, open(metrics_path)) if r.get("event") == kind]
