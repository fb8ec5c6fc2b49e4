"""The ``llama`` family: Llama-architecture models shaped from a Hugging Face ``config.json``.

Covers ``LlamaForCausalLM`` (Llama 2/3.x, TinyLlama, SmolLM...), ``MistralForCausalLM`` without a
sliding window and ``Qwen2ForCausalLM`` (q/k/v bias) without one: GQA, an explicit ``head_dim``,
RMSNorm, SwiGLU, RoPE with the default or ``llama3`` frequencies, tied or untied embeddings. Anything
it cannot train exactly (another architecture or rope type, a sliding window, MoE, dropout, another
activation...) is refused with one line naming the field — never approximated.

RoPE rotates the two *halves* of each head, as Hugging Face does, so HF tensors map to ours by
renaming only: no q/k row permutation, which would fail on DTensor shards when the DP size does not
divide the head count (an uneven DP of 3, which elastic resizes produce). Modules: ``llama_model.py``;
this file stays free of torch so the driver can plan with it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from meshmodels.family import FamilyBase
from meshmodels.gpt import GPTFamily
from meshspeak.schema import ConfigError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
INIT_ROWS = 256  # random init is drawn in blocks of this many rows (see LlamaFamily.init_slice)
MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass(frozen=True)
class LlamaShape:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    seq_len: int
    norm_eps: float
    rope_theta: float
    rope_llama3: tuple[float, float, float, float] | None = None  # factor, low, high, original max positions
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    init_std: float = 0.02
    architecture: str = "LlamaForCausalLM"
    source_config: str = ""  # the config.json it came from (JSON text), the base of an export's config


class LlamaFamily(FamilyBase):
    name = "llama"

    # -- shape ------------------------------------------------------------------------------------
    def shape(self, m: Any) -> LlamaShape:
        """A Llama shaped by the [model] keys (MHA, untied): for tests and from-scratch runs."""
        return LlamaShape(n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, n_kv_heads=m.n_heads,
                          head_dim=m.d_model // m.n_heads, ffn_dim=m.ffn_dim, vocab_size=m.vocab_size,
                          seq_len=m.seq_len, norm_eps=m.norm_eps, rope_theta=m.rope_theta, init_std=m.init_std)

    def shape_from_hf(self, config: dict[str, Any], model_cfg: Any, source: str) -> LlamaShape:
        def refuse(field: str, why: str) -> ConfigError:
            return ConfigError("model.from_hf", f"model.from_hf: {source}: {field} = {json.dumps(config.get(field))}"
                                                f" {why}")

        archs = config.get("architectures")
        if archs is None and config.get("model_type") == "llama":
            archs = ["LlamaForCausalLM"]
        if not (isinstance(archs, list) and len(archs) == 1 and archs[0] in ARCHITECTURES):
            raise refuse("architectures", f"is not supported: the llama family trains exactly "
                                          f"{', '.join(ARCHITECTURES)}; use model.family for another architecture")
        arch = archs[0]
        for field in MOE_FIELDS:
            if config.get(field):
                raise refuse(field, "means a mixture of experts, which the llama family does not train")
        if arch == "Qwen2ForCausalLM":
            if config.get("use_sliding_window"):
                raise refuse("use_sliding_window", "is not supported (sliding-window attention): set it false")
            if any(t != "full_attention" for t in config.get("layer_types") or ()):
                raise refuse("layer_types", "has sliding-window layers, which the llama family does not train")
        elif config.get("sliding_window") is not None:
            raise refuse("sliding_window", "is not supported (sliding-window attention): use a model without it")
        if config.get("hidden_act", "silu") != "silu":
            raise refuse("hidden_act", 'is not supported: the llama family uses "silu" (SwiGLU)')
        for field in ("mlp_bias",):
            if config.get(field):
                raise refuse(field, "is not supported: use a model without MLP biases")
        if float(config.get("attention_dropout") or 0.0) != 0.0:
            raise refuse("attention_dropout", "is not supported: set it to 0.0")
        theta, llama3 = self._rope(config, refuse)

        def need(field: str, default: Any = None) -> Any:
            value = config.get(field, default)
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise refuse(field, "is missing or not a positive number: fix config.json")
            return value

        d, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv = int(need("num_key_value_heads", heads))
        head_dim = int(config.get("head_dim") or d // heads)
        if heads % kv:
            raise refuse("num_key_value_heads", f"does not divide num_attention_heads = {heads}: fix config.json")
        qwen = arch == "Qwen2ForCausalLM"
        bias = bool(config.get("attention_bias", False))
        return LlamaShape(
            n_layers=int(need("num_hidden_layers")), d_model=d, n_heads=heads, n_kv_heads=kv, head_dim=head_dim,
            ffn_dim=int(need("intermediate_size")), vocab_size=int(need("vocab_size")), seq_len=model_cfg.seq_len,
            norm_eps=float(need("rms_norm_eps", 1e-6)), rope_theta=theta, rope_llama3=llama3,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)), qkv_bias=qwen or bias,
            o_bias=bias and not qwen, init_std=model_cfg.init_std, architecture=arch,
            source_config=json.dumps(config, sort_keys=True),
        )

    @staticmethod
    def _rope(config: dict[str, Any], refuse) -> tuple[float, tuple[float, float, float, float] | None]:
        """(theta, llama3 parameters or None) from ``rope_parameters`` (transformers 5) or the legacy
        top-level ``rope_theta`` + ``rope_scaling``."""
        field = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
        params = dict(config.get(field) or {})
        if any(isinstance(v, dict) for v in params.values()):
            raise refuse(field, "sets RoPE per layer type, which the llama family does not train")
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in ROPE_TYPES:
            raise refuse(field, f"has rope_type {rope_type!r}: only {', '.join(ROPE_TYPES)} are trained exactly")
        factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        if factor not in (None, 1, 1.0):
            raise refuse("partial_rotary_factor", "is not supported: only full rotary embeddings are trained")
        theta = float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)
        if rope_type == "default":
            return theta, None
        params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
        missing = [k for k in LLAMA3_KEYS if not isinstance(params.get(k), (int, float))]
        if missing:
            raise refuse(field, f"has rope_type 'llama3' without {missing[0]}: fix config.json")
        return theta, tuple(float(params[k]) for k in LLAMA3_KEYS)

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
        return GPTFamily().tp_plan(stage)  # the same module names; q/k/v split by (KV) heads

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
        config = json.loads(s.source_config) if s.source_config else {}
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": s.rope_theta}
        if s.rope_llama3:
            rope = {"rope_type": "llama3", "rope_theta": s.rope_theta, **dict(zip(LLAMA3_KEYS, s.rope_llama3))}
            rope["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
        for legacy in ("rope_scaling", "rope_theta"):
            config.pop(legacy, None)  # transformers 5 reads rope_parameters; two sources could disagree
        config.update({
            "architectures": [s.architecture], "model_type": ARCHITECTURES[s.architecture],
            "vocab_size": s.vocab_size, "hidden_size": s.d_model, "intermediate_size": s.ffn_dim,
            "num_hidden_layers": s.n_layers, "num_attention_heads": s.n_heads, "num_key_value_heads": s.n_kv_heads,
            "head_dim": s.head_dim, "hidden_act": "silu", "rms_norm_eps": s.norm_eps, "rope_parameters": rope,
            "tie_word_embeddings": s.tie_embeddings, "dtype": "float32",
        })  # fmt: skip
        config.setdefault("max_position_embeddings", max(s.seq_len, 2048))
        if s.architecture != "Qwen2ForCausalLM":
            config["attention_bias"] = s.o_bias
        config.pop("torch_dtype", None)
        return config


# (our name, Hugging Face name): renaming only. {i} is a layer index, {w} "weight" or "bias".
_RENAMES = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention.wq.{w}", "model.layers.{i}.self_attn.q_proj.{w}"),
    ("layers.{i}.attention.wk.{w}", "model.layers.{i}.self_attn.k_proj.{w}"),
    ("layers.{i}.attention.wv.{w}", "model.layers.{i}.self_attn.v_proj.{w}"),
    ("layers.{i}.attention.wo.{w}", "model.layers.{i}.self_attn.o_proj.{w}"),
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
