"""Apply tensor(+sequence) parallelism and ZeRO (FSDP2) to one pipeline stage, in a fixed order.

Order (as TorchTitan's ``parallelize_llama``): TP/SP first (so parameters become DTensors on the tp
axis), activation checkpointing is already inside each Block, then FSDP2 ``fully_shard`` per unit of
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
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from orchestrator.mesh import fsdp_units
from workers.model import GPT


def apply_tp(stage: GPT, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP with sequence parallelism on norms (docs/design.md, F8)."""
    plan: dict[str, object] = {}
    if stage.tok_embeddings is not None:
        # Vocab-sharded embedding; its partial sums are reduce-scattered straight into sequence shards.
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if stage.output is not None:
        plan["norm"] = SequenceParallel()
        # Full logits on every tp rank: the loss is then the plain single-process loss.
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if plan:
        parallelize_module(stage, tp_mesh, plan)
    for block in stage.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )


def _local_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters on this rank after TP (a DTensor counts its local shard)."""
    return sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in module.parameters()
    )


def apply_fsdp(
    stage: GPT, dp_mesh: DeviceMesh, *, zero: int, param_dtype: torch.dtype, fsdp_unit_bytes: int = 0
) -> None:
    """ZeRO-3 (params resharded after forward) or ZeRO-2 (params kept gathered through the step).

    Blocks are sharded in units of at least ``fsdp_unit_bytes`` (``orchestrator.mesh.fsdp_units``);
    blocks left out of every unit are sharded with the root. Neither the parameter names nor their
    dim-0 sharding over dp depend on the unit size, so neither does what a checkpoint holds.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    reshard = zero == 3
    blocks = list(stage.layers.values())
    for unit in fsdp_units([_local_bytes(b) for b in blocks], fsdp_unit_bytes):
        members = [blocks[i] for i in unit]
        # fully_shard on a list makes one parameter group (one collective) for all its modules.
        fully_shard(members if len(members) > 1 else members[0], mesh=dp_mesh, mp_policy=mp,
                    reshard_after_forward=reshard)
    # The root holds embedding/norm/head; it is used last in forward, so never reshard it there.
    fully_shard(stage, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)


def parallelize_stage(
    stage: GPT,
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
        apply_tp(stage, tp_mesh)
    if shard_over_dp:
        apply_fsdp(stage, dp_mesh, zero=zero, param_dtype=param_dtype, fsdp_unit_bytes=fsdp_unit_bytes)
    return stage


def uses_fsdp(stage: nn.Module) -> bool:
    return hasattr(stage, "set_requires_gradient_sync")
