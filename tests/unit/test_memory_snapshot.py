"""checkpoints.memory: a rank's DCP write captured in memory loads back through the storage
checkpoints' load path (one process; the resharding across meshes is tests/distributed's)."""

import pickle

import pytest
import torch
from torch import nn

from checkpoints.errors import CheckpointError
from checkpoints.memory import MemoryReader, merge, take_snapshot
from checkpoints.reader import load_training_state
from checkpoints.state import TrainingState


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_snapshot_round_trip_restores_model_optimizer_and_step():
    model, opt = _trained(0)
    state = TrainingState([model], [opt]).snapshot(step=7, data_cursor=56, rng=False)
    snap = take_snapshot(state, step=7, rank=0)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_avg = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    model(torch.randn(3, 4)).sum().backward()
    opt.step()  # the snapshot is a copy: training on does not change it
    # Through Ray the holder gets a pickled copy; it must load the same.
    held = pickle.loads(pickle.dumps(snap)).copy()
    point = load_training_state("memory", [model], [opt], restore_rng=False, reader=MemoryReader([held]))
    assert (point.step, point.data_cursor) == (7, 56)
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    for p, avg in zip(model.parameters(), saved_avg):
        assert torch.equal(opt.state[p]["exp_avg"], avg)
    assert snap.nbytes > 0


def test_merge_refuses_a_missing_piece_and_mixed_steps():
    model, opt = _trained(1)
    a = take_snapshot(TrainingState([model], [opt]).snapshot(step=3, data_cursor=3, rng=False), step=3, rank=0)
    b = take_snapshot(TrainingState([model], [opt]).snapshot(step=4, data_cursor=4, rng=False), step=4, rank=1)
    with pytest.raises(CheckpointError, match="different steps"):
        merge([a, b])
    first = next(k for k, v in a.metadata.state_dict_metadata.items() if hasattr(v, "chunks"))
    a.metadata.state_dict_metadata[first].chunks[0] = a.metadata.state_dict_metadata[first].chunks[0].__class__(
        offsets=torch.Size([0] * len(a.metadata.state_dict_metadata[first].size)),
        sizes=torch.Size([1] * len(a.metadata.state_dict_metadata[first].size)))
    with pytest.raises(CheckpointError, match="do not cover"):
        merge([a])
    # Replicated pieces (two replicas of the same rank state) are kept once.
    c = take_snapshot(TrainingState([model], [opt]).snapshot(step=4, data_cursor=4, rng=False), step=4, rank=2)
    md = merge([b, c])
    assert set(md.storage_data.values()) == {0}


def test_taker_plans_once_and_takes_exactly_what_dcp_would():
    from checkpoints.snapshot_taker import SnapshotTaker

    model, opt = _trained(2)
    state = TrainingState([model], [opt])
    taker = SnapshotTaker()
    first = taker.take(state.snapshot(step=1, data_cursor=8, rng=False), step=1, rank=0)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    fast = taker.take(state.snapshot(step=2, data_cursor=16, rng=False), step=2, rank=0).serialize()
    assert fast.metadata is first.metadata  # planned once
    ref = take_snapshot(state.snapshot(step=2, data_cursor=16, rng=False), step=2, rank=0).serialize()
    assert fast.blobs.keys() == ref.blobs.keys()
    for key, want in ref.blobs.items():
        got = fast.blobs[key]
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, key
    # Another state (here: an fp16 loss scale among the extras) is planned again through DCP.
    again = taker.take(state.snapshot(step=3, data_cursor=24, rng=False, loss_scale={"scale": 2.0}), step=3, rank=0)
    assert again.metadata is not first.metadata and any("loss_scale" in k.fqn for k in again.blobs)


def test_a_taker_seeded_with_an_equal_layout_plans_its_first_take_without_dcp():
    """After a restore in place the rank's state is laid out as the old rank's snapshot: a taker seeded
    with that snapshot's metadata plans its very first take directly (no dcp.save), and takes exactly
    what DCP would; a state of other keys is planned through DCP as before."""
    from checkpoints.snapshot_taker import PlannedSnapshot, SnapshotTaker

    model, opt = _trained(2)
    state = TrainingState([model], [opt])
    old = take_snapshot(state.snapshot(step=1, data_cursor=8, rng=False), step=1, rank=0)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    taker = SnapshotTaker()
    assert taker.seed(old.metadata)
    planned = taker.plan(state.snapshot(step=2, data_cursor=16, rng=False), step=2, rank=0, slot=0)
    assert isinstance(planned, PlannedSnapshot) and planned.metadata is old.metadata
    fast = planned.copy().serialize()
    ref = take_snapshot(state.snapshot(step=2, data_cursor=16, rng=False), step=2, rank=0).serialize()
    assert fast.blobs.keys() == ref.blobs.keys()
    for key, want in ref.blobs.items():
        got = fast.blobs[key]
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, key
    other = taker.plan(state.snapshot(step=3, data_cursor=24, rng=False, loss_scale={"scale": 2.0}), step=3, rank=0,
                       slot=1)
    assert not isinstance(other, PlannedSnapshot) and any("loss_scale" in k.fqn for k in other.blobs)
