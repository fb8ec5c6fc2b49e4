"""Build a rank's pipeline stage small: on the meta device, parallelised, then only local shards made real.

``build_local_stage`` builds the family's stage with no storage (``torch.device("meta")``), lets the
caller apply TP and FSDP2 (parameters become DTensors whose local shards are still meta), then
``to_empty`` allocates just this rank's shards, and ``init_local`` fills each from the family's
``init_tensor`` (a function of (seed, parameter name) only; a family with ``init_slice`` draws just
the shard) — or the caller loads Hugging Face weights
into them instead (``meshmodels/hf_io.py``). So a rank's peak memory while building is its shards
plus one full parameter being initialised (or one block of rows with ``init_slice``), not the whole
stage, and every mesh still holds exactly the weights one process builds (the single-process
reference goes through the same two functions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def build_local_stage(
    family: Any,
    shape: Any,
    layers: range,
    *,
    device: torch.device,
    seed: int,
    activation_checkpointing: bool = False,
    parallelize: Callable[[nn.Module], nn.Module] | None = None,
    init: bool = True,
    dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """The stage holding ``layers``, parallelised by ``parallelize``, with local shards on ``device``.

    ``init=False`` leaves the shards uninitialised (``torch.empty``): the caller loads them.
    ``dtype``: the parameters' own dtype (``train.dtype = "float64"``); None keeps fp32.
    ``cpu_offload`` (``mesh.cpu_offload``, FSDP2's ``CPUOffloadPolicy``): the parameters' shards are
    made on the host whatever ``device`` computes, as FSDP2's lazy init requires (it refuses
    offloaded parameters on any other device); buffers, which FSDP does not manage, go to ``device``.
    """
    with torch.device("meta"):
        module = family.build_stage(shape, layers, activation_checkpointing=activation_checkpointing)
        if dtype is not None:
            module.to(dtype)
    if parallelize is not None:
        module = parallelize(module)
    module.to_empty(device=torch.device("cpu") if cpu_offload else device)
    if cpu_offload:
        for buffer in module.buffers():
            buffer.data = buffer.data.to(device)
    if init:
        init_local(module, family, shape, seed)
    return module


def local_slices(param: torch.Tensor) -> tuple[slice, ...] | None:
    """Where this rank's local shard of a DTensor lies in the global tensor (None: not a DTensor)."""
    if not isinstance(param, DTensor):
        return None
    # Public DTensor helper semantics (uneven chunks, FSDP2's strided TP+DP sharding included); DCP
    # uses the same function to place shards.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    size, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, size, strict=True))


@torch.no_grad()
def init_local(module: nn.Module, family: Any, shape: Any, seed: int) -> None:
    """Fill every parameter's local shard from ``family.init_tensor`` of its full global value."""
    init_slice = getattr(family, "init_slice", None)
    for name, param in module.named_parameters():
        slices = local_slices(param)
        if slices is None:
            param.copy_(family.init_tensor(shape, name, tuple(param.shape), seed))
            continue
        local = param.to_local()
        if init_slice is not None:  # the family can draw just this shard (equal to the full tensor's slice)
            value = init_slice(shape, name, tuple(param.shape), seed, slices)
        else:
            value = family.init_tensor(shape, name, tuple(param.shape), seed)[slices]
        local.copy_(value.to(local.dtype))
        del value
