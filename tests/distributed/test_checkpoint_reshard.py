"""Save at one DP×TP layout, load into others: parameters bit-identical, next losses equal.

A 2-layer MLP with sizes that shard unevenly (22 rows over dp=4 -> 6,6,6,4) is trained for 2 steps
with FSDP2 at dp=4, and with TP(Colwise/Rowwise)+FSDP2 at dp=2×tp=2, in one 4-rank world. Each
save is asynchronous on a dedicated gloo group while training continues (the in-flight write must
not see the later steps). The reference is one plain process that loads the checkpoint (no
torch.distributed) and continues: every target layout (dp=2, world 1, dp=2×tp=2) must load the
same parameters, LR, RNG and data cursor, and compute the same next two losses.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from checkpoints.catalog import commit, latest_valid
from checkpoints.layout import step_dir_name
from checkpoints.manifest import CheckpointManifest
from testbed.gloo_world import run_world
from testbed.rank_pool import shutdown_pool

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's one-process notices
D_IN, HIDDEN, D_OUT, GLOBAL_BATCH, SAVED_STEP = 10, 22, 6, 8, 2
SOURCES = {"fsdp": (4, 1), "tp": (2, 2)}  # name -> (dp, tp) of the saving layout


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _schedule(step: int) -> float:
    return 1.0 / (1.0 + step)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, D_IN, generator=g), torch.randn(GLOBAL_BATCH, D_OUT, generator=g)


def _build(dp: int, tp: int, distributed: bool = True):
    """Model + AdamW + LambdaLR on a (dp, tp) mesh, or plain for the one-process reference."""
    torch.manual_seed(0)
    model = MLP()
    mesh = None
    if distributed:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        if tp > 1:
            parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    return model, opt, sched, mesh


def _train_step(model, opt, sched, mesh, step: int, dp: int) -> float:
    """One optimizer step on the global batch of ``step``; returns the global-batch loss."""
    x, y = _batch(step)
    dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
    per = GLOBAL_BATCH // dp
    xs, ys = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
    loss = nn.functional.mse_loss(model(xs), ys)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    value = loss.detach().clone()
    if mesh is not None and dp > 1:
        import torch.distributed as dist

        dist.all_reduce(value, group=mesh["dp"].get_group())
        value /= dp
    return float(value)


def _full_params(model) -> dict[str, torch.Tensor]:
    return {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for k, p in model.named_parameters()}


def _save_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from checkpoints.state import training_state
    from checkpoints.writer import AsyncCheckpointWriter

    for training_group in (None, dist.group.WORLD):  # async on the training group would abort gloo
        with pytest.raises(ValueError, match="dedicated process group"):
            AsyncCheckpointWriter(training_group)
    # Never the training group (docs/design.md, "Async saves need their own group, in thread mode").
    ckpt_group = dist.new_group(backend="gloo")
    writer = AsyncCheckpointWriter(ckpt_group)
    out: dict[str, Any] = {}
    for name, (dp, tp) in SOURCES.items():
        model, opt, sched, mesh = _build(dp, tp)
        losses = [_train_step(model, opt, sched, mesh, s, dp) for s in (1, 2)]
        saved = _full_params(model)
        path = f"{root}/{name}/{step_dir_name(SAVED_STEP)}"
        state = training_state(model, opt, step=SAVED_STEP, data_cursor=SAVED_STEP * GLOBAL_BATCH, lr_scheduler=sched)
        future = writer.save(state, path)
        # Keep training while the shard is written: the checkpoint must still hold step 2.
        losses += [_train_step(model, opt, sched, mesh, s, dp) for s in (3, 4)]
        timing = future.result(timeout=60)
        out[name] = {"losses": losses, "saved": saved, "timing": timing, "path": path}
    writer.close()
    return out


def _load_worker(rank: int, world: int, dp: int, tp: int, paths: dict[str, str]) -> dict[str, Any]:
    from checkpoints.reader import load_training_state

    out = {}
    for name, path in paths.items():
        model, opt, sched, mesh = _build(dp, tp)
        resume = load_training_state(path, model, opt, lr_schedulers=sched)
        loaded = _full_params(model)
        lr = opt.param_groups[0]["lr"]
        rng_draw = float(torch.rand(()))
        losses = [_train_step(model, opt, sched, mesh, s, dp) for s in (resume.step + 1, resume.step + 2)]
        out[name] = {"resume": (resume.step, resume.data_cursor), "loaded": loaded, "lr": lr,
                     "rng": rng_draw, "losses": losses}
    return out


def _reference(path: str) -> dict[str, Any]:
    """One plain process continuing from the checkpoint: the ground truth for every layout."""
    from checkpoints.reader import load_training_state

    model, opt, sched, _ = _build(1, 1, distributed=False)
    resume = load_training_state(path, model, opt, lr_schedulers=sched)
    loaded = _full_params(model)
    lr = opt.param_groups[0]["lr"]
    rng_draw = float(torch.rand(()))
    losses = [_train_step(model, opt, sched, None, s, 1) for s in (resume.step + 1, resume.step + 2)]
    return {"resume": (resume.step, resume.data_cursor), "loaded": loaded, "lr": lr, "rng": rng_draw,
            "losses": losses}


@pytest.fixture(scope="module", autouse=True)
def _worker_pool():
    """The ranks are re-used across this module's worlds; stop them when it is done."""
    yield
    shutdown_pool()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("ckpt"))
    ranks = run_world(4, _save_worker, root, timeout=120)
    result = ranks[0]
    for name, (dp, tp) in SOURCES.items():
        timing = result[name]["timing"]
        # Every rank learns the whole checkpoint's file sizes (DCP's global metadata), so any ack will do.
        assert all(r[name]["timing"].files == timing.files for r in ranks)
        assert {f"__{r}_0.distcp" for r in range(4)} <= set(timing.files)
        commit(f"{root}/{name}", CheckpointManifest(
            step=SAVED_STEP, generation=0, mesh={"dp": dp, "pp": 1, "tp": tp}, model_fingerprint="mlp",
            data_cursor=SAVED_STEP * GLOBAL_BATCH, global_batch_size=GLOBAL_BATCH, world_size=4,
            ranks_acked=[0, 1, 2, 3], files=timing.files))
        result[name]["reference"] = _reference(result[name]["path"])
    result["root"] = root
    return result


