"""Worker-side checkpoint state, writer and reader in one process (no torch.distributed init).

Covers what the multi-rank test does not: pipeline parts merged/split by FQN, the async writer's
snapshot, buffer reuse, one-in-flight rule and failure reporting, fsspec URIs, and mismatch errors.
"""

from __future__ import annotations

import copy
import uuid

import pytest
import torch
from torch import nn

from checkpoints.errors import CheckpointError, CheckpointMismatchError
from checkpoints.reader import load, load_training_state
from checkpoints.state import training_state
from checkpoints.writer import AsyncCheckpointWriter, SaveFuture, SaveTiming

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's one-process notices


class Net(nn.Module):
    """Layers in a ModuleDict, so a pipeline stage keeps full-model FQNs (``layers.2.weight``)."""

    def __init__(self, n_layers: int = 4, dim: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(dim, dim) for i in range(n_layers)})
        self.head: nn.Module | None = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return self.head(x) if self.head is not None else x


def _stage(model: Net, keep: set[str], head: bool) -> Net:
    part = copy.deepcopy(model)
    for name in list(part.layers):
        if name not in keep:
            del part.layers[name]
    if not head:
        part.head = None
    return part


def _net(seed: int = 0, **kw) -> Net:
    torch.manual_seed(seed)
    return Net(**kw)


def _step(parts: list[Net], opts: list[torch.optim.Optimizer], step: int) -> float:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)
    for part in parts:
        x = part(x)
    loss = nn.functional.mse_loss(x, y)
    loss.backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()
    return float(loss)


def _params(*parts: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for p in parts for k, v in p.named_parameters()}


@pytest.mark.parametrize("direction", ["pipeline-to-whole", "whole-to-pipeline"])
def test_parts_merge_and_split_by_fqn(tmp_path, direction):
    base = _net()
    split = [_stage(base, {"0", "1"}, head=False), _stage(base, {"2", "3"}, head=True)]
    whole = [copy.deepcopy(base)]
    layouts = {"pipeline": split, "whole": whole}
    opts = {k: [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in v] for k, v in layouts.items()}
    for s in (1, 2):
        assert _step(split, opts["pipeline"], s) == pytest.approx(_step(whole, opts["whole"], s), abs=1e-7)
    src, dst = direction.split("-to-")
    writer = AsyncCheckpointWriter()
    writer.save(training_state(layouts[src], opts[src], step=2, data_cursor=10), str(tmp_path / "c")).result()
    fresh = _net(seed=1)  # other initial values: everything must come from the checkpoint
    target = [_stage(fresh, {"0", "1"}, False), _stage(fresh, {"2", "3"}, True)] if dst == "pipeline" else [fresh]
    target_opts = [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in target]
    resume = load_training_state(str(tmp_path / "c"), target, target_opts)
    assert (resume.step, resume.data_cursor) == (2, 10)
    expected = _params(*layouts[src])
    for key, value in _params(*target).items():
        assert torch.equal(value, expected[key]), key
    assert _step(target, target_opts, 3) == _step(layouts[src], opts[src], 3)
    assert _step(target, target_opts, 4) == _step(layouts[src], opts[src], 4)  # optimizer state carried over
    writer.close()


def test_async_save_is_a_snapshot_reusing_buffers_one_in_flight(tmp_path):
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step([model], [opt], 1)
    before = _params(model)
    writer = AsyncCheckpointWriter()
    first = writer.save(training_state(model, opt, step=1, data_cursor=5), str(tmp_path / "a"))
    with torch.no_grad():  # training goes on while the write runs
        for p in model.parameters():
            p.add_(1000.0)
    timing = first.result(timeout=30)
    assert isinstance(first, SaveFuture) and isinstance(timing, SaveTiming)
    assert timing.stall_s >= 0 and timing.write_s > 0
    assert {"__0_0.distcp", ".metadata"} <= set(timing.files)
    cache = writer._stager.inner._cached_storage_mapping  # DCP's staging-buffer cache
    buffers = {id(v) for v in cache.values()}
    second = writer.save(training_state(model, opt, step=2, data_cursor=10), str(tmp_path / "b"))
    assert first.done() and buffers and buffers <= {id(v) for v in cache.values()}  # reused, not reallocated
    second.result(timeout=30)
    writer.close()
    restored = _net(seed=3)
    load_training_state(str(tmp_path / "a"), restored, torch.optim.AdamW(restored.parameters()))
    for key, value in _params(restored).items():
        assert torch.equal(value, before[key]), key


