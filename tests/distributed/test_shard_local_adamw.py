"""The optimizer update and the gradient clip on each DTensor's local shard (workers/optim.py:
``ShardLocalAdamW``, ``clip_grad_norm``) equal torch's own on the DTensors, bit for bit.

Two copies of one model on each 4-rank layout (FSDP2 dp=4, unevenly sharded; TP + FSDP2 dp=2 x tp=2)
train 3 steps on the same batches: one with ``torch.optim.AdamW(foreach=True)`` and
``torch.nn.utils.clip_grads_with_norm_`` on the DTensors, one with ``ShardLocalAdamW`` and the
runtime's ``clip_grad_norm``. Every parameter shard and every optimizer state tensor must be equal
(and still a DTensor of its parameter's layout) after each step, with clipping active (a max norm
below the gradients' norm) and with weight decay.
"""

from __future__ import annotations

import pytest
import torch

from testbed.gloo_world import run_world
from testbed.mlp import D_IN, D_OUT, GLOBAL_BATCH, SOURCES, build

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MAX_NORM = 0.05  # below the gradients' norm: the clip scales them


def _grads(model, mesh, step: int, dp: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, D_IN, generator=g), torch.randn(GLOBAL_BATCH, D_OUT, generator=g)
    per, dp_rank = GLOBAL_BATCH // dp, mesh["dp"].get_local_rank()
    part = slice(dp_rank * per, (dp_rank + 1) * per)
    torch.nn.functional.mse_loss(model(x[part]), y[part]).backward()


def _shards(model, opt) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    names = {id(p): k for k, p in model.named_parameters()}
    for p in model.parameters():
        out[names[id(p)]] = p.to_local().clone()
        for key, value in opt.state[p].items():
            if isinstance(p, DTensor) and key != "step":
                assert isinstance(value, DTensor) and value.placements == p.placements, key
            out[f"{names[id(p)]}.{key}"] = (value.to_local() if isinstance(value, DTensor) else value).clone()
    return out


def _train(rank: int, world: int, dp: int, tp: int) -> list[tuple[dict, dict]]:
    from workers.optim import ShardLocalAdamW, clip_grad_norm

    torch_side, ours = build(dp, tp), build(dp, tp)
    opt_a = torch.optim.AdamW(torch_side[0].parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    opt_b = ShardLocalAdamW(ours[0].parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    # The update must have run on local tensors (its fallback hands the DTensors over).
    import workers.optim as optim_module

    update, seen = optim_module.adam_update, []

    def recording(params, *args, **kwargs):
        seen.append(any(isinstance(p, torch.distributed.tensor.DTensor) for p in params))
        return update(params, *args, **kwargs)

    optim_module.adam_update = recording
    out = []
    for step in (1, 2, 3):
        (model_a, _, _, mesh), (model_b, _, _, _) = torch_side, ours
        _grads(model_a, mesh, step, dp)
        _grads(model_b, mesh, step, dp)
        params_a = list(model_a.parameters())
        total = clip_grad_norm(list(model_b.parameters()), MAX_NORM, torch.distributed.group.WORLD,
                               holders=dp * tp)
        torch.nn.utils.clip_grads_with_norm_(params_a, MAX_NORM, torch.tensor(total, dtype=torch.float32),
                                             foreach=True)
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
        out.append((_shards(model_a, opt_a), _shards(model_b, opt_b)))
    optim_module.adam_update = update
    assert seen and not any(seen), seen
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(SOURCES))
def test_local_shard_update_equals_dtensor_update(name):
    dp, tp = SOURCES[name]
    for rank, steps in enumerate(run_world(dp * tp, _train, dp, tp, timeout=150)):
        for step, (theirs, ours) in enumerate(steps, start=1):
            assert theirs.keys() == ours.keys()
            for key in theirs:
                assert torch.equal(theirs[key], ours[key]), f"{name} rank {rank} step {step}: {key}"
