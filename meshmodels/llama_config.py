"""The ``llama`` family's Hugging Face ``config.json``: what it trains exactly, read and written (no torch).

Architectures: ``LlamaForCausalLM`` (Llama 2/3.x, TinyLlama, SmolLM...), ``MistralForCausalLM``,
``Qwen2ForCausalLM`` (q/k/v bias) and ``Qwen3ForCausalLM`` (RMSNorm over each head's q and k before
RoPE, an explicit ``head_dim``). Where a field is absent the shape takes the value transformers' own
config class would (Qwen3's ``head_dim`` 128, Mistral's ``sliding_window`` 4096...), so a
hand-written config.json means here what it means to ``from_pretrained``.

Sliding-window attention, as transformers applies it: with window W a query at position i sees the
keys j with ``i - W < j <= i`` (itself and the W - 1 before it; ``masking_utils.sliding_window_overlay``).
Mistral uses it on every layer when ``sliding_window`` is set. Qwen2/Qwen3 use it only with
``use_sliding_window``, on the layers ``layer_types`` marks ``"sliding_attention"`` — when
``layer_types`` is absent, transformers marks the layers from index ``max_window_layers`` on. Whatever
cannot be trained exactly (MoE, another rope type or activation, dropout...) is a ``ConfigError``
naming the field (exit 2), never approximated.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshspeak.schema import ConfigError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}
QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers 5's defaults for fields a config.json may leave out (its config classes).
DEFAULT_HEAD_DIM = {"Qwen3ForCausalLM": 128}
DEFAULT_WINDOW = 4096
DEFAULT_MAX_WINDOW_LAYERS = 28

Refuse = Callable[[str, str], ConfigError]


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
    qk_norm: bool = False  # Qwen3: RMSNorm (weight of head_dim) over each head's q and k, before RoPE
    sliding_window: int = 0  # W: a sliding layer's query sees itself and the W - 1 tokens before it
    sliding_layers: tuple[int, ...] = ()  # the (global) layers that use the window; the others see all
    init_std: float = 0.02
    architecture: str = "LlamaForCausalLM"
    source_config: str = ""  # the config.json it came from (JSON text), the base of an export's config

    def window_of(self, layer: int) -> int:
        """Layer ``layer``'s sliding window, 0 for full causal attention."""
        return self.sliding_window if layer in self.sliding_layers else 0


def shape_from_config(config: dict[str, Any], model_cfg: Any, source: str) -> LlamaShape:
    """The shape ``config`` (a config.json) describes, at ``model_cfg.seq_len``.

    Raises:
        ConfigError: (key ``model.from_hf``) naming the first field that cannot be trained exactly.
    """
    def refuse(field: str, why: str) -> ConfigError:
        return ConfigError("model.from_hf", f"model.from_hf: {source}: {field} = {json.dumps(config.get(field))}"
                                            f" {why}")

    def need(field: str, default: Any = None) -> Any:
        value = config.get(field, default)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise refuse(field, "is missing or not a positive number: fix config.json")
        return value

    arch = _architecture(config, refuse)
    _refuse_untrainable(config, refuse)
    theta, llama3 = _rope(config, refuse)
    d, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    kv = int(need("num_key_value_heads", heads))
    # An absent head_dim is hidden_size / heads, except where the config class has its own default (Qwen3: 128).
    explicit = config.get("head_dim") is not None or arch in DEFAULT_HEAD_DIM
    head_dim = int(need("head_dim", DEFAULT_HEAD_DIM.get(arch))) if explicit else d // heads
    if heads % kv:
        raise refuse("num_key_value_heads", f"does not divide num_attention_heads = {heads}: fix config.json")
    n_layers = int(need("num_hidden_layers"))
    window, sliding = _windows(config, arch, n_layers, refuse)
    qkv_bias, o_bias = _biases(config, arch)
    return LlamaShape(
        n_layers=n_layers, d_model=d, n_heads=heads, n_kv_heads=kv, head_dim=head_dim,
        ffn_dim=int(need("intermediate_size")), vocab_size=int(need("vocab_size")), seq_len=model_cfg.seq_len,
        norm_eps=float(need("rms_norm_eps", 1e-6)), rope_theta=theta, rope_llama3=llama3,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), qkv_bias=qkv_bias, o_bias=o_bias,
        qk_norm=arch == "Qwen3ForCausalLM", sliding_window=window, sliding_layers=sliding,
        init_std=model_cfg.init_std, architecture=arch, source_config=json.dumps(config, sort_keys=True),
    )


