"""Blockwise int8/int4 quantization, 1-bit sign packing and error feedback: pure tensor math.

What the quantized gradient reductions (``workers/quantized_comm.py``) and 1-bit Adam
(``workers/onebit_adam.py``) put on the wire. No process group here, so the unit tests check the
round trip and the error feedback in one process (tests/unit/test_quantize.py).

* ``quantize`` / ``dequantize``: rows of a 2-D float tensor (one row per destination rank), each cut
  into blocks of ``block`` values with one fp32 scale per block (``absmax / qmax``, symmetric, round to
  nearest: ZeRO++'s qgZ quantizes blockwise the same way). int8 holds one value per byte in
  [-127, 127]; int4 two per byte in [-7, 7] (offset by 8 into a nibble). The scales travel in the same
  byte buffer as the values (``pack_rows``), so one collective carries both. Elementwise round-trip
  error is at most half a quantization step: ``scale / 2``.
* ``pack_signs`` / ``unpack_signs``: one bit per value, 1 for ``x >= 0`` (DeepSpeed's 1-bit
  compression maps 0 to +1 as well, so every value is +-scale).
* ``ErrorFeedback``: the residual of the last compression is added to the next input, so what was
  rounded away is sent later instead of lost: the sum of what was sent over T steps differs from the
  sum of the inputs by the last residual alone (bounded by one step's quantization error).

Why hand-written: torch has no blockwise int4/int8 gradient codec for collectives (its DDP
quantization hook is per-tensor and fails on gloo: /work/shared/notes/models-data-cloud-facts.md),
and DeepSpeed's kernels are CUDA-only.
"""

from __future__ import annotations

import torch

QMAX = {8: 127, 4: 7}
BITS = {"int8": 8, "int4": 4}


def padded_length(numel: int, block: int) -> int:
    """``numel`` rounded up to whole blocks."""
    return -(-numel // block) * block


def quantize(rows: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``rows`` ([n, m], m a multiple of ``block``, any float dtype).

    Returns ``(payload, scales)``: uint8 [n, m * bits / 8] and float32 [n, m / block].
    """
    qmax = QMAX[bits]
    n, m = rows.shape
    blocks = rows.float().view(n, m // block, block)
    scales = blocks.abs().amax(dim=2) / qmax
    # An all-zero block has scale 0: divide by 1 instead (its values quantize to 0 either way).
    q = torch.round(blocks / torch.where(scales > 0, scales, 1.0).unsqueeze(2)).clamp_(-qmax, qmax)
    q = q.to(torch.int8).view(n, m)
    if bits == 8:
        return q.view(torch.uint8), scales
    nibbles = (q + 8).to(torch.uint8).view(n, m // 2, 2)  # [1, 15]
    return nibbles[..., 0] | (nibbles[..., 1] << 4), scales


def dequantize(payload: torch.Tensor, scales: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """The float32 rows [n, m] that ``quantize`` encoded as ``(payload, scales)``."""
    n = payload.shape[0]
    if bits == 8:
        q = payload.view(torch.int8).float()
    else:
        low, high = payload & 0x0F, payload >> 4
        q = torch.stack((low, high), dim=2).view(n, -1).float() - 8
    m = q.shape[1]
    return (q.view(n, m // block, block) * scales.unsqueeze(2)).view(n, m)


def pack_rows(payload: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Values and scales of each row in one uint8 row: what one all-to-all / all-gather sends."""
    return torch.cat((payload, scales.contiguous().view(torch.uint8)), dim=1)


def unpack_rows(packed: torch.Tensor, payload_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_rows`` undone: ``(payload, float32 scales)``."""
    return packed[:, :payload_bytes], packed[:, payload_bytes:].contiguous().view(torch.float32)


_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per value of ``x`` ([..., k], k a multiple of 8): 1 where ``x >= 0``."""
    bits = (x >= 0).to(torch.uint8).view(*x.shape[:-1], x.shape[-1] // 8, 8)
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(dim=-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """``pack_signs`` undone, as float32 +1/-1 ([..., 8 * k])."""
    bits = (packed.unsqueeze(-1) & _BIT_WEIGHTS.to(packed.device)) > 0
    return (bits.float() * 2 - 1).view(*packed.shape[:-1], packed.shape[-1] * 8)


class ErrorFeedback:
    """The residual one compressor carries from call to call, for one fixed layout.

    ``compensate(x)`` returns ``x + residual`` (float32); after compressing it, ``update(compensated,
    sent)`` keeps ``compensated - sent`` for the next call. A non-finite residual (an overflowed fp16
    step, a NaN loss: the step is skipped on every rank, docs/design.md Bad steps) is zeroed, or it
    would poison every later step.
    """

    def __init__(self) -> None:
        self.residual: torch.Tensor | None = None

    def compensate(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.residual is None or self.residual.shape != x.shape:  # first call, or a new layout
            self.residual = torch.zeros_like(x)
        return x + self.residual

    def update(self, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        self.residual = torch.nan_to_num_(compensated - sent, nan=0.0, posinf=0.0, neginf=0.0)
