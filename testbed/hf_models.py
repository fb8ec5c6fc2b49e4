"""Tiny Hugging Face models built offline (``transformers`` is the oracle, test extra only).

``save_tiny_llama(directory, **variant)`` builds a random ``LlamaForCausalLM`` (or ``Qwen2``/``Qwen3``/
``MistralForCausalLM``: ``arch=``) from its config class (no download), *perturbs* every weight —
norm weights away from 1, a larger init scale, non-zero biases — so that a wrong name mapping, a wrong
RoPE layout, a wrong GQA grouping or a window one token off moves the logits by far more than 1e-3,
and saves it with ``save_pretrained``. ``window=W`` gives Mistral a sliding window, and Qwen2/Qwen3
``use_sliding_window`` with ``max_window_layers=window_from`` (or an explicit ``layer_types``).
``hf_step_loss`` is transformers' loss on the batch a run trains on at a given step.
"""

from __future__ import annotations

from typing import Any

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def tiny_config(*, arch: str = "llama", tie: bool = False, llama3: bool = False, bias: bool = False,
                layers: int = 2, vocab: int = 256, hidden: int = 64, heads: int = 4, kv: int = 2,
                inter: int = 96, head_dim: int | None = None, legacy_rope: bool = False, window: int | None = None,
                window_from: int = 0, layer_types: list[str] | None = None) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    kwargs: dict[str, Any] = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                  tie_word_embeddings=tie, rms_norm_eps=1e-5, max_position_embeddings=128,
                                  bos_token_id=1, eos_token_id=2)
    if head_dim:
        kwargs["head_dim"] = head_dim
    rope = dict(LLAMA3_ROPE) if llama3 else {"rope_type": "default", "rope_theta": 10000.0}
    if legacy_rope:
        kwargs["rope_theta"] = rope.pop("rope_theta")
        if llama3:
            kwargs["rope_scaling"] = rope
    else:
        kwargs["rope_parameters"] = rope
    if arch == "mistral":
        return MistralConfig(sliding_window=window, **kwargs)
    if arch in ("qwen2", "qwen3"):
        kwargs.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=window_from,
                      layer_types=layer_types)
        if arch == "qwen3":
            kwargs.setdefault("head_dim", hidden // heads)
            return Qwen3Config(attention_bias=bias, **kwargs)
        return Qwen2Config(**kwargs)
    return LlamaConfig(attention_bias=bias, **kwargs)


def build_tiny(config: Any, seed: int = 0) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.5 * noise)
            else:
                param.copy_(0.1 * noise)
    return model.eval()


def save_tiny_llama(directory: str, seed: int = 0, max_shard_size: str | None = None, **variant: Any) -> Any:
    """Build, perturb and ``save_pretrained`` a tiny model into ``directory``; returns the model."""
    model = build_tiny(tiny_config(**variant), seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return model


def hf_step_loss(model: Any, cfg: Any, step: int) -> float:
    """``model``'s (transformers') mean loss on the global batch a run of ``cfg`` trains on at ``step``."""
    import torch

    import meshdata as data_lib

    seq_len, batch = cfg.model.seq_len, cfg.train.global_batch_size
    source = data_lib.open_source(cfg.data.path)
    ids = data_lib.global_sample_ids(step, batch, cfg.train.seed, source.num_samples(seq_len))
    x, y = data_lib.microbatch_tokens(source, ids, seq_len)
    with torch.no_grad():
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        return model.eval()(input_ids=x, labels=y, shift_labels=y).loss.item()
