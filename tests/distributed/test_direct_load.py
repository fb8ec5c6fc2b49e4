"""A snapshot loaded in place (checkpoints.direct_load) leaves a rank in exactly the state DCP's
resharding load leaves it in, bit for bit, and is taken only where the layout allows it.

Snapshots are taken after two AdamW steps on 4-rank layouts: FSDP2 dp=4 (190 rows -> 48,48,48,46),
TP + FSDP2 dp=2 x tp=2, and HSDP (2 replicas x 2 shards). Each new rank then builds a fresh model and
optimizer (no optimizer state yet, as a new generation's rank) twice: once loaded in place from the
old rank whose snapshot ``plan_direct`` picks, once through DCP (``load_training_state`` with a
``RemoteReader`` over every old rank's snapshot). Parameters, every optimizer state tensor (values,
dtype, DTensor placements and mesh), the param groups and the step must be equal, and so must the
parameters after one more training step from each. A changed layout (dp=4 -> dp=2 or dp=3 under
FSDP2, dp=2 -> 1 beside tp=2, tp=2 -> dp=4) has no old rank to copy from: each piece is assembled
from several old ranks' chunks (``plan_assembled``), equal to DCP's resharding all the same; an HSDP
replica lost (4 -> 2 ranks, the shard groups kept) and a replicated state (ZeRO-0's) load in place
from any old rank of the same shard. Either way the plan's layout metadata seeds the rank's snapshot
taker: its first take, planned without ``dcp.save``, must equal DCP's take in layout and every blob.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from testbed.gloo_world import run_world
from testbed.mlp import GLOBAL_BATCH, SOURCES, build, train_step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's one-process notices

LAYOUTS = {**SOURCES, "hsdp": (2, 2)}  # name -> (dp or replicas, tp or shards) of a 4-rank layout


def _build(name: str, a: int, b: int):
    """``testbed.mlp.build``, or for "hsdp" the same MLP on a (replicate a, shard b) HSDP mesh."""
    if name != "hsdp":
        return build(a, b)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from testbed.mlp import MLP

    torch.manual_seed(0)
    model = MLP()
    mesh = init_device_mesh("cpu", (a, b), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + step))
    flat = mesh._flatten("dp")  # the dp rank for the batch slice (train_step reads mesh["dp"])
    return model, opt, sched, {"dp": flat}


def _take(rank: int, world: int, name: str) -> Any:
    from checkpoints.snapshot_taker import SnapshotTaker
    from checkpoints.state import TrainingState

    a, b = LAYOUTS[name]
    model, opt, sched, mesh = _build(name, a, b)
    for step in (1, 2):
        train_step(model, opt, sched, mesh, step, a * b if name == "hsdp" else a)
    state = TrainingState([model], [opt]).snapshot(step=2, data_cursor=2 * GLOBAL_BATCH, rng=False)
    return SnapshotTaker().take(state, step=2, rank=rank).serialize()


def _state(model, opt) -> dict[str, Any]:
    """Everything a load sets: local parameter pieces, optimizer state (with layouts), param groups."""
    from torch.distributed.tensor import DTensor

    def local(t):
        if isinstance(t, DTensor):
            return ("dtensor", tuple(t.placements), t.device_mesh.mesh.tolist(), tuple(t.shape), t.to_local().clone())
        return ("tensor", t.dtype, t.detach().clone())

    params = {k: local(p.detach()) for k, p in model.named_parameters()}
    names = {id(p): k for k, p in model.named_parameters()}
    state = {names[id(p)]: {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for p, s in opt.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"params": params, "state": state, "groups": groups}


def _read(plan, snaps: list) -> dict:
    """Every read of ``plan``, as the old ranks' stores answer it (``MemorySnapshot.pieces``)."""
    pieces = {}
    for owner, requests in plan.by_owner().items():
        pieces.update(zip(requests, snaps[owner].pieces([r[1:] for r in requests]), strict=True))
    return pieces


def _seeded_take_mismatch(model, opt, metadata) -> str:
    """How a take planned from the plan's ``metadata`` (``SnapshotTaker.seed``, no ``dcp.save``)
    differs from DCP's own take of the restored state, in layout or in any blob; "" when it does not."""
    from checkpoints.memory import take_snapshot
    from checkpoints.snapshot_taker import PlannedSnapshot, SnapshotTaker
    from checkpoints.state import TrainingState

    def state():
        return TrainingState([model], [opt]).snapshot(step=2, data_cursor=2 * GLOBAL_BATCH, rng=False)

    taker = SnapshotTaker()
    if metadata is None or not taker.seed(metadata):
        return "no metadata to seed from"
    planned = taker.plan(state(), step=2, rank=0, slot=0)
    if not isinstance(planned, PlannedSnapshot):
        from checkpoints.snapshot_taker import _signature

        wanted = _signature({k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state().items()})
        seeded = SnapshotTaker()
        seeded.seed(metadata)
        mine, theirs = dict(seeded._signature), dict(wanted)
        diff = {section: (sorted(map(str, (mine.get(section) or set()) - (theirs.get(section) or set()))),
                          sorted(map(str, (theirs.get(section) or set()) - (mine.get(section) or set()))))
                for section in mine.keys() | theirs.keys() if mine.get(section) != theirs.get(section)}
        return f"the seed did not plan the take: per section, (seeded only, state only): {diff}"
    fast, ref = planned.copy().serialize(), take_snapshot(state(), step=2, rank=0).serialize()

    def layout(md):
        return {fqn: (tuple(item.size), [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks])
                if hasattr(item, "chunks") else "bytes" for fqn, item in md.state_dict_metadata.items()}

    if layout(fast.metadata) != layout(ref.metadata):
        return f"layout {layout(fast.metadata)} != {layout(ref.metadata)}"
    if fast.blobs.keys() != ref.blobs.keys():
        return f"blobs {sorted(map(str, fast.blobs))} != {sorted(map(str, ref.blobs))}"
    for key, want in ref.blobs.items():
        got = fast.blobs[key]
        if not (torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want):
            return f"blob {key}"
    return ""


