"""Whether a step's gradients update the model: one decision, the same on every rank (docs/design.md,
Bad steps).

After the step's backward, ``UpdateCheck.verdict`` unscales float16's gradients (and judges them with
the loss scale: workers/loss_scale.py), clips by the global grad norm and checks that norm is finite.
The norm is reduced over dp, tp and pp, so a NaN/inf gradient on any rank makes it non-finite on
every rank; a rank's own non-finite loss reaches that decision by being poisoned into its gradient
(``poison_grads``). So the norm is computed even when clipping is off. A step that does not update
leaves parameters and optimizer state untouched and is reported as skipped (and, unless it was
fp16's overflow, as a bad step).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from torch import nn

from workers.groups import RankGroups
from workers.loss_scale import DynamicLossScale
from workers.optim import clip_grad_norm

logger = logging.getLogger(__name__)

OVERFLOW = "overflow"  # float16's gradients overflowed: skipped, the loss scale halved; not a bad step


def poison_grads(params, not_in_norm: set[int]) -> None:
    """Put a NaN into this rank's share of one counted gradient: the global norm becomes NaN on
    every rank (how a non-finite loss on the last stage reaches the one skip decision).
    ``not_in_norm``: ids of parameters the norm leaves out (a pipeline's tied copy)."""
    from torch.distributed.tensor import DTensor

    for p in params:
        if p.grad is None or id(p) in not_in_norm:
            continue
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if local.numel():
            local.view(-1)[0] = float("nan")
            return


@dataclass
class UpdateCheck:
    """What the decision reads: this rank's parameters (with the tied copies the norm leaves out), the
    generation's groups, ``train.grad_clip`` and the loss scale (float16 only)."""

    params: list[nn.Parameter]
    not_in_norm: set[int]
    groups: RankGroups
    grad_clip: float
    timeout_s: float  # elastic.collective_timeout_s: the decision's all-reduces are checked
    loss_scale: DynamicLossScale | None

    def verdict(self, step: int, loss: float | None) -> str:
        """"" (update), ``OVERFLOW`` (skip), or a bad step's reason ("loss", "grad_norm"), the gradients
        clipped when they update. ``loss``: this rank's loss, None when it holds no last stage."""
        loss_bad = loss is not None and not math.isfinite(loss)
        if loss_bad:
            poison_grads(self.params, self.not_in_norm)
        verdict = self._fp16_verdict(loss_bad) if self.loss_scale is not None else ""
        if not verdict:
            norm = self._clip()
            if not math.isfinite(norm):
                verdict = "loss" if loss_bad else "grad_norm"
                logger.warning("step %d: %s not finite; update skipped on every rank", step, verdict)
        elif verdict == OVERFLOW:
            logger.warning("step %d: fp16 gradients overflowed; update skipped on every rank, loss "
                           "scale now %g", step, self.loss_scale.scale)
        else:
            logger.warning("step %d: %s not finite at loss scale %g; update skipped on every rank", step, verdict,
                           self.loss_scale.scale)
        return verdict

    def _clip(self) -> float:
        """Clip by the global grad norm (reduced over dp, tp and pp): the norm, the same on every rank."""
        shape = self.groups.shape
        world = self.groups.world_axes if shape.world > 1 else None
        return clip_grad_norm(self.params, self.grad_clip, world, self.not_in_norm, holders=shape.dp * shape.tp,
                              device=self.groups.device, timeout_s=self.timeout_s)

    def _fp16_verdict(self, loss_bad: bool) -> str:
        """float16: unscale the gradients and judge the step, one decision for every rank (an
        all-reduce over the world): "", ``OVERFLOW``, or a bad step's reason (workers/loss_scale.py)."""
        checked = self.loss_scale.unscale_and_check(self.params, self.groups.device, self.groups.world_axes,
                                                    self.timeout_s, loss_bad=loss_bad)
        return self.loss_scale.judge(*checked)


def bad_reason(verdict: str) -> str:
    """The bad step's reason a verdict reports (``StepResult.bad``): none for fp16's overflow."""
    return "" if verdict == OVERFLOW else verdict
