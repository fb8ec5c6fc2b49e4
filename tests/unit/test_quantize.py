"""Quantized gradient codecs without a process group: the int8/int4 round trip, 1-bit signs, error
feedback over 50 steps (workers/quantize.py), and 1-bit Adam in one process (workers/onebit_adam.py)."""

from __future__ import annotations

import pytest
import torch

from workers.onebit_adam import OnebitAdam
from workers.quantize import (QMAX, ErrorFeedback, dequantize, pack_rows, pack_signs, padded_length, quantize,
                              unpack_rows, unpack_signs)


def _rows(n: int, m: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Mixed magnitudes across blocks (as a gradient's layers have), an all-zero block, a negative run.
    x = torch.randn(n, m, generator=g) * torch.logspace(-6, 1, m).flip(0)
    x[:, :16] = 0
    return x


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [128, 32])
def test_round_trip_error_is_at_most_half_a_step(bits: int, block: int) -> None:
    x = _rows(3, 4 * block)
    payload, scales = quantize(x, bits, block)
    assert payload.dtype == torch.uint8 and payload.shape == (3, 4 * block * bits // 8)
    assert scales.shape == (3, 4)
    back = dequantize(payload, scales, bits, block)
    blocks = x.view(3, 4, block)
    step = blocks.abs().amax(dim=2, keepdim=True) / QMAX[bits]
    err = (back.view(3, 4, block) - blocks).abs()
    assert torch.all(err <= step / 2 * (1 + 1e-6) + 1e-12), float((err - step / 2).max())
    assert torch.all(back[:, :16] == 0)  # exact zeros stay zero
    # Each block's largest value is exact (it sets the scale), up to float rounding.
    top = blocks.abs().argmax(dim=2, keepdim=True)
    torch.testing.assert_close(back.view(3, 4, block).gather(2, top), blocks.gather(2, top))
    # The values and scales travel together in one byte row and come back unchanged.
    p2, s2 = unpack_rows(pack_rows(payload, scales), payload.shape[1])
    assert torch.equal(p2, payload) and torch.equal(s2, scales)


def test_bytes_per_value() -> None:
    x = _rows(2, 1024)
    for bits, expected in ((8, 1024 + 4 * 8), (4, 512 + 4 * 8)):
        payload, scales = quantize(x, bits, 128)
        assert pack_rows(payload, scales).shape == (2, expected)
    assert padded_length(1000, 128) == 1024 and padded_length(1024, 128) == 1024


def test_sign_packing_round_trip() -> None:
    x = torch.randn(3, 64)
    x[0, :5] = 0.0  # zero counts as +1, as in DeepSpeed's 1-bit compression
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 8)
    assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))


@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_tracks_the_uncompressed_sum_over_50_steps(bits: int) -> None:
    """Gradients whose small entries always round to zero next to one large entry per block: without
    error feedback their sum is lost for good (the gap grows every step); with it the applied sum
    stays within one step's quantization error of the true sum, however many steps run."""
    g = torch.Generator().manual_seed(1)
    block, steps = 64, 50
    feedback = ErrorFeedback()
    true_sum = torch.zeros(2, 4 * block)
    with_ef = torch.zeros_like(true_sum)
    without_ef = torch.zeros_like(true_sum)
    bound = torch.zeros(())
    for _ in range(steps):
        grad = 1e-3 * (1 + torch.rand(2, 4 * block, generator=g))  # all > 0: rounding loses them
        grad[:, ::block] = 1.0  # one large entry per block sets its scale
        true_sum += grad
        plain_p, plain_s = quantize(grad, bits, block)
        without_ef += dequantize(plain_p, plain_s, bits, block)
        compensated = feedback.compensate(grad)
        payload, scales = quantize(compensated, bits, block)
        sent = dequantize(payload, scales, bits, block)
        feedback.update(compensated, sent)
        with_ef += sent
        bound = torch.maximum(bound, scales.max() / 2 * 1.01)  # half a quantization step
    # Telescoping: sum(sent) = sum(grad) - final residual, and the residual is under half a step.
    torch.testing.assert_close(with_ef, true_sum - feedback.residual, rtol=1e-5, atol=1e-5)
    assert (with_ef - true_sum).abs().max() <= bound
    assert (without_ef - true_sum).abs().max() > 50 * 1e-3 * 0.9  # every small entry lost 50 times


def test_error_feedback_drops_a_non_finite_residual() -> None:
    feedback = ErrorFeedback()
    x = torch.tensor([[1.0, float("nan"), 2.0, 3.0]])
    compensated = feedback.compensate(x)
    feedback.update(compensated, torch.zeros_like(compensated))
    assert torch.isfinite(feedback.residual).all()


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _train(opt_factory, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    model = _model()
    opt = opt_factory(model.parameters())
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        loss = (model(x) - x.sum(dim=1, keepdim=True).sin()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in model.parameters()]


def test_onebit_adam_warm_up_is_adamw_and_then_freezes_the_variance() -> None:
    """In one process (no group) 1-bit Adam compresses nothing: its warm-up equals torch's AdamW (same
    update, weight decay and bias correction); after it the variance stops changing."""
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    warm = 5
    adamw_losses, adamw_params = _train(lambda p: torch.optim.AdamW(p, foreach=True, **kw), warm)
    onebit_losses, onebit_params = _train(lambda p: OnebitAdam(p, warmup_steps=warm, **kw), warm)
    assert onebit_losses == pytest.approx(adamw_losses, rel=1e-6)
    for a, b in zip(adamw_params, onebit_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    model = _model()
    opt = OnebitAdam(model.parameters(), warmup_steps=warm, **kw)
    variances = []
    for step in range(warm + 3):
        assert opt.compressing == (step >= warm)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        variances.append(opt.state[model[0].weight]["exp_avg_sq"].clone())
    assert not torch.equal(variances[warm - 2], variances[warm - 1])
    assert all(torch.equal(v, variances[warm - 1]) for v in variances[warm:])
    assert opt.completed_steps() == warm + 3