def _restore(rank: int, world: int, name: str, shape: tuple[int, int], snaps: list) -> dict[str, Any]:
    from checkpoints.direct_load import local_state, plan_assembled, plan_direct
    from checkpoints.memory import RemoteReader
    from checkpoints.reader import load_training_state

    model, opt, sched, mesh = _build(name, *shape)
    local = local_state([model], [opt])
    plans = [plan_direct(local, s.metadata, owner) for owner, s in enumerate(snaps)]
    owners = [owner for owner, plan in enumerate(plans) if plan is not None]
    assembled = None if owners else plan_assembled(local, {o: s.metadata for o, s in enumerate(snaps)})
    out: dict[str, Any] = {"owners": owners, "assembled": assembled is not None}
    if owners or assembled is not None:
        if assembled is not None:
            plan = assembled
            out["read_from"] = sorted(plan.by_owner())
        else:
            plan = plans[rank] if rank < len(plans) and plans[rank] is not None else plans[owners[0]]
        point = plan.install(_read(plan, snaps))
        out["seeded_take"] = _seeded_take_mismatch(model, opt, plan.metadata)
        out["direct"] = {"step": point.step, "cursor": point.data_cursor, **_state(model, opt)}
        train_step(model, opt, sched, mesh, 3, shape[0] * shape[1] if name == "hsdp" else shape[0])
        out["direct_after"] = _state(model, opt)["params"]
    model, opt, sched, mesh = _build(name, *shape)
    reader = RemoteReader([s.metadata for s in snaps], 2,
                          lambda wanted: {o: snaps[o].pieces(reqs) for o, reqs in wanted.items()})
    point = load_training_state(f"snapshots of {name}", [model], [opt], restore_rng=False, reader=reader)
    out["dcp"] = {"step": point.step, "cursor": point.data_cursor, **_state(model, opt)}
    train_step(model, opt, sched, mesh, 3, shape[0] * shape[1] if name == "hsdp" else shape[0])
    out["dcp_after"] = _state(model, opt)["params"]
    return out


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def taken() -> dict[str, list]:
    return {name: run_world(4, _take, name, timeout=120) for name in LAYOUTS}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,shape,expect", [
    ("fsdp", (4, 1), "own"), ("tp", (2, 2), "own"), ("hsdp", (2, 2), "replica"),
    ("hsdp", (1, 2), "replica"), ("fsdp", (2, 1), "assembled"), ("fsdp", (3, 1), "assembled"),
    ("tp", (1, 2), "assembled"), ("tp", (4, 1), "assembled"),
], ids=["fsdp-same", "tp-same", "hsdp-same", "hsdp-replica-lost", "fsdp-dp4-to-dp2", "fsdp-dp4-to-dp3",
        "tp-dp2-to-dp1", "tp2-to-dp4"])
def test_in_place_load_equals_dcp_bit_for_bit(taken, name, shape, expect):
    ranks = run_world(shape[0] * shape[1], _restore, name, shape, taken[name], timeout=180)
    for rank, got in enumerate(ranks):
        if expect == "assembled":
            # No old rank has this layout: the pieces come from the chunks of several old ranks.
            assert got["owners"] == [] and got["assembled"], (rank, got["owners"])
            assert len(got["read_from"]) >= 2, (rank, got["read_from"])
            # Its own layout, made for the load, plans its first snapshot take as DCP would lay it out.
            assert got["seeded_take"] == "", (rank, got["seeded_take"])
            _assert_same(got["direct"], got["dcp"], f"{name}{shape} rank {rank}")
            _assert_same(got["direct_after"], got["dcp_after"], f"{name}{shape} rank {rank} after a step")
            continue
        # "own": only the old rank of the same number holds this layout; "replica": the rank of this
        # shard in either old replica does (HSDP, also after a lost replica).
        assert got["owners"] == ([rank] if expect == "own" else [rank % 2, rank % 2 + 2]), (rank, got["owners"])
        assert got["direct"]["step"] == got["dcp"]["step"] == 2
        assert got["direct"]["cursor"] == got["dcp"]["cursor"] == 2 * GLOBAL_BATCH
        _assert_same(got["direct"], got["dcp"], f"{name}{shape} rank {rank}")
        _assert_same(got["direct_after"], got["dcp_after"], f"{name}{shape} rank {rank} after a step")
        assert got["seeded_take"] == "", (rank, got["seeded_take"])  # the old rank's layout plans its takes
