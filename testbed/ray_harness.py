"""Run the real Controller on a test's actor pool and read what it did: the gathered parameters, the
per-step losses and the events of its metrics file (compared with ``testbed.reference``)."""

from __future__ import annotations

import json

import numpy as np

from meshspeak.rank_calls import RankCalls
from orchestrator.control.controller import Controller
from orchestrator.metrics import MetricsLog


def make_controller(cfg, group, store_address, data_path: str = "builtin") -> Controller:
    """``cfg.data.mix`` / ``cfg.eval.mix`` (absolute paths) go to the ranks as launch would send them."""
    from meshdata import open_mixture, open_source
    from meshdata.masks import boundary_eos
    from meshdata.mixture import source_counters

    metrics = MetricsLog(cfg.metrics, progress_total=None, ray_metrics=False)
    if cfg.data.mix:
        mixture = open_mixture(cfg.data.mix, cfg.model.seq_len)
        metrics.data_counters = lambda step: source_counters(mixture, step, cfg.train.global_batch_size)
    eval_path = cfg.eval.mix or (open_source(cfg.eval.path).name if cfg.eval.path else "")
    eval_eos = boundary_eos(cfg.data.mask_document_boundaries, open_mixture(eval_path, 1)) if eval_path else None
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


def step_records(metrics_path) -> dict[int, dict]:
    """Per-step record from the JSONL file; re-run steps are logged again and the last record wins."""
    out: dict[int, dict] = {}
    for line in open(metrics_path):
        rec = json.loads(line)
        if "step" in rec and "loss" in rec and "event" not in rec:  # not an "eval" event
            out[rec["step"]] = rec
    return out


def last_losses(metrics_path) -> dict[int, float]:
    """Per-step loss from the JSONL file (the last record of a re-run step)."""
    return {step: rec["loss"] for step, rec in step_records(metrics_path).items()}


def events(metrics_path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, open(metrics_path)) if r.get("event") == kind]
