"""An example user model family: a GPT-2-style model (LayerNorm, learned positions, GELU MLP).

Use it with ``model.family = "examples.posnorm_family:PosNormFamily"`` (the module must be importable
on the driver and on every rank: run from the repository root, or put it in a package of your own).
It shows the whole ``ModelFamily`` protocol (``meshmodels/family.py``); ``FamilyBase`` supplies the
parts this family does not need (no Hugging Face map, nothing tied, default loss and counts).

Rules a family follows: a stage keeps the *global* layer index in its parameter names, so any pipeline
split loads any checkpoint; ``build_stage`` creates parameters only (it runs on the meta device);
``init_tensor`` is a function of (seed, name) alone; under tensor parallelism the residual stream
between blocks and stages is sharded on the sequence dimension (sequence parallelism), which is
what the pipeline sends between stages.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshmodels.family import FamilyBase


@dataclass(frozen=True)
class PosNormShape:
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    ffn_dim: int
    init_std: float
    norm_eps: float


class Attention(nn.Module):
    def __init__(self, s: PosNormShape) -> None:
        super().__init__()
        self.head_dim = s.d_model // s.n_heads
        self.wq = nn.Linear(s.d_model, s.d_model)
        self.wk = nn.Linear(s.d_model, s.d_model)
        self.wv = nn.Linear(s.d_model, s.d_model)
        self.wo = nn.Linear(s.d_model, s.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, s: PosNormShape) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(s.d_model, eps=s.norm_eps)
        self.attn = Attention(s)
        self.ln_2 = nn.LayerNorm(s.d_model, eps=s.norm_eps)
        self.fc = nn.Linear(s.d_model, s.ffn_dim)
        self.proj = nn.Linear(s.ffn_dim, s.d_model)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.ln_1(x))
        return h + self.mlp(self.ln_2(h))


class Embeddings(nn.Module):
    """Token + learned position embeddings (replicated over tp; their output is cut into sequence shards)."""

    def __init__(self, s: PosNormShape) -> None:
        super().__init__()
        self.tok = nn.Embedding(s.vocab_size, s.d_model)
        self.pos = nn.Embedding(s.seq_len, s.d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))


class Stage(nn.Module):
    def __init__(self, s: PosNormShape, layers: range) -> None:
        super().__init__()
        self.embeddings = Embeddings(s) if layers.start == 0 else None
        self.layers = nn.ModuleDict({str(i): Block(s) for i in layers})
        last = layers.stop == s.n_layers
        self.norm = nn.LayerNorm(s.d_model, eps=s.norm_eps) if last else None
        self.output = nn.Linear(s.d_model, s.vocab_size, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(x) if self.embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


class PosNormFamily(FamilyBase):
    name = "posnorm"

    def shape(self, m) -> PosNormShape:
        return PosNormShape(n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, vocab_size=m.vocab_size,
                            seq_len=m.seq_len, ffn_dim=m.ffn_dim, init_std=m.init_std, norm_eps=m.norm_eps)

    def build_stage(self, shape: PosNormShape, layers: range, *, activation_checkpointing: bool = False) -> Stage:
        return Stage(shape, layers)

    def init_tensor(self, shape: PosNormShape, name: str, size: tuple[int, ...], seed: int) -> torch.Tensor:
        if name.endswith("bias"):
            return torch.zeros(size)
        if ".ln_" in name or name.startswith("norm."):
            return torch.ones(size)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(size, generator=gen) * shape.init_std

    def tp_plan(self, stage: Stage) -> dict[str, object]:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            PrepareModuleOutput,
            RowwiseParallel,
            SequenceParallel,
        )

        plan: dict[str, object] = {}
        if stage.embeddings is not None:
            # Every tp rank computes the (small) embeddings and keeps its sequence shard: no communication.
            plan["embeddings"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        if stage.output is not None:
            plan["norm"] = SequenceParallel()
            plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
        for i in stage.layers:
            p = f"layers.{i}."
            plan.update({
                p + "ln_1": SequenceParallel(),
                p + "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                p + "attn.wq": ColwiseParallel(), p + "attn.wk": ColwiseParallel(), p + "attn.wv": ColwiseParallel(),
                p + "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
                p + "ln_2": SequenceParallel(),
                # `mlp` is a method, not a module: `fc` gathers its sequence-sharded input itself.
                p + "fc": ColwiseParallel(input_layouts=Shard(1)),
                p + "proj": RowwiseParallel(output_layouts=Shard(1)),
            })  # fmt: skip
        return plan
