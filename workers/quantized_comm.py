"""Quantized data-parallel gradient reductions (``train.grad_compression = "int8" | "int4"``).

ZeRO++'s qgZ scheme with error feedback, on any backend that has all-to-all and all-gather (gloo and
NCCL): a rank's gradient buffer is cut into one row per dp rank, each row quantized blockwise
(``workers/quantize.py``: ``train.quant_block`` values per fp32 scale) and sent to the rank that owns
it in one ``all_to_all_single`` of bytes; the owner dequantizes the rows it received and sums them in
fp32. That is the whole reduce-scatter (ZeRO-2/3). An all-reduce (ZeRO-0) then quantizes each owner's
reduced row again and all-gathers it, and every rank, the owner included, uses the dequantized rows,
so the replicas stay bit-identical. Two residuals (``ErrorFeedback``) keep what rounding dropped: the
*worker* one for what a rank sent in the all-to-all, the *server* one for the row it owns in the
all-gather (the two errors of DeepSpeed's compressed all-reduce). They belong to one layout (an FSDP
unit, a DDP bucket) and to one generation: a resize starts them afresh, like PowerSGD's state.

Where it plugs in (``workers/compression.py`` decides): FSDP2's ``set_custom_reduce_scatter`` under
ZeRO-1..3 (``QuantizedReduceScatter``), a DDP communication hook under ZeRO-0 on plain dp
(``quantized_ddp_hook``), FSDP2's all-reduce hook under ZeRO-0 with TP/PP (``QuantizedAllReduce``; the
stage is then sharded over the one-rank shard mesh, as for PowerSGD).

Bytes (``ByteCounter``, the step records' ``dp_bytes``): what this rank sends to the other dp ranks,
counted on the tensors handed to the collectives: of an all-to-all the rows for the others, of an
all-gather its own row once per other rank. The uncompressed collectives are counted the same way
(``wire_bytes``): a ring all-reduce sends 2(n-1)/n of its buffer, a reduce-scatter (n-1)/n.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from workers.quantize import (BITS, ErrorFeedback, dequantize, pack_rows, padded_length, quantize,
                              unpack_rows)


class ByteCounter:
    """Counts the bytes this rank sends over dp in a step (reset by the runtime each step)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += int(nbytes)

    def take(self) -> int:
        with self._lock:
            out, self.bytes = self.bytes, 0
        return out


