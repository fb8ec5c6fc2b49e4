"""The ``llama`` family: Llama-architecture models shaped from a Hugging Face ``config.json``.

Covers ``LlamaForCausalLM`` (Llama 2/3.x, TinyLlama, SmolLM...), ``MistralForCausalLM``,
``Qwen2ForCausalLM`` (q/k/v bias) and ``Qwen3ForCausalLM`` (per-head q/k RMSNorm): GQA, an explicit
``head_dim``, RMSNorm, SwiGLU, RoPE with the default or ``llama3`` frequencies, tied or untied
embeddings, sliding-window attention on the layers the config names. Which fields are read, and the
refusal of anything it cannot train exactly (another architecture or rope type, MoE, dropout, another
activation...) with one line naming the field: ``llama_config.py``.

RoPE rotates the two *halves* of each head, as Hugging Face does, so HF tensors map to ours by
renaming only: no q/k row permutation, which would fail on DTensor shards when the DP size does not
divide the head count (an uneven DP of 3, which elastic resizes produce). Modules: ``llama_model.py``;
this file stays free of torch so the driver can plan with it.
"""

from __future__ import annotations

import re
from typing import Any

from meshmodels.family import FamilyBase
from meshmodels.gpt import GPTFamily
from meshmodels.llama_config import ARCHITECTURES, LlamaShape, config_of, shape_from_config
from meshspeak.schema import ConfigError

__all__ = ["ARCHITECTURES", "INIT_ROWS", "LlamaFamily", "LlamaShape"]
INIT_ROWS = 256  # random init is drawn in blocks of this many rows (see LlamaFamily.init_slice)


