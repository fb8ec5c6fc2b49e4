"""1-bit Adam (``train.optimizer = "onebit_adam"``, ZeRO-0 only): DeepSpeed's algorithm on torch.

Tang et al. 2021 (arXiv 2102.02888) and DeepSpeed's ``OnebitAdam`` with its compressed all-reduce:

* Warm-up (the first ``train.onebit_warmup_steps`` optimizer steps): plain Adam(W) on the all-reduced
  gradient, the same update as ``torch.optim.AdamW`` (decoupled weight decay, bias correction).
* Then the variance ``exp_avg_sq`` is frozen (with its bias correction), the gradients are no longer
  all-reduced (the dp hooks of ``workers/compression.py`` leave each rank its local gradient), and each
  rank folds its local gradient into its momentum, which is then averaged over dp by a 1-bit
  compressed all-reduce (``onebit_all_reduce``): sign bits with one scale per tensor (``||m|| /
  sqrt(numel)``), a worker residual for what the signs dropped; the owner of each chunk sums what it
  received, compresses its chunk again (sign + one scale per tensor chunk, a server residual) and
  all-gathers it, so every rank ends with the same momentum. Both residuals live in the optimizer
  object, not in its state: a checkpoint holds what AdamW's holds (``step``, ``exp_avg``,
  ``exp_avg_sq``), and a resume or a resize starts the residuals at zero, as DeepSpeed's loader does.

Differences from DeepSpeed's ``OnebitAdam``, on purpose: bias correction as torch's AdamW (so that the
warm-up is AdamW exactly); no first "initialisation" step without an update; every rank's tensors are
sent in one all-to-all and three all-gathers per step (DeepSpeed runs them per tensor). At dp = 1
nothing is compressed (DeepSpeed skips the all-reduce at world size 1): Adam with the variance frozen.
After the warm-up the gradient clip sees local gradients (their root-mean-square norm over the
replicas: the ranks still take one clip decision), as no averaged gradient exists any more.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from workers.quantize import ErrorFeedback, pack_signs, unpack_signs


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class OnebitErrors:
    """The worker and server residuals of one optimizer's compressed all-reduce."""

    def __init__(self) -> None:
        self.worker, self.server = ErrorFeedback(), ErrorFeedback()


def _segment_scales(x: torch.Tensor, segment: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Per segment (tensor) of the columns of ``x``: ``||x_segment|| / sqrt(size)``."""
    squares = x.pow(2).reshape(-1, x.shape[-1]).sum(dim=0)
    norms = torch.zeros(sizes.numel(), dtype=x.dtype, device=x.device).index_add_(0, segment, squares)
    return (norms / sizes).sqrt()


def _signs_times(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0) * scales


def onebit_all_reduce(tensors: list[torch.Tensor], errors: OnebitErrors, group: dist.ProcessGroup,
                      counter=None) -> None:
    """Every tensor := the 1-bit compressed mean of that tensor over ``group``, in place.

    Tensor t is padded to n * c_t values (c_t a multiple of 8: whole bytes of signs) and cut into n
    chunks; the chunks j of all tensors form row j of an [n, C] matrix, sent to rank j."""
    n, device = dist.get_world_size(group), tensors[0].device
    numels = [t.numel() for t in tensors]
    chunks = [-(-s // (8 * n)) * 8 for s in numels]
    rows = torch.cat([F.pad(t.reshape(-1).float(), (0, n * c - s)).view(n, c)
                      for t, s, c in zip(tensors, numels, chunks)], dim=1)
    chunk_sizes = torch.tensor(chunks, dtype=torch.float32, device=device)
    segment = torch.repeat_interleave(torch.arange(len(tensors), device=device),
                                      torch.tensor(chunks, device=device))
    # Worker: sign of (momentum + residual), one scale per whole tensor.
    compensated = errors.worker.compensate(rows)
    worker_scales = _segment_scales(compensated, segment, chunk_sizes * n)
    errors.worker.update(compensated, _signs_times(compensated, worker_scales[segment]))
    signs = pack_signs(compensated)
    received = torch.empty_like(signs)
    dist.all_to_all_single(received, signs, group=group)
    all_scales = torch.empty(n * len(tensors), dtype=torch.float32, device=device)
    dist.all_gather_single(all_scales, worker_scales, group=group)  # gloo: 1-D in, 1-D out
    all_scales = all_scales.view(n, len(tensors))
    # Server: the mean of what the n ranks sent for my chunk, then sign of (that + residual).
    mine = (unpack_signs(received) * all_scales[:, segment]).sum(dim=0) / n
    compensated = errors.server.compensate(mine)
    server_scales = _segment_scales(compensated, segment, chunk_sizes)
    errors.server.update(compensated, _signs_times(compensated, server_scales[segment]))
    gathered = torch.empty(n * signs.shape[1], dtype=torch.uint8, device=device)
    dist.all_gather_single(gathered, pack_signs(compensated), group=group)
    gathered = gathered.view(n, signs.shape[1])
    all_scales = torch.empty(n * len(tensors), dtype=torch.float32, device=device)
    dist.all_gather_single(all_scales, server_scales, group=group)
    all_scales = all_scales.view(n, len(tensors))
    if counter is not None:
        scale_bytes = 4 * len(tensors)
        counter.add((n - 1) * (signs.shape[1] + scale_bytes) * 2)
    full = unpack_signs(gathered) * all_scales[:, segment]
    start = 0
    for t, s, c in zip(tensors, numels, chunks):
        t.copy_(full[:, start:start + c].reshape(-1)[:s].view(t.shape))
        start += c


class OnebitAdam(torch.optim.Optimizer):
    """1-bit Adam over the dp ``group`` (None or one rank: no compression); see the module docstring.

    ``compressing`` (the optimizer has completed its warm-up steps) is what the dp hooks read before
    each backward: it derives from the checkpointed ``step`` state, so a resumed run agrees with it.
    """

    def __init__(self, params, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 warmup_steps: int, group: dist.ProcessGroup | None = None, counter=None) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.warmup_steps, self.group, self.counter = warmup_steps, group, counter
        self.errors: dict[int, OnebitErrors] = {}  # per param group (one layout each)

    def completed_steps(self) -> int:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" in state:
                    return int(state["step"])
        return 0

    @property
    def compressing(self) -> bool:
        return self.completed_steps() >= self.warmup_steps

    @torch.no_grad()
    def step(self, closure=None):
        frozen = self.compressing
        distributed = self.group is not None and dist.get_world_size(self.group) > 1
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if not state:  # AdamW's state keys and dtypes: checkpoints are interchangeable
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            states = [self.state[p] for p in params]
            local_params = [_local(p) for p in params]
            grads = [_local(p.grad) for p in params]
            exp_avgs = [_local(s["exp_avg"]) for s in states]
            exp_avg_sqs = [_local(s["exp_avg_sq"]) for s in states]
            for s in states:
                s["step"] += 1
            step = int(states[0]["step"])
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            if wd:
                torch._foreach_mul_(local_params, 1 - lr * wd)
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)  # as AdamW's multi-tensor path
            if not frozen:
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
            elif distributed:
                onebit_all_reduce(exp_avgs, self.errors.setdefault(index, OnebitErrors()), self.group,
                                  self.counter)
            # The variance stopped changing at the warm-up's last step: so does its bias correction.
            bias1 = 1 - beta1 ** step
            bias2_sqrt = (1 - beta2 ** (self.warmup_steps if frozen else step)) ** 0.5
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, bias2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(local_params, exp_avgs, denom, -lr / bias1)
        return None
