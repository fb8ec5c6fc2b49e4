"""The llama family's modules (see ``llama.py``): GQA attention with half-rotation RoPE, SwiGLU, tied head.

Names follow the built-in GPT (``tok_embeddings``, ``layers.<i>.attention.wq``, ``feed_forward.w1``,
``norm``, ``output``), so the GPT's tensor-parallel plan applies unchanged; ``llama.py`` renames them
to Hugging Face names. The math follows transformers' ``LlamaForCausalLM`` operation for operation
(RMSNorm in fp32, ``rotate_half``, ``repeat_kv``), which is what the logits-equality tests check.

Qwen3's q/k norms (``attention.q_norm``/``k_norm``) normalise each head's q and k before RoPE; their
weight is replicated over tp (the family's plan all-reduces its gradient). A layer with a sliding
window attends through SDPA with the banded causal mask ``sliding_causal_mask`` when the sequence is
longer than the window, and exactly as a full-attention layer (``is_causal``) otherwise.

Tied embeddings: there is no ``output`` module; the last stage computes logits with
``tok_embeddings.weight``. With pp > 1 the last stage holds its own ``tok_embeddings`` (same name, so
a checkpoint keeps one tensor) and the runtime sums the two copies' gradients each step
(``workers/tied.py``). Under TP the weight is vocab-sharded, so the logits are computed
vocab-sharded and gathered, as ``ColwiseParallel(output_layouts=Replicate())`` does for ``output``.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshmodels.gpt_model import Block as GPTBlock
from meshmodels.gpt_model import RMSNorm

if TYPE_CHECKING:  # annotations only: the family (meshmodels/llama.py) imports this module to build
    from meshmodels.llama_config import LlamaShape


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def sliding_causal_mask(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """[seq, seq] bool, True where query i may see key j: ``i - window < j <= i`` (itself and the
    ``window - 1`` tokens before it, as transformers' ``sliding_window_overlay``). A mask of the same
    form (True = attend) can be and-ed with it, e.g. one that keeps attention within a document."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    return (j <= i) & (j > i - window)


class Attention(nn.Module):
    def __init__(self, s: LlamaShape, window: int = 0) -> None:
        super().__init__()
        self.head_dim = s.head_dim
        self.window = window  # 0: full causal attention; else the sliding window (sliding_causal_mask)
        self.n_rep = s.n_heads // s.n_kv_heads
        self.wq = nn.Linear(s.d_model, s.n_heads * s.head_dim, bias=s.qkv_bias)
        self.wk = nn.Linear(s.d_model, s.n_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.wv = nn.Linear(s.d_model, s.n_kv_heads * s.head_dim, bias=s.qkv_bias)
        self.wo = nn.Linear(s.n_heads * s.head_dim, s.d_model, bias=s.o_bias)
        # Qwen3: RMSNorm over each head's q and k (a weight of head_dim, shared by the heads) before RoPE.
        self.q_norm = RMSNorm(s.head_dim, s.norm_eps) if s.qk_norm else None
        self.k_norm = RMSNorm(s.head_dim, s.norm_eps) if s.qk_norm else None
        self.rope_theta, self.rope_llama3 = s.rope_theta, s.rope_llama3
        # Computed on first use, not buffers: stages are built on the meta device.
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._mask: torch.Tensor | None = None

    def rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].shape[0] < seq_len or self._rope[0].device != device:
            inv_freq = llama3_inv_freq(self.head_dim, self.rope_theta, self.rope_llama3)
            freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._rope = (emb.cos().to(device), emb.sin().to(device))
        return self._rope[0][:seq_len], self._rope[1][:seq_len]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        # -1 heads: under TP each rank holds n_heads / tp query and n_kv_heads / tp KV heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = self.rope(s, x.device)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.n_rep > 1:  # transformers' repeat_kv: KV head j serves query heads j*n_rep .. j*n_rep+n_rep-1
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        if self.window and s > self.window:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.sliding_mask(s, q.device))
        else:  # no window, or a sequence no longer than it: the window hides nothing (and SDPA may use flash)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def sliding_mask(self, seq_len: int, device: torch.device) -> torch.Tensor:
        if self._mask is None or self._mask.shape[0] != seq_len or self._mask.device != device:
            self._mask = sliding_causal_mask(seq_len, self.window, device)
        return self._mask


class Block(GPTBlock):
    """The built-in pre-norm SwiGLU block (same module names) with Llama's attention; ``layer`` (its
    global index) decides whether it uses the sliding window."""

    def __init__(self, s: LlamaShape, layer: int, activation_checkpointing: bool = False) -> None:
        super().__init__(s, activation_checkpointing, attention=functools.partial(Attention, window=s.window_of(layer)))


def tied_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``h @ weight.T`` for a head tied to the (possibly TP vocab-sharded) embedding weight."""
    if not isinstance(weight, DTensor):
        return F.linear(h, weight)
    mesh = weight.device_mesh
    if not isinstance(h, DTensor):  # sequence-parallel activations: the local sequence shard
        h = DTensor.from_local(h, mesh, [Shard(1)])
    logits = F.linear(h.redistribute(mesh, [Replicate()]), weight)  # vocab-sharded
    return logits.redistribute(mesh, [Replicate()]).to_local()


class LlamaStage(nn.Module):
    """The whole model (all layers) or one pipeline stage of it."""

    def __init__(self, s: LlamaShape, layers: range, *, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.is_first, self.is_last = layers.start == 0, layers.stop == s.n_layers
        holds_embedding = self.is_first or (self.is_last and s.tie_embeddings)
        self.tok_embeddings = nn.Embedding(s.vocab_size, s.d_model) if holds_embedding else None
        self.layers = nn.ModuleDict({str(i): Block(s, i, activation_checkpointing) for i in layers})
        self.norm = RMSNorm(s.d_model, s.norm_eps) if self.is_last else None
        untied_head = self.is_last and not s.tie_embeddings
        self.output = nn.Linear(s.d_model, s.vocab_size, bias=False) if untied_head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [b, s] on the first stage, hidden states otherwise; logits on the last stage."""
        h = self.tok_embeddings(x) if self.is_first else x
        for layer in self.layers.values():
            h = layer(h)
        if self.is_last:
            h = self.norm(h)
            h = self.output(h) if self.output is not None else tied_logits(h, self.tok_embeddings.weight)
        return h


def llama3_inv_freq(head_dim: int, theta: float, llama3: tuple[float, float, float, float] | None):
    """RoPE inverse frequencies as transformers computes them (default, or ``llama3`` rescaled)."""
    import torch

    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    if llama3 is None:
        return inv
    factor, low, high, old = llama3
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