class LlamaFamily(FamilyBase):
    name = "llama"

    # -- shape ------------------------------------------------------------------------------------
    def shape(self, m: Any) -> LlamaShape:
        """A Llama shaped by the [model] keys (MHA, untied): for tests and from-scratch runs."""
        return LlamaShape(n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, n_kv_heads=m.n_heads,
                          head_dim=m.d_model // m.n_heads, ffn_dim=m.ffn_dim, vocab_size=m.vocab_size,
                          seq_len=m.seq_len, norm_eps=m.norm_eps, rope_theta=m.rope_theta, init_std=m.init_std)

    def shape_from_hf(self, config: dict[str, Any], model_cfg: Any, source: str) -> LlamaShape:
        return shape_from_config(config, model_cfg, source)

    def check_mesh(self, shape: LlamaShape, tp: int) -> None:
        what = "model.from_hf" if shape.source_config else "model.n_heads"
        for field, size in (("num_attention_heads", shape.n_heads), ("num_key_value_heads", shape.n_kv_heads),
                            ("vocab_size", shape.vocab_size), ("intermediate_size", shape.ffn_dim)):
            if size % tp:
                raise ConfigError("mesh.tp", f"mesh.tp={tp} does not divide the model's {field} = {size} "
                                             f"({what}): tensor parallelism splits them; choose a tp that divides "
                                             f"{size}")

    def param_counts(self, s: LlamaShape) -> dict[str, int]:
        d, q, kv = s.d_model, s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if s.qkv_bias else 0) + (d if s.o_bias else 0)
        attn += 2 * s.head_dim if s.qk_norm else 0
        layer = attn + 3 * d * s.ffn_dim + 2 * d
        embed = s.vocab_size * d
        head = d + embed  # final norm + output (a tied head's copy of the embedding on its own stage)
        total = embed + s.n_layers * layer + d + (0 if s.tie_embeddings else embed)
        return {"embed": embed, "layer": layer, "head": head, "total": total,
                "tied": embed if s.tie_embeddings else 0}

    # -- modules ----------------------------------------------------------------------------------
    def build_stage(self, shape: LlamaShape, layers: range, *, activation_checkpointing: bool = False) -> Any:
        from meshmodels.llama_model import LlamaStage

        return LlamaStage(shape, layers, activation_checkpointing=activation_checkpointing)

    def init_tensor(self, shape: LlamaShape, name: str, size: tuple[int, ...], seed: int) -> Any:
        return self.init_slice(shape, name, size, seed, tuple(slice(0, n) for n in size))

    def init_slice(self, shape: LlamaShape, name: str, size: tuple[int, ...], seed: int,
                   slices: tuple[slice, ...]) -> Any:
        """``init_tensor(...)[slices]`` without making the full tensor: weights are drawn in blocks of
        ``INIT_ROWS`` rows, each from its own (seed, name, block) generator, so a rank draws only the
        blocks its shard overlaps (its peak is its shard plus two blocks, not the whole embedding)."""
        import torch

        from meshmodels.gpt_model import param_seed

        local = tuple(sl.stop - sl.start for sl in slices)
        if name.endswith("norm.weight"):
            return torch.ones(local)
        if name.endswith(".bias"):
            return torch.zeros(local)
        start, stop = slices[0].start, slices[0].stop
        if stop <= start:
            return torch.empty(local)
        first, last = start // INIT_ROWS, (stop - 1) // INIT_ROWS
        blocks = []
        for b in range(first, last + 1):
            rows = min(INIT_ROWS, size[0] - b * INIT_ROWS)
            gen = torch.Generator().manual_seed(param_seed(seed, f"{name}#{b}"))
            blocks.append(torch.randn((rows, *size[1:]), generator=gen)[(slice(None), *slices[1:])])
        offset = first * INIT_ROWS
        return torch.cat(blocks)[start - offset:stop - offset].mul_(shape.init_std)

    def tp_plan(self, stage: Any) -> dict[str, Any]:
        """The GPT's plan (the same module names; q/k/v split by (KV) heads), and Qwen3's q/k norms.

        A q/k norm's weight (head_dim) is replicated over tp while each rank normalises its own heads:
        ``SequenceParallel`` over the heads dim (2 of [b, s, heads, head_dim]) makes it a replicated
        DTensor fed a heads-sharded input, so its gradient, a partial sum per rank, is all-reduced
        over tp (transformers' plan calls it "replicated_with_grad_allreduce").
        """
        from torch.distributed.tensor.parallel import SequenceParallel

        plan = GPTFamily().tp_plan(stage)
        for index, block in stage.layers.items():
            if getattr(block.attention, "q_norm", None) is not None:
                for norm in ("q_norm", "k_norm"):
                    plan[f"layers.{index}.attention.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        return plan

    def tied_parameters(self, shape: LlamaShape) -> tuple[str, ...]:
        return ("tok_embeddings.weight",) if shape.tie_embeddings else ()

    # -- Hugging Face -----------------------------------------------------------------------------
    def hf_tensors(self, s: LlamaShape) -> dict[str, tuple[int, ...]]:
        d, q, kv, f = s.d_model, s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.ffn_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab_size, d)}
        for i in range(s.n_layers):
            p = f"model.layers.{i}."
            out.update({p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                        p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q)})
            if s.qkv_bias:
                out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                            p + "self_attn.v_proj.bias": (kv,)})
            if s.o_bias:
                out[p + "self_attn.o_proj.bias"] = (d,)
            if s.qk_norm:
                out.update({p + "self_attn.q_norm.weight": (s.head_dim,), p + "self_attn.k_norm.weight": (s.head_dim,)})
            out.update({p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                        p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
                        p + "post_attention_layernorm.weight": (d,)})
        out["model.norm.weight"] = (d,)
        if not s.tie_embeddings:
            out["lm_head.weight"] = (s.vocab_size, d)
        return out

    def hf_ignorable(self, s: LlamaShape) -> frozenset[str]:
        """HF tensors that may be present but are not parameters (a tied model's redundant head)."""
        return frozenset({"lm_head.weight"} if s.tie_embeddings else ())

    def to_hf(self, name: str) -> str:
        hf = _rename(name, _TO_HF)
        if hf is None:
            raise KeyError(f"llama family: no Hugging Face name for parameter {name!r}")
        return hf

    def from_hf(self, hf_name: str) -> str:
        ours = _rename(hf_name, _FROM_HF)
        if ours is None:
            raise KeyError(f"llama family: no parameter for Hugging Face tensor {hf_name!r}")
        return ours

    def hf_config(self, s: LlamaShape) -> dict[str, Any]:
        return config_of(s)


# (our name, Hugging Face name): renaming only. {i} is a layer index, {w} "weight" or "bias".
_RENAMES = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention.wq.{w}", "model.layers.{i}.self_attn.q_proj.{w}"),
    ("layers.{i}.attention.wk.{w}", "model.layers.{i}.self_attn.k_proj.{w}"),
    ("layers.{i}.attention.wv.{w}", "model.layers.{i}.self_attn.v_proj.{w}"),
    ("layers.{i}.attention.wo.{w}", "model.layers.{i}.self_attn.o_proj.{w}"),
    ("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
]


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{w\}", r"(?P<w>weight|bias)"))


_TO_HF = [(_pattern(ours), theirs) for ours, theirs in _RENAMES]
_FROM_HF = [(_pattern(theirs), ours) for ours, theirs in _RENAMES]


def _rename(name: str, table: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, template in table:
        match = pattern.fullmatch(name)
        if match:
            return template.format(**match.groupdict())
    return None
