"""CPU checks of the GPU path's speed basics: flash-eligible attention, optimizer kernel choice, TF32."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from orchestrator.config import load_config
from workers.model import build_stage
from workers.optim import build_optimizer


def test_causal_attention_calls_sdpa_the_way_the_cuda_flash_kernel_accepts(monkeypatch):
    """The CUDA flash kernel takes no mask tensor (only is_causal), no dropout, 16-bit q/k/v with
    unit last stride and head_dim a multiple of 8 up to 256. The CPU build cannot ask CUDA's
    selector, so the call's arguments are checked against those rules, and the block also runs with
    only the flash backend allowed (the CPU's flash kernel)."""
    import torch.nn.functional as F

    cfg = load_config(None, ["model.d_model=64", "model.n_heads=4", "model.seq_len=32", "model.n_layers=1"])
    model = build_stage(cfg.model, range(1), seed=0).to(torch.bfloat16)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        seen.append((q, k, v, attn_mask, dropout_p, is_causal))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        model(tokens).float().sum().backward()
    (q, k, v, mask, dropout, causal), = seen
    assert mask is None and causal is True and dropout == 0.0
    for t in (q, k, v):
        assert t.dtype == torch.bfloat16 and t.stride(-1) == 1
        assert t.shape[-1] % 8 == 0 and t.shape[-1] <= 256


def test_adamw_is_multi_tensor_on_the_cpu_and_fused_only_on_cuda():
    cfg = load_config(None, [])
    model = build_stage(cfg.model, range(1), seed=0)
    opt = build_optimizer(model, cfg.train)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    if torch.cuda.is_available():
        opt = build_optimizer(model.cuda(), cfg.train)
        assert opt.defaults["fused"] is True


def test_a_cuda_rank_allows_tf32_for_fp32_matmuls():
    from workers.device import configure_cuda

    before = torch.backends.cuda.matmul.fp32_precision
    try:
        configure_cuda()
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
