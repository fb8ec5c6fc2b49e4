"""The mesh plan is pure data: rank <-> coords, group members, stage split, policies (no processes)."""

from __future__ import annotations

import pytest

from meshspeak.mesh import MeshAxis, MeshShape, balanced_split, fsdp_units, layer_ranges, stage_param_counts
from meshspeak.dp_plan import fsdp_applies
from orchestrator.config.load import load_config
from orchestrator.control.scaling import ResizeDecision, TooFewWorkers, policy_for
from orchestrator.plan.mesh_plan import describe, make_plan, param_counts


@pytest.mark.parametrize("dp,pp,tp", [(1, 1, 1), (2, 1, 2), (2, 2, 2), (3, 2, 1), (1, 4, 2)])
def test_coords_round_trip_and_tp_innermost(dp, pp, tp):
    shape = MeshShape(dp, pp, tp)
    seen = set()
    for rank in range(shape.world):
        c = shape.coords(rank)
        assert shape.rank_of(c.dp, c.pp, c.tp) == rank
        seen.add((c.dp, c.pp, c.tp))
    assert len(seen) == shape.world
    # TP innermost: each TP group is a run of adjacent ranks (one node under PACK placement).
    for members in shape.group_ranks(MeshAxis.TP):
        assert members == list(range(members[0], members[0] + tp))


def test_group_members_match_device_mesh_layout():
    shape = MeshShape(2, 2, 2)
    assert shape.group_ranks(MeshAxis.TP) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.group_ranks(MeshAxis.PP) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.group_ranks(MeshAxis.DP) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.replica_ranks(1) == [4, 5, 6, 7]


def test_bad_shapes_and_ranks():
    with pytest.raises(ValueError, match="mesh.dp"):
        MeshShape(0, 1, 1)
    with pytest.raises(ValueError):
        MeshShape(2, 1, 1).coords(2)


def test_balanced_split_is_optimal_and_covers_all_layers():
    costs = stage_param_counts(8, 100, 400, 400)  # heavy embedding/head on the ends
    split = balanced_split(costs, 4)
    assert sum(split) == 8 and all(n >= 1 for n in split)
    ranges = layer_ranges(split)
    loads = [sum(costs[a:b]) for a, b in ranges]
    assert max(loads) == 500  # embedding+layer0 alone; nothing better exists
    assert balanced_split([1] * 4, 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError):
        balanced_split([1, 1], 3)


def test_fsdp_applies_unless_one_fp32_replica():
    assert not fsdp_applies(1, "float32")
    assert fsdp_applies(2, "float32") and fsdp_applies(1, "bfloat16") and fsdp_applies(4, "bfloat16")
    assert fsdp_applies(1, "float16") and fsdp_applies(1, "float32", cpu_offload=True)


def test_fsdp_units_group_small_blocks_and_keep_big_ones_apart():
    mb = 1 << 20
    # 0 MB: one unit per block, whatever the sizes.
    assert fsdp_units([mb] * 3, 0) == [[0], [1], [2]]
    # Blocks at or above the size stay alone.
    assert fsdp_units([30 * mb] * 3, 25 * mb) == [[0], [1], [2]]
    # Small blocks accumulate until a unit reaches the size; the short tail joins the last unit.
    assert fsdp_units([10 * mb] * 7, 25 * mb) == [[0, 1, 2], [3, 4, 5, 6]]
    assert fsdp_units([10 * mb] * 6, 25 * mb) == [[0, 1, 2], [3, 4, 5]]
    # All blocks together below the size: no unit of their own (they stay in the root unit).
    assert fsdp_units([mb] * 4, 25 * mb) == []
    assert fsdp_units([], 25 * mb) == []
    # Every block lands in exactly one unit, in order.
    sizes = [3, 9, 1, 1, 12, 2, 2, 2, 8]
    units = fsdp_units([s * mb for s in sizes], 10 * mb)
    assert [i for unit in units for i in unit] == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in unit) >= 10 for unit in units)
    with pytest.raises(ValueError):
        fsdp_units([mb], -1)


