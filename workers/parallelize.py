"""Apply tensor(+sequence) parallelism and ZeRO (FSDP2) to one pipeline stage, in a fixed order.

The plan and the blocks come from the model family (``meshmodels/family.py``); this module names
no model's modules. Order (as TorchTitan's ``parallelize_llama``): TP/SP first (so parameters become DTensors on the tp
axis), activation checkpointing is already inside each block, then FSDP2 ``fully_shard`` per unit of
consecutive blocks (one block per unit for big blocks; small blocks grouped, ``meshspeak.mesh.fsdp_units``)
and on the stage root over the dp axis (giving 2-D (dp, tp) DTensors when both are > 1).

Sequence parallelism keeps the residual stream sharded on the sequence dim between blocks, so what a
pipeline stage sends to the next one is the *local* sequence shard of shape [b, seq/tp, d].

``train.compile`` compiles each block after TP and before FSDP (TorchTitan's order), in place
(``Module.compile``), so parameter names, and with them checkpoints, do not change; FSDP2's hooks
run outside the compiled code (dynamo skips them). ``mesh.cpu_offload`` gives every FSDP unit
FSDP2's ``CPUOffloadPolicy``: sharded parameters, gradients and the optimizer step stay on the host
(the few reductions of host tensors, the grad norm and full parameters, move them to the mesh's
device first, so the training groups need no CPU backend beside NCCL).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from meshspeak.mesh import fsdp_units


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


def apply_compile(stage: nn.Module, family, backend: str = "inductor") -> None:
    """torch.compile every block of the stage (the family's ``blocks``) in place (names unchanged)."""
    for block in family.blocks(stage):
        block.compile(backend=backend)


def apply_fsdp(stage: nn.Module, dp_mesh: DeviceMesh, family, dp_plan, *, param_dtype: torch.dtype,
               fsdp_unit_bytes: int = 0) -> None:
    """Every ZeRO level through FSDP2, on a 1-D dp mesh or a 2-D (replicate, shard) HSDP mesh, as
    ``dp_plan`` (meshspeak/dp_plan.py, decided by the driver) says:

    * 3: params resharded after forward (gathered again in backward).
    * 2: params kept gathered from forward through backward; grads reduce-scattered.
    * 1: the same as 2. ZeRO-1 (replicated grads, sharded optimizer state) has no FSDP2 mode and
      torch's ``ZeroRedundancyOptimizer`` works on plain tensors only (not our TP DTensors), so
      mesh.zero=1 runs ZeRO-2, which shards more and communicates the same bytes.
    * 0: ``dp_mesh`` is the HSDP mesh (replicate = dp, shard = 1): every rank holds every parameter
      and optimizer state, and the grads are all-reduced once per FSDP unit, overlapped with
      backward. FSDP2's HSDP keeps DTensors (``(Replicate, Shard(0))``), so TP, PP, DCP resharding
      and elastic resizes work as they do for ZeRO-3. On plain dp (no TP/PP) ZeRO-0 is torch's DDP
      instead and this function is not called (``meshspeak.dp_plan.ddp_applies``, docs/design.md).

    Blocks are sharded in units of at least ``fsdp_unit_bytes`` (``meshspeak.mesh.fsdp_units``);
    blocks left out of every unit are sharded with the root. Neither the parameter names nor their
    dim-0 sharding over dp depend on the unit size, so neither does what a checkpoint holds.
    """
    # fp64 parameters are their own compute dtype and reduce in fp64 (train.dtype = "float64": runs
    # compared with the reference at 1e-9; the plan's reduce_dtype says so); else 16/32-bit compute
    # over fp32 master weights, reduced in train.grad_reduce.
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=getattr(torch, dp_plan.reduce_dtype))
    # Pinned host memory only where there is a device to copy to and from.
    offload = (CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if dp_plan.cpu_offload
               else OffloadPolicy())
    reshard = dp_plan.reshard_after_forward
    blocks = list(family.blocks(stage))
    for unit in fsdp_units([_local_bytes(b) for b in blocks], fsdp_unit_bytes):
        members = [blocks[i] for i in unit]
        # fully_shard on a list makes one parameter group (one collective) for all its modules.
        fully_shard(members if len(members) > 1 else members[0], mesh=dp_mesh, mp_policy=mp,
                    reshard_after_forward=reshard, offload_policy=offload)
    # The root holds embedding/norm/head; it is used last in forward, so never reshard it there.
    fully_shard(stage, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False, offload_policy=offload)


def parallelize_stage(
    stage: nn.Module,
    family,
    dp_plan,
    *,
    dp_mesh: DeviceMesh,
    tp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    fsdp_unit_bytes: int = 0,
    compile: bool = False,
) -> nn.Module:
    """TP/SP when tp > 1, compile when asked, then FSDP2 when the plan's wrapper is FSDP
    (``dp_plan``: meshspeak/dp_plan.py; DDP wraps the built stage afterwards, in the runtime)."""
    if tp_mesh.size() > 1:
        apply_tp(stage, tp_mesh, family)
    if compile:
        apply_compile(stage, family)
    if dp_plan.wrapper == "fsdp":
        apply_fsdp(stage, dp_mesh, family, dp_plan, param_dtype=param_dtype, fsdp_unit_bytes=fsdp_unit_bytes)
    return stage


def loss_context(logits_or_loss: torch.Tensor):
    """Where the last stage's loss and its backward run: ``loss_parallel`` for vocab-sharded TP
    logits (cross-entropy reduced across tp ranks without gathering the vocabulary), else nothing."""
    return loss_parallel() if isinstance(logits_or_loss, DTensor) else contextlib.nullcontext()


def uses_fsdp(stage: nn.Module) -> bool:
    return hasattr(stage, "set_requires_gradient_sync")
