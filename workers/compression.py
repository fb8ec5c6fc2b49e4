"""ZeRO-0's data-parallel gradient reduction: counted, and optionally PowerSGD-compressed.

``train.grad_compression="powersgd"`` runs torch's DDP communication hook
(``ddp_comm_hooks.powerSGD_hook``: low-rank P/Q all-reduces with error feedback and warm start) on
FSDP2's gradients instead of FSDP2's own all-reduce. How: the stage is then sharded over a
*one-rank* shard mesh (no replicate axis: FSDP2 itself communicates nothing over dp), and FSDP2's
``set_all_reduce_hook`` hands each unit's flat gradient buffer to ``_PowerSGD``, which presents it to
the DDP hook as a bucket (the hook reads only ``buffer()``, ``gradients()``, ``index()`` and
``is_last()``; ``_Bucket`` is that duck type) and waits for its future (on FSDP2 so that PowerSGD
works with TP's DTensor parameters too). Plain ZeRO-0 on dp alone runs through torch's DDP
(``wrap_ddp``, docs/design.md, Data-parallel strategies). The compressor state (error feedback,
warm-start P/Q) lives in the generation's ``RankRuntime``: every resize starts it afresh, like a new
DDP job; it is not checkpointed.

Bytes: ``ByteCounter`` sums ``nbytes`` of every tensor the hook's all-reduces send (it stands in
for ``torch.distributed`` inside the two hook modules), and under plain ZeRO-0 FSDP2's all-reduce
hook adds the ``nbytes`` of each unit's all-reduced buffer; the runtime reports the step's total as
``StepResult.dp_bytes`` (the metrics' ``dp_bytes`` field).
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook


class ByteCounter:
    """Counts the bytes this rank all-reduces over dp in a step (reset by the runtime each step)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += nbytes

    def take(self) -> int:
        with self._lock:
            out, self.bytes = self.bytes, 0
        return out


class _CountingDist:
    """``torch.distributed`` for the DDP hook modules, with ``all_reduce`` counted (what they send)."""

    counter: ByteCounter | None = None

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, tensor, *args, **kwargs):
        if _CountingDist.counter is not None:
            _CountingDist.counter.add(tensor.numel() * tensor.element_size())
        return dist.all_reduce(tensor, *args, **kwargs)


# The hook modules look ``dist`` up at call time: give them the counting one (only they use it).
powerSGD_hook.dist = default_hooks.dist = _CountingDist()


class _Bucket:
    """What ``powerSGD_hook`` reads of a ``dist.GradBucket``."""

    def __init__(self, buffer: torch.Tensor, grads: list[torch.Tensor], index: int, last: bool) -> None:
        self._buffer, self._grads, self._index, self._last = buffer, grads, index, last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


def _unit_shapes(module: nn.Module) -> list[torch.Size]:
    """Local gradient shapes of an FSDP unit's parameters, in the order of its flat buffer."""
    group = module._get_fsdp_state()._fsdp_param_group
    return [p.sharded_param._local_tensor.shape for p in group.fsdp_params]


class _PowerSGD:
    """One FSDP unit's all-reduce hook: the DDP PowerSGD hook over ``group`` on the unit's flat grads."""

    def __init__(self, state: powerSGD_hook.PowerSGDState, shapes: list[torch.Size], index: int,
                 last: bool) -> None:
        self.state, self.shapes, self.index, self.last = state, shapes, index, last

    def __call__(self, flat: torch.Tensor) -> None:
        numels = [s.numel() for s in self.shapes]
        if sum(numels) == flat.numel():  # every parameter had a gradient: one view per parameter
            grads = [g.view(s) for g, s in zip(flat.split(numels), self.shapes)]
        else:  # some had none: FSDP2 left them out of the buffer; compress nothing, reduce it whole
            grads = [flat]
        out = powerSGD_hook.powerSGD_hook(self.state, _Bucket(flat, grads, self.index, self.last)).wait()
        if out is not flat:
            flat.copy_(out)


def powersgd_state(group: dist.ProcessGroup | None, rank: int, counter: ByteCounter, seed: int,
                   plain_steps: int = 2) -> powerSGD_hook.PowerSGDState:
    """torch's ``PowerSGDState`` as elastimesh sets it up, its all-reduces counted by ``counter``
    (also what bench/powersgd_ddp_oracle.py hands torch's own DDP, to compare like with like)."""
    _CountingDist.counter = counter
    return powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                       start_powerSGD_iter=plain_steps, random_seed=seed,
                                       # > 0: an all-zero gradient block must not orthogonalise to NaN
                                       orthogonalization_epsilon=1e-8)


