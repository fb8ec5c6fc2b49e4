"""Apply tensor(+sequence) parallelism and ZeRO (FSDP2) to one pipeline stage, in a fixed order.

The plan and the blocks come from the model family (``workers/models/family.py``); this module names
no model's modules. Order (as TorchTitan's ``parallelize_llama``): TP/SP first (so parameters become DTensors on the tp
axis), activation checkpointing is already inside each block, then FSDP2 ``fully_shard`` per unit of
consecutive blocks (one block per unit for big blocks; small blocks grouped, ``orchestrator.mesh.fsdp_units``)
and on the stage root over the dp axis (giving 2-D (dp, tp) DTensors when both are > 1).

Sequence parallelism keeps the residual stream sharded on the sequence dim between blocks, so what a
pipeline stage sends to the next one is the *local* sequence shard of shape [b, seq/tp, d].
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from orchestrator.mesh import fsdp_units


def apply_tp(stage: nn.Module, tp_mesh: DeviceMesh, family) -> None:
    """The family's TP/SP plan (``family.tp_plan``: module path -> parallel style) on ``stage``."""
    plan = family.tp_plan(stage)
    if plan:
        parallelize_module(stage, tp_mesh, plan)


def _local_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters on this rank after TP (a DTensor counts its local shard)."""
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in module.parameters()
    )


def apply_fsdp(
    stage: nn.Module, dp_mesh: DeviceMesh, family, *, zero: int, param_dtype: torch.dtype, fsdp_unit_bytes: int = 0
) -> None:
    """ZeRO-3 (params resharded after forward) or ZeRO-2 (params kept gathered through the step).

    Blocks are sharded in units of at least ``fsdp_unit_bytes`` (``orchestrator.mesh.fsdp_units``);
    blocks left out of every unit are sharded with the root. Neither the parameter names nor their
    dim-0 sharding over dp depend on the unit size, so neither does what a checkpoint holds.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    reshard = zero == 3
    blocks = list(family.blocks(stage))
    for unit in fsdp_units([_local_bytes(b) for b in blocks], fsdp_unit_bytes):
        members = [blocks[i] for i in unit]
        # fully_shard on a list makes one parameter group (one collective) for all its modules.
        fully_shard(members if len(members) > 1 else members[0], mesh=dp_mesh, mp_policy=mp,
                    reshard_after_forward=reshard)
    # The root holds embedding/norm/head; it is used last in forward, so never reshard it there.
    fully_shard(stage, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)


def parallelize_stage(
    stage: nn.Module,
    family,
    *,
    dp_mesh: DeviceMesh,
    tp_mesh: DeviceMesh,
    zero: int,
    param_dtype: torch.dtype,
    shard_over_dp: bool,
    fsdp_unit_bytes: int = 0,
) -> nn.Module:
    """TP/SP when tp > 1, then FSDP2 when ``shard_over_dp`` (``orchestrator.mesh.fsdp_applies``)."""
    if tp_mesh.size() > 1:
        apply_tp(stage, tp_mesh, family)
    if shard_over_dp:
        apply_fsdp(stage, dp_mesh, family, zero=zero, param_dtype=param_dtype, fsdp_unit_bytes=fsdp_unit_bytes)
    return stage


def uses_fsdp(stage: nn.Module) -> bool:
    return hasattr(stage, "set_requires_gradient_sync")