def test_param_counts_match_the_built_model():
    torch = pytest.importorskip("torch")
    from meshmodels.gpt_model import GPT

    cfg = load_config(None, ["model.n_layers=3", "model.d_model=32"])
    model = GPT(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == param_counts(cfg.model)["total"]
    del torch


def test_plan_uses_layer_override_and_reports_memory():
    cfg = load_config(None, ["mesh.pp=2", "mesh.dp=1", "pipeline.layers=[1,3]"])
    plan = make_plan(cfg)
    assert plan.layers_per_stage == (1, 3)
    info = describe(cfg, plan)
    assert [s["layers"] for s in info["stages"]] == [[0, 0], [1, 3]]
    assert info["memory_per_rank"][0]["peak_microbatches_in_flight"] == 2  # 1F1B stage 0 at pp=2


def test_zero3_memory_estimate_shrinks_with_dp():
    small = describe(*_plan(["mesh.dp=1", "mesh.tp=1"]))["memory_per_rank"][0]
    big = describe(*_plan(["mesh.dp=4", "mesh.tp=1"]))["memory_per_rank"][0]
    assert big["optimizer"] * 4 <= small["optimizer"] + 8 * 4


def test_zero3_estimate_counts_the_gathered_fsdp_units():
    base = ["mesh.dp=2", "mesh.tp=1", "model.n_layers=4"]
    counts = param_counts(load_config(None, base).model)
    sharded = counts["total"] // 2 * 4

    def params_bytes(unit_mb):
        return describe(*_plan([*base, f"mesh.fsdp_unit_mb={unit_mb}"]))["memory_per_rank"][0]["params"]

    # One unit per block: the root (embedding + head) and one block gathered at a time.
    assert params_bytes(0) == sharded + (counts["embed"] + counts["head"] + counts["layer"]) * 4
    # Tiny blocks under the default 25 MB all stay in the root: the whole stage is gathered.
    assert params_bytes(25) == sharded + counts["total"] * 4


def test_plan_shows_the_fsdp_units_the_actors_build():
    base = ["mesh.dp=2", "mesh.pp=2", "mesh.tp=1", "model.n_layers=4"]
    stages = describe(*_plan([*base, "mesh.fsdp_unit_mb=0"]))["stages"]
    assert [s["fsdp_units"] for s in stages] == [[[0], [1]], [[2], [3]]]
    assert [s["fsdp_units"] for s in describe(*_plan(base))["stages"]] == [[], []]  # all in the roots
    one_block = param_counts(load_config(None, base).model)["layer"] * 4 / 2**20
    paired = describe(*_plan([*base, "mesh.pp=1", f"mesh.fsdp_unit_mb={2 * one_block}"]))["stages"]
    assert paired[0]["fsdp_units"] == [[0, 1], [2, 3]]
    # No FSDP at all (dp=1, fp32): nothing to show.
    assert describe(*_plan(["mesh.dp=1", "mesh.tp=1"]))["stages"][0]["fsdp_units"] is None


def _plan(overrides):
    cfg = load_config(None, overrides)
    return cfg, make_plan(cfg)


def test_elastic_policy_keeps_whole_replicas_and_batch_divisibility():
    cfg = load_config(None, ["mesh.dp=4", "mesh.tp=1", "train.global_batch_size=8", "train.micro_batch_size=2"])
    policy = policy_for(cfg)
    assert policy.choose(4, "x") == ResizeDecision(dp=4, reason="x")
    assert policy.choose(3, "x") == ResizeDecision(dp=2, reason="x")  # 3 does not divide 8/2
    cfg2 = load_config(None, ["mesh.dp=2", "mesh.tp=2", "elastic.min_dp=2"])
    decision = policy_for(cfg2).choose(3, "x")
    assert isinstance(decision, TooFewWorkers) and "elastic.min_dp=2" in decision.message
    assert policy.grow_target(2, 4) == 4 and policy.grow_target(4, 8) is None  # capped by max_dp = dp
