"""Optimizer and gradient clipping, shared by the mesh runtime and the single-process reference.

The LR (meshspeak/lr_schedule.py) is a pure function of the step, set on every param group before
each step, so it needs no scheduler state: a resumed or resharded run gets it from the step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.adam import adam as adam_update

from meshspeak.lr_schedule import lr_at  # noqa: F401  (re-exported for the runtime)


def build_optimizer(module: nn.Module, train, dp_group: dist.ProcessGroup | None = None) -> torch.optim.Optimizer:
    """``train.optimizer``: AdamW, or 1-bit Adam compressing its momentum over ``dp_group``
    (workers/onebit_adam.py; None in one process)."""
    params = list(module.parameters())
    if train.optimizer == "onebit_adam":
        from workers.onebit_adam import OnebitAdam

        return OnebitAdam(params, lr=train.lr, betas=(train.beta1, train.beta2), eps=1e-8,
                          weight_decay=train.weight_decay, warmup_steps=train.onebit_warmup_steps, group=dp_group)
    # On CUDA the fused kernel: the whole update of all parameters in a few kernels instead of one
    # launch per op per tensor group (DTensor parameters included: it has a sharding rule). Elsewhere
    # (the CPU, parameters offloaded to the host) the multi-tensor path: CPU tensors default to the
    # per-parameter loop, and with FSDP2's DTensor parameters that is one DTensor dispatch per op per
    # parameter (~45 ms/step on a 0.8M-param model, 2 ranks); multi-tensor dispatches once per op for
    # the whole list: same math, a fraction of the cost.
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return (torch.optim.AdamW if fused else ShardLocalAdamW)(
        params,
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        weight_decay=train.weight_decay,
        eps=1e-8,
        fused=fused or None,
        foreach=None if fused else True,
    )


class ShardLocalAdamW(torch.optim.AdamW):
    """AdamW (multi-tensor) whose update runs on each DTensor's local shard.

    AdamW is elementwise: where a parameter, its gradient and its moments are DTensors of one layout,
    DTensor's dispatch of each foreach op runs the very same op on their local tensors. But it first
    propagates the layouts through every op, and that propagation is cached per mesh: a new
    generation's mesh (its axes named afresh: workers/groups.py) pays it again, once per foreach op
    (~16 of them: 2.0 s of a first step under cProfile on the tiny dp=4 model at load ~5, and the
    zero-lr step DCP runs to make an optimizer's state before loading it). This step hands
    ``torch.optim.adam.adam`` the local tensors instead, with the hyperparameters and state steps
    ``Adam.step`` would pass: the same kernels on the same numbers. A group whose gradients or moments
    are not laid out as their parameter (a ``Partial`` gradient DTensor would reduce it first) takes
    ``Adam.step`` unchanged.
    """

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None or any(g["differentiable"] or g["fused"] for g in self.param_groups):
            return super().step(closure)
        for group in self.param_groups:
            lists: tuple[list, list, list, list, list, list] = ([], [], [], [], [], [])
            has_complex = self._init_group(group, *lists)
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
            if not _one_layout(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs):
                _adam(group, lists, has_complex, self)
                continue
            local = [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs]
            _adam(group, tuple(_locals(t) for t in local) + (steps,), has_complex, self)
        return None


def _adam(group: dict, lists: tuple, has_complex: bool, optimizer: torch.optim.Optimizer) -> None:
    """``torch.optim.adam.adam`` (``adam_update``) on ``lists`` with ``group``'s hyperparameters, as ``Adam.step``."""
    beta1, beta2 = group["betas"]
    adam_update(
        *lists, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
        foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
        fused=group["fused"], grad_scale=getattr(optimizer, "grad_scale", None),
        found_inf=getattr(optimizer, "found_inf", None), decoupled_weight_decay=group["decoupled_weight_decay"])


def _locals(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]


def _one_layout(params: list, *others: list) -> bool:
    """Whether every tensor beside each parameter (its gradient, its moments) is a DTensor on the
    parameter's mesh with its placements, or a plain tensor beside a plain parameter."""
    for i, param in enumerate(params):
        for other in others:
            if i >= len(other):
                continue  # max_exp_avg_sqs: empty without amsgrad
            tensor = other[i]
            if isinstance(param, DTensor) != isinstance(tensor, DTensor):
                return False
            if isinstance(param, DTensor) and (tensor.device_mesh is not param.device_mesh
                                               or tensor.placements != param.placements):
                return False
    return True


def set_lr(optimizers: Iterable[torch.optim.Optimizer], lr: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr


def checked_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, timeout_s: float,
                       op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """An all-reduce whose result decides this rank's update: the host waits for it, and it raises
    if the collective failed, instead of handing back this rank's own, unreduced value.

    Why: on NCCL a plain ``all_reduce`` returns once it is queued, and reading the result (``.item()``)
    only waits for the stream. When the watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``,
    workers/device.py) or the driver's kick aborts the communicator, the kernel ends, the stream goes
    on and the tensor keeps what this rank put in, with no error: the rank would step on it.
    ``Work.wait`` with an explicit timeout blocks the host until the work completed and then rethrows
    its error (torch's ``ProcessGroupNCCL::WorkNCCL::wait``: ``if (blockingWait_ || timeout !=
    kNoTimeout)`` it polls ``isCompleted()``, which records an aborted communicator's error, and
    ``if (exception())`` aborts and rethrows in the calling thread) — what ``TORCH_NCCL_BLOCKING_WAIT=1``
    would do for every collective, here only where a decision is read. On gloo the same call waits
    and raises as a plain blocking all-reduce does.
    """
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    work.wait(timeout=timedelta(seconds=timeout_s))


def reduce_over_world(tensor: torch.Tensor, groups, timeout_s: float,
                      op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """``checked_all_reduce`` over the whole generation, as one group or as the mesh's axis groups in
    turn (``RankGroups.world_axes``: tp, then pp, then dp — a sum or max over each axis of the grid
    in turn is the one over every rank). The axis groups are the ones training already connected, so
    the generation needs no whole-world group for it (workers/groups.py). None: one process."""
    if groups is None:
        return
    for group in (groups if isinstance(groups, (list, tuple)) else (groups,)):
        if dist.get_world_size(group) > 1:
            checked_all_reduce(tensor, group, timeout_s, op=op)


def clip_grad_norm(
    params: list[nn.Parameter], max_norm: float, group,
    skip_in_norm: frozenset[int] | set[int] = frozenset(), *, holders: int = 1,
    device: torch.device | None = None, timeout_s: float = 1800.0,
) -> float:
    """Clip by the global grad norm over every parameter of the model, wherever it is sharded.

    An all-reduce over ``group`` (every rank of the generation: one group, or the mesh's axis
    groups in turn, ``reduce_over_world``; None in one process) of this rank's sum of squared
    gradient entries. Why not DTensor's own norm: a (dp, tp) grad norm is
    ``Partial`` on both axes and ``full_tensor()`` reduces it as two sequential all-reduces (DTensor
    warns so), pipeline stages then need a third over pp (TorchTitan's ``clip_grad_norm_``). Here
    each local shard's squared sum is divided by the number of ranks holding the same values:
    ``holders`` (dp * tp, the ranks of one pipeline stage) over the number of distinct shards of
    the tensor (the product of its sharded mesh axes), so a replicated tensor (ZeRO-0's replicate
    axis, a norm weight replicated over tp) is counted once in the sum over all ranks. A second copy
    of a tied parameter (``id`` in ``skip_in_norm``) is clipped but not counted.

    The all-reduce is checked (``checked_all_reduce``, at most ``timeout_s``): the norm is the one
    decision every rank steps on, and it is reduced over the whole world after every gradient
    collective, so a rank whose earlier collective was aborted never gets a norm back either (its
    peers' contributions never arrive, or its own failed work raises).
    """
    by_holders: dict[int, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        grad = p.grad
        if id(p) in skip_in_norm:
            continue
        shards = 1
        if isinstance(grad, DTensor):
            if any(pl.is_partial() for pl in grad.placements):  # not reduced yet (TP without FSDP)
                grad = grad.redistribute(placements=[Replicate() if pl.is_partial() else pl
                                                     for pl in grad.placements])
            # Everything not replicated is a shard by now (FSDP2's _StridedShard is not a Shard subclass).
            shards = math.prod(grad.device_mesh.size(i) for i, pl in enumerate(grad.placements) if not pl.is_replicate())
            grad = grad.to_local()
        by_holders.setdefault(max(1, holders // shards), []).append(grad)
    terms = [torch.stack([n.double() for n in torch._foreach_norm(grads, 2.0)]).pow(2).sum() / count
             for count, grads in by_holders.items()]
    squared = torch.stack(terms).sum() if terms else torch.zeros((), dtype=torch.float64)
    if group is not None:
        # Offloaded gradients (mesh.cpu_offload) are host tensors: reduce on the group's device.
        squared = squared.to(device or squared.device)
        reduce_over_world(squared, group, timeout_s)
    # float64 runs (compared with one process at 1e-9) keep the norm in float64; else float32.
    wide = any(g.dtype == torch.float64 for grads in by_holders.values() for g in grads)
    total = squared.sqrt().to(torch.float64 if wide else torch.float32)
    if max_norm > 0:
        _scale_grads(params, max_norm, total)
    return float(total)


def _scale_grads(params: list[nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
    """``torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)`` on each
    gradient's local tensor: the same coefficient (``max_norm / (total + 1e-6)``, at most 1) times the
    same numbers, for any layout (a scalar times a shard, a replica or a partial sum is that of the
    whole). On DTensors the foreach multiply first propagates their layouts, uncached on a new
    generation's mesh: 0.63 s of its first step under cProfile (tiny model, dp=4)."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            by_device.setdefault(grad.device, []).append(grad)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, coef.to(device))

