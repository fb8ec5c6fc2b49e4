"""The data-parallel strategy decided once (meshspeak/dp_plan.py): the plan's decisions for each
setting, the plan shipped in every generation's RuntimeSpec, and no rank re-deriving any part of it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from meshspeak.dp_plan import DataParallelPlan, plan_data_parallel
from orchestrator.config.load import load_config
from orchestrator.control.generation import runtime_spec
from orchestrator.plan.mesh_plan import describe, make_plan

ROOT = Path(__file__).resolve().parents[2]


def _plan(zero=3, dp=2, pp=1, tp=1, dtype="float32", grad_reduce="float32", cpu_offload=False,
          compression="none", cfg_dp=None, cfg_replicate=1, optimizer="adamw") -> DataParallelPlan:
    return plan_data_parallel(zero=zero, dp=dp, pp=pp, tp=tp, dtype=dtype, grad_reduce=grad_reduce,
                              cpu_offload=cpu_offload, compression=compression, cfg_dp=cfg_dp or dp,
                              cfg_replicate=cfg_replicate, optimizer=optimizer)


@pytest.mark.parametrize("kwargs, wrapper, reshard, replicate, over", [
    ({"zero": 3}, "fsdp", True, 1, "dp"),
    ({"zero": 2}, "fsdp", False, 1, "dp"),
    ({"zero": 1}, "fsdp", False, 1, "dp"),  # ZeRO-1 runs as ZeRO-2 (workers/parallelize.py says why)
    ({"zero": 0}, "ddp", False, 2, "dp"),  # plain dp, fp32: torch's DDP
    ({"zero": 0, "tp": 2}, "fsdp", False, 2, "dp"),  # TP parameters: HSDP (replicate = dp, shard = 1)
    ({"zero": 0, "compression": "powersgd"}, "fsdp", False, 2, "shard"),  # PowerSGD reduces across
    ({"zero": 0, "dtype": "bfloat16"}, "fsdp", False, 2, "dp"),
    ({"zero": 3, "dp": 1}, "none", True, 1, "dp"),  # one fp32 rank: nothing to reduce
    ({"zero": 3, "dp": 1, "dtype": "bfloat16"}, "fsdp", True, 1, "dp"),  # mixed precision needs FSDP2
    ({"zero": 3, "dp": 1, "cpu_offload": True}, "fsdp", True, 1, "dp"),
    ({"zero": 3, "dp": 4, "cfg_replicate": 2}, "fsdp", True, 2, "dp"),  # HSDP
    ({"zero": 3, "dp": 2, "cfg_dp": 4, "cfg_replicate": 2}, "fsdp", True, 1, "dp"),  # shrunk to one group
    ({"zero": 3, "dp": 3, "cfg_dp": 4, "cfg_replicate": 2}, "fsdp", True, 1, "dp"),  # partial replica: plain
])
def test_one_decision_per_setting(kwargs, wrapper, reshard, replicate, over) -> None:
    plan = _plan(**kwargs)
    assert (plan.wrapper, plan.reshard_after_forward, plan.replicate, plan.fsdp_over) == (
        wrapper, reshard, replicate, over)


@pytest.mark.parametrize("kwargs, wrapper, over, reduction", [
    ({"zero": 0}, "ddp", "dp", "none"),
    ({"zero": 0, "compression": "powersgd"}, "fsdp", "shard", "powersgd"),
    ({"zero": 0, "compression": "int8"}, "ddp", "dp", "int8"),  # a DDP comm hook
    ({"zero": 0, "compression": "int4"}, "ddp", "dp", "int4"),
    ({"zero": 0, "compression": "int8", "tp": 2}, "fsdp", "shard", "int8"),  # FSDP2's all-reduce hook
    ({"zero": 0, "compression": "int4", "pp": 2}, "fsdp", "shard", "int4"),
    ({"zero": 0, "compression": "int8", "dtype": "bfloat16"}, "fsdp", "shard", "int8"),
    ({"zero": 3, "compression": "int8"}, "fsdp", "dp", "int8"),  # FSDP2's custom reduce-scatter over dp
    ({"zero": 2, "compression": "int4"}, "fsdp", "dp", "int4"),
    ({"zero": 1, "compression": "int8", "tp": 2}, "fsdp", "dp", "int8"),
    ({"zero": 0, "optimizer": "onebit_adam"}, "ddp", "dp", "onebit_adam"),  # warm-up all-reduce as a hook
    ({"zero": 0, "optimizer": "onebit_adam", "tp": 2}, "fsdp", "shard", "onebit_adam"),
    ({"zero": 0, "dp": 1, "compression": "int8"}, "none", "dp", "none"),  # one rank: nothing to reduce
    ({"zero": 3, "dp": 1, "compression": "int4", "dtype": "bfloat16"}, "fsdp", "dp", "none"),
    ({"zero": 0, "dp": 1, "optimizer": "onebit_adam"}, "none", "dp", "none"),
])
def test_the_plan_decides_the_reduction(kwargs, wrapper, over, reduction) -> None:
    """train.grad_compression and train.optimizer become one ``compression`` of the plan, with the
    wrapper and the mesh FSDP2 shards over that it needs (meshspeak/dp_plan.py's module docstring)."""
    plan = _plan(**kwargs)
    assert (plan.wrapper, plan.fsdp_over, plan.compression) == (wrapper, over, reduction)


def test_reduce_dtype_and_dp_bytes() -> None:
    assert _plan(dtype="float64").reduce_dtype == "float64"
    assert _plan(grad_reduce="bfloat16").reduce_dtype == "bfloat16"
    # every level with dp > 1 counts what a rank sends (the ZeRO-3 bytes are the quantized ones' baseline)
    assert _plan(zero=0).count_dp_bytes and _plan(zero=3).count_dp_bytes
    assert not _plan(zero=0, dp=1).count_dp_bytes and not _plan(zero=3, dp=1, dtype="bfloat16").count_dp_bytes


def test_the_reduction_ships_in_the_spec() -> None:
    cfg = load_config(None, ["mesh.dp=2", "mesh.tp=1", "mesh.zero=3", 'train.grad_compression="int4"'])
    assert runtime_spec(cfg, make_plan(cfg), data_path="builtin", use_gpu=False, mask_eos_id=None,
                        resuming=False).dp.compression == "int4"
    assert make_plan(cfg, 1).dp.compression == "none"  # an elastic shrink to one rank: nothing to reduce
    cfg = load_config(None, ["mesh.dp=2", "mesh.zero=0", 'train.optimizer="onebit_adam"',
                             "train.onebit_warmup_steps=5"])
    assert describe(cfg, make_plan(cfg))["data_parallel"]["compression"] == "onebit_adam"


def test_the_plan_ships_in_the_generation_spec_and_shows_in_plan() -> None:
    cfg = load_config(None, ["mesh.dp=4", "mesh.tp=1", "mesh.zero=3", "mesh.dp_replicate=2"])
    for dp, replicate in ((4, 2), (2, 1)):  # an elastic shrink re-plans the strategy with the mesh
        plan = make_plan(cfg, dp)
        spec = runtime_spec(cfg, plan, data_path="builtin", use_gpu=False, mask_eos_id=None, resuming=False)
        assert spec.dp is plan.dp and spec.dp.replicate == replicate
    assert describe(cfg, make_plan(cfg))["data_parallel"]["wrapper"] == "fsdp"


def test_no_rank_rederives_the_strategy() -> None:
    """workers/ applies the plan: it never calls the rules nor reads the mesh keys they come from."""
    rules = {"fsdp_applies", "ddp_applies", "replicate_degree", "plan_data_parallel"}
    found = []
    for path in (ROOT / "workers").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node, "id", None) or getattr(node, "attr", None)
            if name in rules or (isinstance(node, ast.Attribute) and node.attr in ("zero", "dp_replicate")
                                 and getattr(node.value, "attr", "") in ("spec", "mesh")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert found == []
