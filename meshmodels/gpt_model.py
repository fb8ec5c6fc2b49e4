"""The built-in GPT (llama-style: RMSNorm, RoPE, SwiGLU) and its pipeline stages.

A stage is the same ``GPT`` class holding a contiguous range of layers, with the embedding only on the
first stage and the final norm + head only on the last. Layers live in a ``ModuleDict`` keyed by their
*global* index, so every parameter keeps its full-model name (``layers.3.attention.wq.weight``) in
every stage split: checkpoints written by one pipeline layout load into any other.

Initialisation is a function of (seed, parameter name) only, so any stage on any rank builds exactly
the weights the single-process reference builds, without materialising the other stages.
"""

from __future__ import annotations

import math
import zlib
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 for norms, RoPE and the loss; fp64 stays fp64 (``train.dtype = "float64"``)."""
    return x if x.dtype == torch.float64 else x.float()


class ModelShape(Protocol):
    """What the model reads from the [model] config section."""

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    ffn_dim: int
    norm_eps: float
    init_std: float
    rope_theta: float


class RMSNorm(nn.Module):
    # Written out (rather than nn.RMSNorm) so it is plain elementwise math that DTensor's
    # sequence-parallel sharding propagates without a dedicated fused-op rule.
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [batch, seq, heads, head_dim]; rotate (even, odd) pairs.
    x1, x2 = upcast(x)[..., 0::2], upcast(x)[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelShape) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rope_theta = cfg.rope_theta
        # Computed on first use, not registered as buffers: stages are built on the meta device
        # (meshmodels/build.py), where a buffer would hold no values.
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].shape[0] < seq_len or self._rope[0].device != device:
            cos, sin = rope_tables(seq_len, self.head_dim, self.rope_theta)
            self._rope = (cos.to(device), sin.to(device))
        return self._rope[0][:seq_len], self._rope[1][:seq_len]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        # view(b, s, -1, hd) rather than n_heads: under TP each rank holds n_heads / tp heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        cos, sin = self.rope(s, x.device)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        # is_causal=True and no mask tensor: in bf16/fp16 on CUDA that lets SDPA pick the flash (or
        # memory-efficient) kernel; a mask would force the math path, which materialises the s x s
        # scores (tests/unit/test_gpu_path.py runs this with only the flash backend allowed).
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelShape) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelShape, activation_checkpointing: bool = False,
                 attention: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        # ``attention``: another family's attention with the same interface (meshmodels/llama_model.py).
        self.attention = (attention or Attention)(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        # Checkpointing inside forward (not a wrapper module) keeps parameter names unchanged, so a
        # checkpoint loads whether or not activation checkpointing is on.
        self.activation_checkpointing = activation_checkpointing

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class GPT(nn.Module):
    """The whole model (default) or one pipeline stage of it (``layers=range``, first/last flags)."""

    def __init__(
        self,
        cfg: ModelShape,
        layers: range | None = None,
        *,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        layers = range(cfg.n_layers) if layers is None else layers
        self.is_first = layers.start == 0
        self.is_last = layers.stop == cfg.n_layers
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model) if self.is_first else None
        self.layers = nn.ModuleDict(
            {str(i): Block(cfg, activation_checkpointing) for i in layers}
        )
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps) if self.is_last else None
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if self.is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [b, s] on the first stage, hidden states otherwise; logits on the last stage."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.output(self.norm(h))
        return h


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelShape, seed: int) -> None:
    """Initialise every parameter from (seed, its full name): identical on any stage split."""
    # GPT-2's scaled init for the projections that write into the residual stream.
    resid_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        std = resid_std if name.endswith(("wo.weight", "w2.weight")) else cfg.init_std
        gen = torch.Generator().manual_seed(param_seed(seed, name))
        param.copy_(torch.randn(param.shape, generator=gen) * std)


def build_stage(
    cfg: ModelShape, layers: range, seed: int, activation_checkpointing: bool = False
) -> GPT:
    model = GPT(cfg, layers, activation_checkpointing=activation_checkpointing)
    init_weights(model, cfg, seed)
    return model


def lm_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32; callers divide by the *global* token count."""
    return F.cross_entropy(
        upcast(logits).reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )

