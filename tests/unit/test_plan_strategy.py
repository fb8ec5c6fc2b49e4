"""`elastimesh plan --memory-gib`: the cheapest data-parallel strategy that fits (pure, no process)."""

from __future__ import annotations

import dataclasses

from orchestrator.config.load import load_config
from orchestrator.plan.mesh_plan import make_plan, rank_memory
from orchestrator.plan.strategy import candidates, peak_bytes, recommend

BIG = ["mesh.dp=4", "mesh.tp=1", "model.d_model=512", "model.n_layers=8", "model.n_heads=8"]


def test_candidates_cheapest_first() -> None:
    assert candidates(4) == [(0, 1), (2, 2), (2, 1), (3, 2), (3, 1)]
    assert candidates(1) == [(0, 1)]


def test_memory_falls_with_sharding() -> None:
    cfg = load_config(None, BIG)

    def at(zero, r):
        return peak_bytes(dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, zero=zero, dp_replicate=r)))

    # ZeRO-0 holds whole optimizer state; HSDP groups of 2 hold half; plain FSDP over 4 a quarter.
    assert at(0, 1) > at(2, 2) > at(2, 1)
    assert at(3, 2) > at(3, 1)
    assert at(3, 1) < at(2, 1)
    # ZeRO-0's optimizer state is the full (per tp shard) model: 8 bytes per parameter
    mem = rank_memory(dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, zero=0)), make_plan(cfg), 0)
    assert mem["optimizer"] == 2 * mem["grads"]


def test_recommend_picks_the_first_that_fits() -> None:
    cfg = load_config(None, BIG)
    options = recommend(cfg, 2**40)["options"]
    by = {(o["zero"], o["dp_replicate"]): o["bytes"] for o in options}
    assert (recommend(cfg, 2**40)["zero"], recommend(cfg, 2**40)["dp_replicate"]) == (0, 1)
    just_hsdp2 = by[(2, 2)]
    rec = recommend(cfg, just_hsdp2)
    assert rec["fits"] and (rec["zero"], rec["dp_replicate"]) == (2, 2)
    rec = recommend(cfg, by[(3, 1)])
    assert rec["fits"] and (rec["zero"], rec["dp_replicate"]) == (3, 1)
    rec = recommend(cfg, 1)
    assert not rec["fits"] and (rec["zero"], rec["dp_replicate"]) == (3, 1)
