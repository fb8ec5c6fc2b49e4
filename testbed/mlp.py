"""A 2-layer MLP trained on FSDP2 / TP meshes of spawned gloo ranks, for tests that move training state
between meshes (tests/distributed/test_snapshot_restore_bytes.py). Sizes shard unevenly: 190 rows over
dp=4 -> 48,48,48,46. ``build(dp, tp)`` makes the model, AdamW and a LambdaLR on a (dp, tp) mesh."""

from __future__ import annotations

import torch
from torch import nn

# Big enough that the state, not the optimizer's few hyperparameter items (~11 KB per restore), is
# what a restore moves; 190 rows shard unevenly over dp=4.
D_IN, HIDDEN, D_OUT, GLOBAL_BATCH = 64, 190, 32, 8
SOURCES = {"fsdp": (4, 1), "tp": (2, 2)}  # name -> (dp, tp) of a 4-rank layout


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def build(dp: int, tp: int):
    """Model + AdamW + LambdaLR on a (dp, tp) mesh of the current gloo world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = MLP()
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + step))
    return model, opt, sched, mesh


def train_step(model, opt, sched, mesh, step: int, dp: int) -> None:
    """One optimizer step on this rank's slice of the global batch of ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, D_IN, generator=g), torch.randn(GLOBAL_BATCH, D_OUT, generator=g)
    per, dp_rank = GLOBAL_BATCH // dp, mesh["dp"].get_local_rank()
    nn.functional.mse_loss(model(x[dp_rank * per:(dp_rank + 1) * per]), y[dp_rank * per:(dp_rank + 1) * per]).backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def full_params(model) -> dict[str, torch.Tensor]:
    return {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for k, p in model.named_parameters()}