def _architecture(config: dict[str, Any], refuse: Refuse) -> str:
    archs = config.get("architectures")
    by_type = {model_type: arch for arch, model_type in ARCHITECTURES.items()}
    if archs is None and config.get("model_type") in by_type:
        archs = [by_type[config["model_type"]]]
    if not (isinstance(archs, list) and len(archs) == 1 and archs[0] in ARCHITECTURES):
        raise refuse("architectures", f"is not supported: the llama family trains exactly "
                                      f"{', '.join(ARCHITECTURES)}; use model.family for another architecture")
    return archs[0]


def _refuse_untrainable(config: dict[str, Any], refuse: Refuse) -> None:
    """Fields any of the architectures may carry that the family cannot train exactly."""
    for field in MOE_FIELDS:
        if config.get(field):
            raise refuse(field, "means a mixture of experts, which the llama family does not train")
    if config.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", 'is not supported: the llama family uses "silu" (SwiGLU)')
    if config.get("mlp_bias"):
        raise refuse("mlp_bias", "is not supported: use a model without MLP biases")
    if float(config.get("attention_dropout") or 0.0) != 0.0:
        raise refuse("attention_dropout", "is not supported: set it to 0.0")


def _biases(config: dict[str, Any], arch: str) -> tuple[bool, bool]:
    """(q/k/v bias, o bias) as transformers builds each architecture: Qwen2 always has q/k/v bias and
    no o bias, Mistral never a bias (it does not read ``attention_bias``), the others all four or none."""
    if arch == "Qwen2ForCausalLM":
        return True, False
    if arch == "MistralForCausalLM":
        return False, False
    bias = bool(config.get("attention_bias", False))
    return bias, bias


def _windows(config: dict[str, Any], arch: str, n_layers: int, refuse: Refuse) -> tuple[int, tuple[int, ...]]:
    """(window, the layers that use it) as transformers decides them (module docstring); (0, ()) for none."""
    if arch == "MistralForCausalLM":
        window = config.get("sliding_window", DEFAULT_WINDOW)
        types = ["full_attention" if window is None else "sliding_attention"] * n_layers
        if config.get("layer_types") not in (None, types):
            raise refuse("layer_types", "is not read by MistralForCausalLM (sliding_window applies to every "
                                        "layer): remove it, or use a model whose architecture reads it")
    elif arch in QWEN:
        window = config.get("sliding_window", DEFAULT_WINDOW) if config.get("use_sliding_window") else None
        types = config.get("layer_types")
        if types is None:
            first = config.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
            if isinstance(first, bool) or not isinstance(first, int):
                raise refuse("max_window_layers", "is not an integer: fix config.json")
            types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                     for i in range(n_layers)]
    else:
        if config.get("sliding_window") is not None:
            raise refuse("sliding_window", "is not read by LlamaForCausalLM (no sliding-window attention): remove "
                                           "it, or set architectures to a model that has one (MistralForCausalLM)")
        window, types = None, config.get("layer_types") or ["full_attention"] * n_layers
    if not (isinstance(types, list) and len(types) == n_layers and all(t in LAYER_TYPES for t in types)):
        raise refuse("layer_types", f"must list one of {', '.join(LAYER_TYPES)} per layer ({n_layers} layers): "
                                    "other attention types are not trained; fix config.json")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not sliding:
        return 0, ()
    if window is None:
        raise refuse("layer_types", "has sliding_attention layers but no window (use_sliding_window is false or "
                                    "sliding_window null; transformers cannot run it either): fix config.json")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise refuse("sliding_window", "is not a positive integer: fix config.json")
    return window, sliding


def _rope(config: dict[str, Any], refuse: Refuse) -> tuple[float, tuple[float, float, float, float] | None]:
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


def config_of(s: LlamaShape) -> dict[str, Any]:
    """The config.json an export writes for ``s``: its source config with every field the shape
    decides written from the shape (so the two cannot disagree)."""
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
        "tie_word_embeddings": s.tie_embeddings, "dtype": "float32", **_window_fields(s),
    })  # fmt: skip
    config.setdefault("max_position_embeddings", max(s.seq_len, 2048))
    if s.architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        config["attention_bias"] = s.o_bias
    config.pop("torch_dtype", None)
    return config


def _window_fields(s: LlamaShape) -> dict[str, Any]:
    window = s.sliding_window or None
    if s.architecture == "MistralForCausalLM":
        return {"sliding_window": window}
    if s.architecture in QWEN:
        types = ["sliding_attention" if i in s.sliding_layers else "full_attention" for i in range(s.n_layers)]
        return {"use_sliding_window": bool(s.sliding_layers), "sliding_window": window, "layer_types": types}
    return {}