def _assert_matches(got: dict[str, Any], ref: dict[str, Any], saved_params: dict[str, torch.Tensor]) -> None:
    assert got["resume"] == ref["resume"] == (SAVED_STEP, SAVED_STEP * GLOBAL_BATCH)
    for key, value in saved_params.items():
        assert torch.equal(got["loaded"][key], value), f"{key} differs after load"
        assert torch.equal(ref["loaded"][key], value), f"{key} differs in the reference"
    assert got["lr"] == pytest.approx(ref["lr"], abs=0) and math.isclose(ref["lr"], 1e-2 * _schedule(SAVED_STEP))
    assert got["rng"] == ref["rng"]
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 1e-6, (got["losses"], ref["losses"])


@pytest.mark.timeout(180)
def test_async_save_is_a_snapshot_and_commits(saved):
    for name in SOURCES:
        info = saved[name]
        # Training went on during the write; continuing from the checkpoint reproduces steps 3, 4.
        for a, b in zip(info["losses"][2:], info["reference"]["losses"], strict=True):
            assert abs(a - b) <= 1e-6, (info["losses"], info["reference"]["losses"])
        timing = info["timing"]
        assert timing.stall_s >= 0 and timing.write_s > 0
        assert {"__0_0.distcp", ".metadata"} <= set(timing.files)
        latest = latest_valid(f"{saved['root']}/{name}")
        assert latest is not None and latest.step == SAVED_STEP and latest.valid


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 1), (2, 2)], ids=["dp2", "world1", "dp2xtp2"])
def test_load_resharded(saved, dp, tp):
    paths = {name: saved[name]["path"] for name in SOURCES}
    got = run_world(dp * tp, _load_worker, dp, tp, paths, timeout=120)[0]
    for name in SOURCES:
        _assert_matches(got[name], saved[name]["reference"], saved[name]["saved"])
