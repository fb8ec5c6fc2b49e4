"""What the llama family reads from a config.json and what it refuses (meshmodels/llama_config.py), pure.

The numbers themselves are checked against transformers in test_llama_hf.py; here: transformers'
defaults for absent fields (Qwen3's head_dim 128, Mistral's window 4096, Qwen's max_window_layers 28),
which layers slide, and one ConfigError naming the field for what cannot be trained exactly.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from meshmodels.llama_config import shape_from_config
from meshspeak.schema import ConfigError

MODEL = SimpleNamespace(seq_len=32, init_std=0.02)
BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
        "intermediate_size": 96, "vocab_size": 256}


def shape(arch: str, **fields):
    return shape_from_config({**BASE, "architectures": [arch], **fields}, MODEL, "config.json")


def test_qwen3_defaults_and_fields() -> None:
    s = shape("Qwen3ForCausalLM")
    assert (s.head_dim, s.qk_norm, s.qkv_bias, s.o_bias, s.sliding_layers) == (128, True, False, False, ())
    s = shape("Qwen3ForCausalLM", head_dim=32, attention_bias=True)
    assert (s.head_dim, s.qkv_bias, s.o_bias) == (32, True, True)
    assert shape("LlamaForCausalLM").head_dim == 16 and not shape("LlamaForCausalLM").qk_norm
    assert shape_from_config({**BASE, "model_type": "qwen3"}, MODEL, "x").architecture == "Qwen3ForCausalLM"


@pytest.mark.parametrize(
    ("arch", "fields", "window", "layers"),
    [
        ("MistralForCausalLM", {}, 4096, (0, 1, 2, 3)),  # transformers' default window when the field is absent
        ("MistralForCausalLM", {"sliding_window": None}, 0, ()),
        ("MistralForCausalLM", {"sliding_window": 8}, 8, (0, 1, 2, 3)),
        ("Qwen2ForCausalLM", {"sliding_window": 8}, 0, ()),  # use_sliding_window false: no window
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8}, 0, ()),  # max_window_layers 28
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, 8, (1, 2, 3)),
        ("Qwen3ForCausalLM", {"use_sliding_window": True, "max_window_layers": 3}, 4096, (3,)),
        ("Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0,
                              "layer_types": ["full_attention", "sliding_attention"] * 2}, 8, (1, 3)),
    ],
)
def test_which_layers_slide(arch, fields, window, layers) -> None:
    s = shape(arch, **fields)
    assert (s.sliding_window, s.sliding_layers) == (window, layers)
    assert [s.window_of(i) for i in range(4)] == [window if i in layers else 0 for i in range(4)]


@pytest.mark.parametrize(
    ("arch", "fields", "needles"),
    [
        ("Qwen3ForCausalLM", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, ["rope_parameters", "yarn"]),
        ("Qwen3ForCausalLM", {"num_experts": 8}, ["num_experts", "mixture of experts"]),
        ("Qwen3ForCausalLM", {"attention_dropout": 0.1}, ["attention_dropout", "0.0"]),
        ("Qwen3ForCausalLM", {"hidden_act": "gelu"}, ["hidden_act", "silu"]),
        ("Qwen3ForCausalLM", {"head_dim": None}, ["head_dim", "missing"]),
        ("Qwen3ForCausalLM", {"layer_types": ["chunked_attention"] * 4}, ["layer_types", "chunked_attention"]),
        ("Qwen3ForCausalLM", {"layer_types": ["full_attention"] * 3}, ["layer_types", "4 layers"]),
        ("Qwen3ForCausalLM", {"layer_types": ["sliding_attention"] * 4}, ["layer_types", "no window"]),
        ("Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 0, "max_window_layers": 0},
         ["sliding_window", "positive integer"]),
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": "2"}, ["max_window_layers"]),
        ("MistralForCausalLM", {"sliding_window": 8, "layer_types": ["full_attention"] * 4},
         ["layer_types", "MistralForCausalLM"]),
        ("LlamaForCausalLM", {"sliding_window": 8}, ["sliding_window", "MistralForCausalLM"]),
        ("Qwen3MoeForCausalLM", {}, ["architectures", "Qwen3ForCausalLM"]),
    ],
)
def test_what_cannot_be_trained_is_one_error_naming_the_field(arch, fields, needles) -> None:
    with pytest.raises(ConfigError) as err:
        shape(arch, **fields)
    assert err.value.key == "model.from_hf"
    message = str(err.value)
    assert "\n" not in message and message.startswith("model.from_hf: config.json: ")
    for needle in needles:
        assert needle in message, message
