"""The zero-bubble split backward (workers/split_backward.py) against one plain backward, in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from workers.split_backward import backward_input


class _Block(nn.Module):
    """Norm, attention-like mixing (no weights of its own), an MLP and a weight used twice."""

    def __init__(self, d: int = 8, checkpointed: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.shared = nn.Parameter(torch.randn(d, d) / d)
        self.checkpointed = checkpointed
        self.forwards = 0

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        h = self.norm(x)
        h = torch.softmax(h @ h.transpose(-1, -2), dim=-1) @ h
        h = x + self.down(torch.relu(self.up(h)))
        return (h @ self.shared) @ self.shared.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._forward, x, use_reentrant=False) if self.checkpointed else self._forward(x)


def _reference(block: nn.Module, x: torch.Tensor, grad: torch.Tensor | None, loss: bool):
    x = x.detach().clone().requires_grad_()
    out = block(x)
    (out.square().sum() if loss else out).backward(None if loss else grad)
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    return x.grad, grads


@pytest.mark.parametrize("loss", [False, True], ids=["middle-stage", "last-stage"])
@pytest.mark.parametrize("microbatches", [1, 3])
def test_input_then_weights_equal_one_backward(loss: bool, microbatches: int) -> None:
    torch.manual_seed(0)
    block = _Block()
    xs = [torch.randn(2, 5, 8) for _ in range(microbatches)]
    gs = [torch.randn(2, 5, 8) for _ in range(microbatches)]
    expected_x, expected = [], {n: torch.zeros_like(p) for n, p in block.named_parameters()}
    for x, g in zip(xs, gs):
        gx, grads = _reference(block, x, g, loss)
        expected_x.append(gx)
        for n in expected:
            expected[n] += grads[n]
    # Every I first, then every W, as ZB-H1's held-back W's run: the pending graphs stay separate.
    pending = []
    for x, g, gx in zip(xs, gs, expected_x):
        inp = x.detach().clone().requires_grad_()
        out = block(inp)
        got_x, weights = backward_input(out.square().sum() if loss else out, None if loss else g, inp)
        torch.testing.assert_close(got_x, gx, rtol=0, atol=1e-6)
        assert all(p.grad is None for p in block.parameters())  # I leaves the weights alone
        # What the pending W holds besides the forward's saved tensors: at least the gradient
        # reaching `down`'s output (batch x seq x d floats), counted for the memory bench.
        assert weights.kept_bytes >= gx.numel() * gx.element_size()
        pending.append(weights)
    for weights in pending:
        weights.run()
    for n, p in block.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-6, atol=1e-6, msg=n)
    with pytest.raises(RuntimeError, match="runs once"):
        pending[0].run()


def test_first_stage_defers_its_whole_backward_to_the_w() -> None:
    torch.manual_seed(0)
    emb, block = nn.Embedding(16, 8), _Block()
    tokens, g = torch.randint(0, 16, (2, 5)), torch.randn(2, 5, 8)
    block(emb(tokens)).backward(g)
    expected = [p.grad.clone() for p in [*emb.parameters(), *block.parameters()]]
    for p in [*emb.parameters(), *block.parameters()]:
        p.grad = None
    got_x, weights = backward_input(block(emb(tokens)), g, None)
    assert got_x is None and emb.weight.grad is None
    weights.run()
    for p, e in zip([*emb.parameters(), *block.parameters()], expected):
        torch.testing.assert_close(p.grad, e, rtol=0, atol=1e-6)


def test_activation_checkpointing_recomputes_the_forward_in_the_weight_pass() -> None:
    """Why the config refuses zb-h1/zbv with activation checkpointing (orchestrator/config/validate.py):
    right, but every backward pass over a checkpointed block recomputes its forward again."""
    torch.manual_seed(0)
    block = _Block(checkpointed=True)
    x, g = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    _, expected = _reference(block, x, g, loss=False)
    block.forwards = 0
    inp = x.clone().requires_grad_()
    out = block(inp)
    assert block.forwards == 1
    _, weights = backward_input(out, g, inp)
    after_input = block.forwards
    weights.run()
    assert after_input == 2 and block.forwards > after_input  # recomputed again for the W
    for n, p in block.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-6, atol=1e-6)