def wire_bytes(kind: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends in a ring ``kind`` ("all_reduce" / "reduce_scatter") of an ``nbytes``
    buffer over ``n`` ranks. At n = 2 an all-reduce sends its buffer once."""
    if n <= 1:
        return 0
    return 2 * (n - 1) * nbytes // n if kind == "all_reduce" else (n - 1) * nbytes // n


class QuantizedReducer:
    """Quantized reduce-scatter and all-reduce over ``group`` for one gradient layout, with the
    worker and server residuals of that layout."""

    def __init__(self, group: dist.ProcessGroup, compression: str, block: int, counter: ByteCounter) -> None:
        self.group, self.bits, self.block, self.counter = group, BITS[compression], block, counter
        self.n = dist.get_world_size(group)
        self.worker, self.server = ErrorFeedback(), ErrorFeedback()

    def _encode(self, rows: torch.Tensor, feedback: ErrorFeedback) -> tuple[torch.Tensor, int]:
        compensated = feedback.compensate(rows)
        payload, scales = quantize(compensated, self.bits, self.block)
        feedback.update(compensated, dequantize(payload, scales, self.bits, self.block))
        return pack_rows(payload, scales), payload.shape[1]

    def _decode(self, packed: torch.Tensor, payload_bytes: int) -> torch.Tensor:
        payload, scales = unpack_rows(packed, payload_bytes)
        return dequantize(payload, scales, self.bits, self.block)

    def _reduce_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [n, m] (m whole blocks), row j for rank j: the fp32 sum of every rank's row for me."""
        packed, payload_bytes = self._encode(rows, self.worker)
        received = torch.empty_like(packed)
        dist.all_to_all_single(received, packed, group=self.group)
        self.counter.add((self.n - 1) * packed.shape[1])
        return self._decode(received, payload_bytes).sum(dim=0)

    def reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor, average: bool) -> None:
        """``out`` := this rank's chunk of the sum (mean if ``average``) of every rank's ``flat``
        (``flat`` holds n equal chunks, chunk j for rank j: FSDP2's reduce-scatter input)."""
        m = flat.numel() // self.n
        rows = F.pad(flat.view(self.n, m), (0, padded_length(m, self.block) - m))
        mine = self._reduce_rows(rows)[:m]
        out.copy_(mine / self.n if average else mine)

    def all_reduce(self, flat: torch.Tensor) -> None:
        """``flat`` := the mean of every rank's ``flat``, in place (identical on every rank)."""
        numel, n = flat.numel(), self.n
        m = -(-numel // n)
        padded = padded_length(m, self.block)
        rows = F.pad(F.pad(flat.reshape(-1), (0, n * m - numel)).view(n, m), (0, padded - m))
        mine = self._reduce_rows(rows) / n
        packed, payload_bytes = self._encode(mine.unsqueeze(0), self.server)
        gathered = torch.empty(n * packed.shape[1], dtype=torch.uint8, device=packed.device)
        dist.all_gather_single(gathered, packed.view(-1), group=self.group)  # gloo: 1-D in, 1-D out
        self.counter.add((n - 1) * packed.shape[1])
        full = self._decode(gathered.view(n, -1), payload_bytes)[:, :m].reshape(-1)[:numel]
        flat.copy_(full.view(flat.shape))


class QuantizedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter of one unit (``FSDPModule.set_custom_reduce_scatter``), quantized.

    FSDP2 asks for the mean (``ReduceOp.AVG``), or for the sum and divides afterwards (fp16/fp64
    reductions); anything else (a custom divide factor, which this runtime never sets) is refused."""

    def __init__(self, compression: str, block: int, counter: ByteCounter) -> None:
        self.compression, self.block, self.counter = compression, block, counter
        self.reducer: QuantizedReducer | None = None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise NotImplementedError(f"quantized reduce-scatter supports AVG and SUM, not {op}")
        if self.reducer is None or self.reducer.group is not group:
            self.reducer = QuantizedReducer(group, self.compression, self.block, self.counter)
        self.reducer.reduce_scatter(input_tensor, output_tensor, average=op == dist.ReduceOp.AVG)
        return None


class CountingReduceScatter(DefaultReduceScatter):
    """FSDP2's own reduce-scatter, with the bytes it sends counted (uncompressed ZeRO-1..3)."""

    def __init__(self, counter: ByteCounter) -> None:
        self.counter = counter

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.counter.add(wire_bytes("reduce_scatter", input_tensor.numel() * input_tensor.element_size(),
                                    group.size()))
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


class QuantizedAllReduce:
    """One FSDP unit's all-reduce hook under ZeRO-0 with TP/PP: the quantized mean over dp."""

    def __init__(self, group: dist.ProcessGroup, compression: str, block: int, counter: ByteCounter) -> None:
        self.reducer = QuantizedReducer(group, compression, block, counter)

    def __call__(self, flat: torch.Tensor) -> None:
        self.reducer.all_reduce(flat)


class DdpQuantizedState:
    """A DDP communication hook's state: one reducer per bucket (a rebuilt bucket gets a new one)."""

    def __init__(self, group: dist.ProcessGroup, compression: str, block: int, counter: ByteCounter) -> None:
        self.group, self.compression, self.block, self.counter = group, compression, block, counter
        self.reducers: dict[int, tuple[int, QuantizedReducer]] = {}

    def reducer(self, index: int, numel: int) -> QuantizedReducer:
        # DDP rebuilds its buckets after the first step (in the order the gradients arrived): a bucket
        # index may then hold other parameters, so its residuals start afresh.
        known = self.reducers.get(index)
        if known is None or known[0] != numel:
            known = (numel, QuantizedReducer(self.group, self.compression, self.block, self.counter))
            self.reducers[index] = known
        return known[1]


def quantized_ddp_hook(state: DdpQuantizedState, bucket):  # no annotations: DDP checks them
    """DDP communication hook (``register_comm_hook``): the bucket's quantized mean, in place.

    Synchronous (a completed future): the all-to-all and the all-gather depend on each other, so the
    bucket's communication does not overlap the rest of backward as DDP's own all-reduce does."""
    buffer = bucket.buffer()
    state.reducer(bucket.index(), buffer.numel()).all_reduce(buffer)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future
