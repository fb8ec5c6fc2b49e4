"""A restore from in-memory snapshots moves, per new rank, only the pieces of the old shards its own
shard needs (checkpoints.memory.RemoteReader): at most 2x the rank's own state, whatever the old and
new meshes, and the loaded state is bit-identical to what was saved.

Snapshots are taken on two 4-rank layouts (FSDP2 dp=4; TP + FSDP2 dp=2 x tp=2, unevenly sharded: 190
rows over dp=4 -> 48,48,48,46) and loaded into dp=2, one process, dp=2 x tp=2 and dp=4; each new rank's
reads go through a fetch function that serves the old ranks' snapshots and counts the bytes it hands
out, as the providers' ``snapshot_pieces`` do over Ray (workers/snapshot_push.py). The loader before
this one (``MemoryReader``) needed every old rank's whole snapshot on every new rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from testbed.gloo_world import run_world
from testbed.mlp import GLOBAL_BATCH, SOURCES, build, full_params, train_step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's one-process notices


def _take(rank: int, world: int) -> dict[str, Any]:
    from checkpoints.snapshot_taker import SnapshotTaker
    from checkpoints.state import TrainingState

    out = {}
    for name, (dp, tp) in SOURCES.items():
        model, opt, sched, mesh = build(dp, tp)
        for step in (1, 2):
            train_step(model, opt, sched, mesh, step, dp)
        state = TrainingState([model], [opt]).snapshot(step=2, data_cursor=2 * GLOBAL_BATCH, rng=False)
        snap = SnapshotTaker().take(state, step=2, rank=rank).serialize()
        out[name] = {"snapshot": snap, "params": full_params(model)}
    return out


def _shard_bytes(model, opt) -> int:
    from torch.distributed.tensor import DTensor

    def local(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    total = sum(local(p) for p in model.parameters())
    return total + sum(local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def _restore(rank: int, world: int, dp: int, tp: int, snapshots: dict[str, list]) -> dict[str, Any]:
    from checkpoints.memory import RemoteReader
    from checkpoints.reader import load_training_state

    out = {}
    for name, snaps in snapshots.items():
        model, opt, sched, mesh = build(dp, tp)
        train_step(model, opt, sched, mesh, 1, dp)  # optimizer state exists: the template DCP loads into
        served = {"bytes": 0, "old_ranks": set()}

        def fetch(wanted: dict[int, list]) -> dict[int, list]:
            answers = {owner: snaps[owner].pieces(requests) for owner, requests in wanted.items()}
            for owner, pieces in answers.items():
                served["old_ranks"].add(owner)
                # One answer crosses as one pickle: an object repeated in it (equal byte items) once.
                distinct = {id(p): p for p in pieces}.values()
                served["bytes"] += sum(p.numel() * p.element_size() if isinstance(p, torch.Tensor) else len(p)
                                       for p in distinct)
            return answers

        reader = RemoteReader([s.metadata for s in snaps], 2, fetch)
        point = load_training_state(f"snapshots of {name}", [model], [opt], restore_rng=False, reader=reader)
        out[name] = {"step": point.step, "params": full_params(model), "fetched": reader.fetched_bytes,
                     "served": served["bytes"], "shard": _shard_bytes(model, opt),
                     "whole": sum(s.nbytes for s in snaps), "from": len(served["old_ranks"])}
    return out


@pytest.fixture(scope="module")
def taken() -> dict[str, Any]:
    ranks = run_world(4, _take, timeout=120)
    return {name: {"snapshots": [r[name]["snapshot"] for r in ranks], "params": ranks[0][name]["params"]}
            for name in SOURCES}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 1), (2, 2), (4, 1)], ids=["dp2", "world1", "dp2xtp2", "dp4"])
def test_each_new_rank_fetches_at_most_twice_its_own_shard(taken, dp, tp):
    snapshots = {name: t["snapshots"] for name, t in taken.items()}
    ranks = run_world(dp * tp, _restore, dp, tp, snapshots, timeout=120)
    for name in SOURCES:
        for rank, got in enumerate(ranks):
            got = got[name]
            assert got["step"] == 2
            for key, value in taken[name]["params"].items():
                assert torch.equal(got["params"][key], value), f"{name} -> ({dp},{tp}) rank {rank}: {key}"
            assert got["fetched"] == got["served"]  # every byte read came through the fetch
            assert got["fetched"] <= 2 * got["shard"], (name, dp, tp, rank, got["fetched"], got["shard"])
            if dp * tp > 1:
                assert got["fetched"] < got["whole"] / 2  # what the old loader moved to every rank