def test_background_staging_snapshots_the_state_at_the_fence(tmp_path):
    """stage_in_background: save returns before the copy; after wait_staged() training may write."""
    model = _net(n_layers=2, dim=256)  # big enough that staging is not instantaneous
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_wide(model, opt, 1)
    before = _params(model)
    writer = AsyncCheckpointWriter(stage_in_background=True)
    # rng=False as RankRuntime saves: the RNG state is a new tensor each time, so not a reusable buffer
    future = writer.save(training_state(model, opt, step=1, data_cursor=5, rng=False), str(tmp_path / "a"))
    fenced = writer.wait_staged()  # what train_step does before opt.step()
    assert fenced >= 0 and writer.fence_wait_s == fenced and writer.wait_staged() == 0.0
    with torch.no_grad():  # the optimizer step of the next iteration
        for p in model.parameters():
            p.add_(1000.0)
    timing = future.result(timeout=60)
    assert timing.staging_s > 0 and timing.write_s > 0
    cache = writer._stager.inner._cached_storage_mapping
    buffers = {(v.data_ptr(), v.nbytes()) for v in cache.values()}
    writer.save(training_state(model, opt, step=2, data_cursor=10, rng=False), str(tmp_path / "b"))
    writer.wait_staged()
    assert buffers and buffers == {(v.data_ptr(), v.nbytes()) for v in cache.values()}  # reused
    writer.close()
    restored = _net(seed=3, n_layers=2, dim=256)
    load_training_state(str(tmp_path / "a"), restored, torch.optim.AdamW(restored.parameters()))
    for key, value in _params(restored).items():
        assert torch.equal(value, before[key]), key


