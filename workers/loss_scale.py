"""Dynamic loss scaling for ``train.dtype = "float16"``, with one skip decision for every rank.

fp16 has 5 exponent bits: small gradients underflow to zero unless the loss is scaled up before
backward, and a scale too large overflows to inf. ``torch.amp.GradScaler`` solves this per process,
but here one optimizer step spans dp x pp x tp ranks, each holding a shard or a stage of the
gradients: if one rank saw an inf and skipped while the others stepped, the replicas would diverge
for good. So the found-inf flag is all-reduced (MAX) over the whole world, and every rank takes the
same decision: on overflow all skip the step and halve the scale; after ``growth_interval`` clean
steps in a row all double it. That is GradScaler's rule (same defaults), made collective, as
FSDP1's ``ShardedGradScaler`` does over its process group.

The scale multiplies the last stage's loss (``workers.pipeline.Executor.loss_scale``), so the
gradients crossing pipeline boundaries in fp16 are scaled too, and an overflow there shows up as
inf in the gradients behind it. The scale and its growth counter are saved in every checkpoint
(the ``extra`` state, identical on all ranks) and restored on resume.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass
class DynamicLossScale:
    scale: float = 2.0**16
    growth_tracker: int = 0  # clean steps since the last change
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0  # an overflow at this scale is a bad step, not a reason to halve again

    def unscale_(self, params: list[nn.Parameter], device: torch.device, group,
                 timeout_s: float = 1800.0) -> bool:
        """Divide this rank's gradients by the scale; True when no rank found an inf or NaN."""
        return self.unscale_and_check(params, device, group, timeout_s)[0]

    def unscale_and_check(self, params: list[nn.Parameter], device: torch.device, group,
                          timeout_s: float = 1800.0, *, loss_bad: bool = False) -> tuple[bool, bool]:
        """Divide this rank's gradients by the scale: (no rank found an inf or NaN gradient, no rank's
        loss was non-finite), ``loss_bad`` being this rank's own loss verdict (the last stage's).

        Collective over ``group`` (every rank of the generation: one group or the mesh's axis groups,
        ``workers.optim.reduce_over_world``), checked: the decision is never this rank's own. On overflow
        the gradients are left as they are, to be dropped with the skipped step. The loss travels in the
        same all-reduce because a non-finite loss also makes every gradient non-finite: without it, a
        NaN from the data or the model read as an overflow, reported no bad step and halved the scale.
        """
        grads = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
                 for p in params if p.grad is not None]
        found = torch.tensor([0.0, float(loss_bad)], device=device)  # [gradient, loss] not finite
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:  # the fused kernel wants one device per call (offloaded grads are on the host)
            by_device.setdefault(g.device, []).append(g)
        for where, tensors in by_device.items():
            here = torch.zeros(1, device=where)
            torch._amp_foreach_non_finite_check_and_unscale_(
                tensors, here, torch.full((), 1.0 / self.scale, device=where))
            found[0] = torch.maximum(found[0], here.to(device)[0])
        if group is not None:
            from workers.optim import reduce_over_world

            reduce_over_world(found, group, timeout_s, op=dist.ReduceOp.MAX)
        grads_bad, loss_was_bad = found.tolist()
        return not grads_bad, not loss_was_bad

    def judge(self, grads_finite: bool, loss_finite: bool) -> str:
        """The step's verdict, with the scale updated: "" (step), "overflow" (skip; the scale halved),
        or a bad step's reason ("loss": the loss itself was not finite, the scale stays; "grad_norm":
        gradients still overflow at ``min_scale``), which the bad-step counter counts."""
        if not loss_finite:
            return "loss"
        if not grads_finite and self.scale <= self.min_scale:
            self.growth_tracker = 0
            return "grad_norm"
        self.update(grads_finite)
        return "" if grads_finite else "overflow"

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": float(self.scale), "growth_tracker": int(self.growth_tracker)}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
