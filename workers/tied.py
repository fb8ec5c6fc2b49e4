"""Tied parameters across pipeline stages (the embedding and a head tied to it), kept identical.

With pp > 1 the first stage holds the embedding and the last stage its own copy (same name, e.g.
``tok_embeddings.weight``, so a checkpoint stores one tensor: DCP keeps one of identical pieces).
Each step, after the backward, the two copies' gradients are summed between the two ranks holding
them (same dp/tp coordinates, pipeline positions 0 and pp-1), as DeepSpeed's ``TiedLayerSpec`` does;
both then take the same optimizer step from the same state, so they stay bit-identical. The gradients
are already FSDP-reduced and identically sharded on both ranks, so the sum is an all-reduce of the
local shards. For the global gradient norm only the first stage's copy counts.

With ``mesh.cpu_offload`` FSDP2 leaves the reduced gradients on the host; NCCL reduces device
memory only, so on a GPU the sum goes through the rank's device and back (as the grad norm's
all-reduce in workers/optim.py does). On the CPU (gloo) the host tensor is reduced in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


class TiedGrads:
    def __init__(self, names: tuple[str, ...], stages: dict[int, nn.Module], num_stages: int, groups,
                 timeout_s: float) -> None:
        self.params: list[nn.Parameter] = []
        self.not_in_norm: set[int] = set()  # ids of copies the grad norm must not count twice
        self.group: dist.ProcessGroup | None = None
        self.device = groups.device  # where this rank's collectives reduce (NCCL: its GPU)
        shape = groups.shape
        if not names or shape.pp == 1:
            return  # one stage holds both uses of the one parameter
        backend = "nccl" if groups.device.type == "cuda" else "gloo"
        for dp in range(shape.dp):  # new_group is collective: every rank creates every pair
            for tp in range(shape.tp):
                pair = sorted({shape.rank_of(dp, 0, tp), shape.rank_of(dp, shape.pp - 1, tp)})
                # Through the RankGroups: bound like the others, its listeners known to the kick.
                group = groups.new_group(pair, backend, timeout_s)
                if groups.world_rank in pair:
                    self.group = group
        for index in (0, num_stages - 1):
            module = stages.get(index)
            if module is None:
                continue
            named = dict(module.named_parameters())
            for name in names:
                if name not in named:
                    raise RuntimeError(f"tied parameter {name!r} is not in stage {index}: the family's "
                                       "build_stage must give the first and last stage a copy of it")
                self.params.append(named[name])
                if index != 0:
                    self.not_in_norm.add(id(named[name]))

    def sync(self) -> None:
        """Sum the copies' gradients (call after the step's backward, before clipping)."""
        for param in self.params:
            grad = param.grad
            if grad is None:
                grad = param.grad = torch.zeros_like(param)
            if isinstance(grad, DTensor) and grad.placements != param.placements:
                # Without FSDP nothing normalises the layout: a TP head's gradient may come back
                # replicated while the embedding's is vocab-sharded. Both sides must sum alike.
                grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            if local.device == self.device:
                dist.all_reduce(local, group=self.group)
            else:  # an offloaded (host) gradient on a GPU rank
                on_device = local.to(self.device)
                dist.all_reduce(on_device, group=self.group)
                local.copy_(on_device)

    def is_copy(self, param: nn.Parameter) -> bool:
        """Whether ``param`` is the last stage's copy (reported and counted once, on the first stage)."""
        return id(param) in self.not_in_norm
