"""Data-parallel gradient reduction: counted, and optionally compressed (PowerSGD, int8/int4, 1-bit Adam).

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

``"int8"`` / ``"int4"`` (``workers/quantized_comm.py``) plug in at the same seams: a DDP comm hook on
plain dp, the all-reduce hook on the one-rank shard mesh otherwise, and FSDP2's custom reduce-scatter
under ZeRO-1..3. ``train.optimizer="onebit_adam"`` (``workers/onebit_adam.py``) uses the ZeRO-0 seams
for its warm-up: a plain all-reduce of the gradients until the optimizer compresses, none after.

Bytes (``quantized_comm.ByteCounter``, reported as ``StepResult.dp_bytes``): what this rank sends to
the other dp ranks in the step, counted on the tensors the collectives are given (``wire_bytes``: a
ring all-reduce sends 2(n-1)/n of its buffer, a reduce-scatter (n-1)/n; the quantized collectives
count the rows they send). ``ByteCounter`` stands in for ``torch.distributed`` inside the two DDP
hook modules; under plain ZeRO-0 FSDP2's all-reduce hook and under ZeRO-1..3 its reduce-scatter
count each unit's buffer; under DDP a step's bytes are the parameters' (``FixedBytes``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from workers.quantize import BITS
from workers.quantized_comm import (ByteCounter, CountingReduceScatter, DdpQuantizedState, QuantizedAllReduce,
                                    QuantizedReduceScatter, quantized_ddp_hook, wire_bytes)


class _CountingDist:
    """``torch.distributed`` for the DDP hook modules, with ``all_reduce`` counted (what they send)."""

    counter: ByteCounter | None = None

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, tensor, *args, **kwargs):
        if _CountingDist.counter is not None:
            n = dist.get_world_size(kwargs.get("group"))
            _CountingDist.counter.add(wire_bytes("all_reduce", tensor.numel() * tensor.element_size(), n))
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


def attach_counter(units: list[nn.Module], counter: ByteCounter, n: int) -> None:
    """Plain ZeRO-0 (and HSDP's replica all-reduce): count the bytes of each unit's all-reduced
    gradient buffer over ``n`` ranks (FSDP2 calls the hook after its HSDP all-reduce, with that buffer)."""
    for unit in units:
        unit.set_all_reduce_hook(
            lambda flat: counter.add(wire_bytes("all_reduce", flat.numel() * flat.element_size(), n)))


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


def setup_dp_reduction(stages: list[nn.Module], dp_plan, train, groups, ddp_modules: list[nn.Module] = (),
                       optimizers: list = ()) -> ByteCounter | FixedBytes | None:
    """As ``dp_plan`` (meshspeak/dp_plan.py) says: with ``count_dp_bytes`` (dp > 1) count the bytes of
    every step, and attach the reduction ``dp_plan.compression`` names (``train`` holds its knobs).

    ``ddp_modules``: the stages' DDP wrappers (``dp_plan.wrapper == "ddp"``: the reduction is a comm
    hook), else the stages are FSDP2's (ZeRO-0 with a reduction of ours sharded over the one-rank shard
    mesh: ``dp_plan.fsdp_over == "shard"``). ``optimizers``: the stages' optimizers (1-bit Adam's
    warm-up hooks ask them whether it is over; they count the compressed momentum they send).
    """
    if not dp_plan.count_dp_bytes:
        return None
    dp, reduction = groups.shape.dp, dp_plan.compression
    quantized = reduction in BITS
    counter = ByteCounter()
    if reduction == "onebit_adam":
        for opt in optimizers:
            opt.counter = counter
    if dp_plan.wrapper == "ddp":
        if reduction == "none":
            return FixedBytes(wire_bytes("all_reduce", sum(p.numel() * p.element_size() for m in stages
                                                           for p in m.parameters() if p.requires_grad), dp))
        for ddp in ddp_modules:
            if quantized:
                ddp.register_comm_hook(DdpQuantizedState(groups.dp_group, reduction, train.quant_block, counter),
                                       quantized_ddp_hook)
            else:  # 1-bit Adam (PowerSGD never runs under DDP: ddp_applies)
                ddp.register_comm_hook(_OnebitWarmup(groups.dp_group, counter, optimizers), onebit_ddp_hook)
        return counter
    units = [u for stage in stages for u in fsdp_units_of(stage)]
    if not units:
        return None
    if dp_plan.zero >= 1:  # FSDP2's reduce-scatter over the shard group, then HSDP's replica all-reduce
        for unit in units:
            unit.set_custom_reduce_scatter(
                QuantizedReduceScatter(reduction, train.quant_block, counter) if quantized
                else CountingReduceScatter(counter))
        if dp_plan.replicate > 1:
            attach_counter(units, counter, dp_plan.replicate)
    elif reduction == "powersgd":
        attach_powersgd(units, groups.dp_group, train.powersgd_rank, counter, train.seed, train.powersgd_plain_steps)
    elif quantized:
        for unit in units:
            unit.set_all_reduce_hook(QuantizedAllReduce(groups.dp_group, reduction, train.quant_block, counter))
    elif reduction == "onebit_adam":
        hook = _OnebitWarmup(groups.dp_group, counter, optimizers)
        for unit in units:
            unit.set_all_reduce_hook(hook.reduce)
    else:
        attach_counter(units, counter, dp)
    return counter


class _OnebitWarmup:
    """1-bit Adam's gradient reduction: the plain mean over dp (counted) until the optimizers compress
    their momentum, then none (each rank keeps its local gradient; workers/onebit_adam.py)."""

    def __init__(self, group: dist.ProcessGroup, counter: ByteCounter, optimizers: list) -> None:
        self.group, self.counter, self.optimizers = group, counter, optimizers
        self.n = dist.get_world_size(group)

    def reduce(self, flat: torch.Tensor) -> None:
        if not self.optimizers[0].compressing:
            self.counter.add(wire_bytes("all_reduce", flat.numel() * flat.element_size(), self.n))
            dist.all_reduce(flat.div_(self.n), group=self.group)


def onebit_ddp_hook(state: _OnebitWarmup, bucket):  # no annotations: DDP checks them
    """DDP communication hook of 1-bit Adam (``_OnebitWarmup``): the bucket's mean, or its local values."""
    buffer = bucket.buffer()
    if state.optimizers[0].compressing:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(buffer)
        return future
    state.counter.add(wire_bytes("all_reduce", buffer.numel() * buffer.element_size(), state.n))
    return dist.all_reduce(buffer.div_(state.n), group=state.group, async_op=True).get_future().then(
        lambda fut: fut.value()[0])