def attach_powersgd(units: list[nn.Module], group: dist.ProcessGroup, rank: int, counter: ByteCounter,
                    seed: int, plain_steps: int = 2) -> powerSGD_hook.PowerSGDState:
    """PowerSGD (``rank``) on every FSDP unit of this rank, one state for all (bucket = unit index).

    ``start_powerSGD_iter=plain_steps`` (``train.powersgd_plain_steps``, >= 2: the hook's own minimum
    with error feedback): the state's first ``plain_steps`` steps are uncompressed all-reduces;
    deferring compression narrows the loss gap (docs/design.md, PowerSGD). The last unit of the list
    (the stage root, reduced last) closes a step.
    """
    state = powersgd_state(group, rank, counter, seed, plain_steps)
    for i, unit in enumerate(units):
        unit.set_all_reduce_hook(_PowerSGD(state, _unit_shapes(unit), i, last=i == len(units) - 1))
    return state


def attach_counter(units: list[nn.Module], counter: ByteCounter) -> None:
    """Plain ZeRO-0: count the bytes of each unit's all-reduced gradient buffer (FSDP2 calls the
    hook after its HSDP all-reduce, with that buffer)."""
    for unit in units:
        unit.set_all_reduce_hook(lambda flat: counter.add(flat.numel() * flat.element_size()))


def fsdp_units_of(module: nn.Module) -> list[nn.Module]:
    """One module per FSDP unit of a sharded stage (a unit made from a list counts once), the
    stage root last: FSDP2 reduces the root's gradients at the end of backward."""
    from torch.distributed.fsdp import FSDPModule

    seen, units = set(), []
    for m in module.modules():
        if m is not module and isinstance(m, FSDPModule) and id(m._get_fsdp_state()) not in seen:
            seen.add(id(m._get_fsdp_state()))
            units.append(m)
    return [*units, module] if isinstance(module, FSDPModule) else units


class FixedBytes:
    """ZeRO-0 under DDP: every parameter's gradient is all-reduced once per step, so a step's dp
    bytes are the parameters' bytes (counted once, not by a Python comm hook on DDP's hot path)."""

    def __init__(self, nbytes: int) -> None:
        self.bytes = nbytes

    def take(self) -> int:
        return self.bytes


def wrap_ddp(module: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """ZeRO-0 on plain dp (``meshspeak.dp_plan.ddp_applies``): torch's DDP over ``group``, bucketed
    all-reduces overlapped with backward. DDP averages over dp as FSDP2 does, so the loss scaling of
    ``workers.pipeline.StepData`` is unchanged; its parameters are plain tensors, which DCP saves once
    (replicas deduplicated) and reshards into FSDP2/TP layouts and back (docs/design.md)."""
    from torch.nn.parallel import DistributedDataParallel

    # No buffer sync in forward: the buffers (RoPE tables) are computed, identical on every rank.
    # Gradients as views of DDP's buckets: no copy into the bucket and back after the all-reduce.
    return DistributedDataParallel(module, process_group=group, forward_sync_buffers=False,
                                   gradient_as_bucket_view=True)


def setup_dp_reduction(stages: list[nn.Module], dp_plan, train, groups) -> ByteCounter | FixedBytes | None:
    """As ``dp_plan`` (meshspeak/dp_plan.py) says: with ``count_dp_bytes`` (ZeRO-0, dp > 1) count the dp
    bytes, and with ``compression == "powersgd"`` attach the compressor (the stages were then sharded
    over the one-rank shard mesh: ``dp_plan.fsdp_over == "shard"``)."""
    if not dp_plan.count_dp_bytes:
        return None
    if dp_plan.wrapper == "ddp":
        return FixedBytes(sum(p.numel() * p.element_size() for m in stages for p in m.parameters()
                              if p.requires_grad))
    units = [u for stage in stages for u in fsdp_units_of(stage)]
    if not units:
        return None
    counter = ByteCounter()
    if dp_plan.compression == "powersgd":
        attach_powersgd(units, groups.dp_group, train.powersgd_rank, counter, train.seed, train.powersgd_plain_steps)
    else:
        attach_counter(units, counter)
    return counter