def _train_wide(model: Net, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    loss = model(torch.randn(4, 256, generator=g)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_background_failure_is_reported_once_never_lost(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    bad = str(blocker / "step-1")
    model = _net()
    opt = torch.optim.AdamW(model.parameters())
    writer = AsyncCheckpointWriter()

    def state(step: int) -> dict:
        return training_state(model, opt, step=step, data_cursor=step)

    # Nobody reads the failed future: the next save raises instead of starting.
    writer.save(state(1), bad)
    with pytest.raises(CheckpointError, match="previous checkpoint save failed.*Not a directory") as info:
        writer.save(state(2), str(tmp_path / "ok"))
    assert bad in str(info.value) and writer.last_error is not None
    assert not (tmp_path / "ok").exists()
    # The caller read it from the future: reported there, so the next save goes ahead.
    failed = writer.save(state(1), bad)
    with pytest.raises(CheckpointError, match="background checkpoint write failed") as info:
        failed.result(timeout=30)
    assert bad in str(info.value)
    writer.save(state(2), str(tmp_path / "ok")).result(timeout=30)
    assert (tmp_path / "ok" / ".metadata").exists()
    writer.close()


def test_sync_mode_writes_before_returning(tmp_path):
    model = _net()
    opt = torch.optim.AdamW(model.parameters())
    writer = AsyncCheckpointWriter(use_async=False)
    future = writer.save(training_state(model, opt, step=3, data_cursor=9), str(tmp_path / "s"))
    assert future.done() and (tmp_path / "s" / ".metadata").exists()
    assert load_training_state(str(tmp_path / "s"), model, opt).step == 3


def test_fsspec_uri_round_trip_with_extras():
    uri = f"memory://elastimesh-{uuid.uuid4().hex[:8]}/step-00000004"
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    for s in (1, 2, 3, 4):
        _step([model], [opt], s)
        sched.step()
    torch.manual_seed(42)
    writer = AsyncCheckpointWriter()
    writer.save(training_state(model, opt, step=4, data_cursor=32, lr_scheduler=sched), uri).result(timeout=30)
    expected_draw = torch.rand(3)
    writer.close()
    other = _net(seed=5)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other_sched = torch.optim.lr_scheduler.LambdaLR(other_opt, lambda s: 0.5 ** s)
    resume = load_training_state(uri, other, other_opt, lr_schedulers=other_sched)
    assert (resume.step, resume.data_cursor) == (4, 32)
    assert other_sched.last_epoch == 4 and other_opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 16)
    assert torch.equal(torch.rand(3), expected_draw)  # RNG restored
    assert _step([other], [other_opt], 5) == _step([model], [opt], 5)


def test_extras_of_any_shape_load_without_a_template(tmp_path):
    model = _net()
    extra = {"step": 7, "data_cursor": 70, "nested": {"xs": [1, 2.5, "three"], "t": torch.arange(4)},
             "mixed": [torch.ones(2), {"k": 1}]}
    writer = AsyncCheckpointWriter(use_async=False)
    writer.save({"model": model.state_dict(), "extra": extra}, str(tmp_path / "e"))
    got = load({"model": _net(seed=9).state_dict()}, str(tmp_path / "e"))
    assert got["step"] == 7 and got["nested"]["xs"] == [1, 2.5, "three"]
    assert torch.equal(got["nested"]["t"], torch.arange(4)) and torch.equal(got["mixed"][0], torch.ones(2))
    assert got["mixed"][1] == {"k": 1}


def test_mismatched_model_names_the_keys(tmp_path):
    model = _net(n_layers=2)
    AsyncCheckpointWriter(use_async=False).save(
        training_state(model, torch.optim.AdamW(model.parameters()), step=1, data_cursor=1), str(tmp_path / "m"))
    wider = _net(n_layers=2, dim=7)
    with pytest.raises(CheckpointMismatchError) as info:
        load_training_state(str(tmp_path / "m"), wider, torch.optim.AdamW(wider.parameters()))
    assert "model.layers.0.weight" in info.value.keys and "(6, 6)" in str(info.value)
    deeper = _net(n_layers=3)
    with pytest.raises(CheckpointMismatchError) as info:
        load_training_state(str(tmp_path / "m"), deeper, torch.optim.AdamW(deeper.parameters()))
    assert "model.layers.2.weight" in info.value.keys and str(tmp_path / "m") in str(info.value)
    with pytest.raises(CheckpointError, match="metadata") as info:
        load_training_state(str(tmp_path / "nothing"), model, [])
    assert str(tmp_path / "nothing") in str(info.value)


def test_kept_training_state_takes_the_verified_shortcut_with_the_official_entries():
    """Saves after the first build the flat dicts directly; they must equal the helpers' output."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from checkpoints.state import STATE_DICT_OPTIONS, TrainingState, _same_entries
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = _net(3)
    parts = [_stage(model, {"0", "1"}, head=False), _stage(model, {"2", "3"}, head=True)]
    parts[1].layers["2"] = checkpoint_wrapper(parts[1].layers["2"])  # FQNs the helpers must clean
    opts = [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in parts]
    kept = TrainingState(parts, opts)

    assert kept.optim.shortcut is None and kept.model.shortcut is None
    _step(parts, opts, 1)
    for _ in range(2):  # the first call decides, the second takes the shortcut
        model_sd, optim_sd = kept.model.state_dict(), kept.optim.state_dict()
    assert kept.model.shortcut and kept.optim.shortcut
    official_model, official_optim = {}, {}
    for part, opt in zip(parts, opts):
        official_model |= get_model_state_dict(part, options=STATE_DICT_OPTIONS)
        official_optim |= get_optimizer_state_dict(part, opt, options=STATE_DICT_OPTIONS)
    assert "layers.2.weight" in model_sd and "state.layers.2.weight.exp_avg" in optim_sd
    assert _same_entries(official_model, model_sd) and _same_entries(official_optim, optim_sd)

    _step(parts, opts, 2)  # the shortcut reads the current tensors, not those of the first save
    assert _same_entries(get_optimizer_state_dict(parts[0], opts[0], options=STATE_DICT_OPTIONS),
                         {k: v for k, v in kept.optim.state_dict().items() if ".layers.0." in k or ".layers.1." in k})
    assert not _same_entries({"a": torch.zeros(2)}, {"a": torch.zeros(2)})  # other memory: different


def test_kept_training_state_round_trips_through_a_save(tmp_path):
    model, opt = _net(4), None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    from checkpoints.state import TrainingState

    kept = TrainingState(model, opt)
    writer = AsyncCheckpointWriter()
    for step in (1, 2, 3):
        _step([model], [opt], step)
        writer.save(kept.snapshot(step=step, data_cursor=step), str(tmp_path / f"s{step}")).result(timeout=30)
    assert kept.optim.shortcut and kept.model.shortcut
    restored = _net(9)
    restored_opt = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    assert load_training_state(str(tmp_path / "s3"), restored, restored_opt).step == 3
    for (name, a), b in zip(model.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), restored.parameters()):
        assert torch.equal(opt.state[p]["exp_avg_sq"], restored_opt.state[q]["exp_avg_sq"])
    writer.close()


def test_abandoned_saves_release_their_staging_buffers(tmp_path, monkeypatch):
    """A rebuild abandons a save (maybe still writing) and drops the writer; every stager made must
    be closed once no write reads it, or each failure would leave its pinned buffers behind."""
    import threading

    from checkpoints import staging, writer as writer_mod

    gate = threading.Event()
    real_save = writer_mod.dcp.save

    def slow_save(*args, **kwargs):  # a write blocked like one in a dead group's collective
        gate.wait(30)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(writer_mod.dcp, "save", slow_save)
    made0, closed0 = staging.stats["made"], staging.stats["closed"]
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step([model], [opt], 1)
    futures = []
    writer = AsyncCheckpointWriter(stage_in_background=True)
    for i in range(3):  # one writer, three saves abandoned mid-write: a stager each, none closed yet
        futures.append(writer.save(training_state(model, opt, step=1, data_cursor=i, rng=False), str(tmp_path / f"a{i}")))
        writer.wait_staged()
        writer.abandon()
    assert staging.stats["made"] - made0 == 3 and staging.stats["closed"] == closed0
    for i in range(3):  # new writers per generation, dropped as RankRuntime.destroy drops them
        w = AsyncCheckpointWriter(stage_in_background=True)
        futures.append(w.save(training_state(model, opt, step=1, data_cursor=i, rng=False), str(tmp_path / f"b{i}")))
        w.wait_staged()
        w.abandon(release=True)
    gate.set()
    for f in futures:
        f.exception(timeout=30)
    assert staging.stats["made"] - made0 == 6
    assert staging.stats["closed"] - closed0 == 6  # all released once their writes ended
    monkeypatch.setattr(writer_mod.dcp, "save", real_save)
    reused = AsyncCheckpointWriter()  # a writer with nothing in flight keeps its one stager
    for i in range(3):
        reused.save(training_state(model, opt, step=1, data_cursor=i, rng=False), str(tmp_path / f"c{i}")).result(30)
        reused.abandon()
    reused.abandon(release=True)
    assert staging.stats["made"] - made0 == 7 and staging.stats["closed"] - closed0 == 7


def test_the_stager_copies_into_the_same_buffers_save_after_save():
    """Each save copies into the buffers the first one made (no new pinned memory per save), and a
    state holding class objects (a DTensor's spec is rebuilt from its class) stays stageable on every
    save. torch 2.11's DefaultStager closed its StateDictStager after each stage, which broke both: the
    GPU machine's second async save failed with ``KeyError: <class 'type'>``."""
    from checkpoints.staging import Stager

    class Spec:  # stands for a DTensor's placement spec: a class object inside the state
        pass

    weight = torch.arange(6.0)
    stager = Stager(pin_memory=False)
    try:
        copies = []
        for i in range(3):
            weight.add_(1.0)
            copies.append(stager.stage({"w": weight, "spec": Spec, "step": i}))
        assert [c["spec"] for c in copies] == [Spec] * 3
        assert len({c["w"].data_ptr() for c in copies}) == 1  # one buffer, refilled
        assert torch.equal(copies[-1]["w"], weight) and copies[-1]["step"] == 2
    finally:
        stager.close()
