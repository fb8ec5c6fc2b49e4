"""#36 item 8: the host memory snapshots and staging take is counted before it is spent.

The count (orchestrator/plan/host_memory.py) is checked against the code that spends it: a real
``SnapshotTaker`` and ``SnapshotStore`` driven through takes whose complete set lags behind (as the
window makes it), counting the distinct host buffers alive at once. Then the launch check's refusal
as data (no process, no Ray)."""

from __future__ import annotations

import pytest
import torch

from orchestrator.config.load import load_config
from orchestrator.errors import UserInputError
from orchestrator.plan.host_memory import (
    NodeRoom,
    check_node_memory,
    host_bytes_per_rank,
    host_copies,
    node_rooms,
)
from orchestrator.plan.mesh_plan import make_plan, rank_memory
from workers.snapshots import SnapshotStore


def _cfg(tmp_path, *overrides):
    return load_config(None, [f"checkpoint.dir={tmp_path}", "mesh.dp=2", "mesh.tp=1", *overrides])


def test_copies_by_source_follow_the_keys(tmp_path):
    assert host_copies(_cfg(tmp_path)) == {"own": 3, "first_take": 1, "held": 3, "in_flight": 2, "staging": 1}
    assert host_copies(_cfg(tmp_path, "checkpoint.memory_keep=2")) == {
        "own": 2, "first_take": 1, "held": 2, "in_flight": 2, "staging": 1}
    assert host_copies(_cfg(tmp_path, "checkpoint.async=false", "checkpoint.memory_every=0")) == {}
    assert host_copies(load_config(None, [])) == {}  # no checkpoint.dir: no snapshots, no saves


def _live_buffers(store: SnapshotStore, taker) -> int:
    """Distinct tensor storages the store's own snapshots and the taker's buffer sets keep alive."""
    ptrs = {t.untyped_storage().data_ptr() for buffers in taker._buffers.values() for t in buffers.values()}
    for snap, _ in store.own.values():
        ptrs |= {b.untyped_storage().data_ptr() for b in snap.blobs.values() if isinstance(b, torch.Tensor)}
    return len(ptrs)


@pytest.mark.parametrize("keep", [2, 3, 4])
def test_own_copies_peak_at_keep_plus_the_first_take(keep, tmp_path):
    """The rank's own side, as workers/snapshot_push.py runs it: plan into ``slot_for``'s buffer set,
    copy, file. The first set completes, the next ones only after a few steps (a slow holder), so the
    generation's first take (fresh memory) is kept while every buffer set fills: the peak
    ``host_copies`` counts. Then the complete set follows a step behind."""
    from checkpoints.snapshot_taker import PlannedSnapshot, SnapshotTaker

    store, taker = SnapshotStore(keep), SnapshotTaker()
    state = {"model": {"w": torch.zeros(64)}}
    peak = 0
    for step in range(1, 14):
        state["model"]["w"] += 1
        store.retain(None if step == 1 else (1, 0, 1) if step < 2 + keep else (1, 0, step - 1))
        slot = store.slot_for()
        planned = taker.plan(state, step=step, rank=0, slot=slot)
        assert isinstance(planned, PlannedSnapshot) == (step > 1)  # the first take goes through dcp.save
        if isinstance(planned, PlannedSnapshot):
            store.drop_own_slot(slot)
            snap, used = planned.copy(), slot
        else:
            snap, used = planned, None
        store.put_own((1, 0, step), snap, used)
        peak = max(peak, _live_buffers(store, taker))
        kept = [s.blobs for s, _ in store.own.values()]
        assert len(kept) <= keep
        for snap_blobs in kept:  # no kept snapshot was written over by a later take
            (w,) = [b for b in snap_blobs.values() if isinstance(b, torch.Tensor)]
            assert torch.all(w == w[0]) and 1 <= float(w[0]) <= step
    counted = host_copies(_cfg(tmp_path, f"checkpoint.memory_keep={keep}"))
    assert peak == counted["own"] + counted["first_take"]


def test_held_copies_of_a_peer_stay_at_keep(tmp_path):
    from checkpoints.memory import take_snapshot

    for keep in (2, 3, 4):
        store = SnapshotStore(keep)
        peak = 0
        for step in range(1, 9):
            lag = keep - 1  # the complete set this many steps behind: the newest copies all kept
            store.retain((1, 0, step - lag) if step > lag else None)
            store.keep((1, 0, step), 1, take_snapshot({"w": torch.full((32,), float(step))}, step=step, rank=1))
            peak = max(peak, len(store.held))
        assert peak == host_copies(_cfg(tmp_path, f"checkpoint.memory_keep={keep}"))["held"]


def test_bytes_per_rank_size_the_peer_copies_as_the_largest_state(tmp_path):
    cfg = _cfg(tmp_path, "mesh.pp=2", "mesh.dp=1", "train.global_batch_size=8", "train.micro_batch_size=2")
    plan = make_plan(cfg)
    memory = {p: rank_memory(cfg, plan, p) for p in range(2)}
    state = {p: m["grads"] + m["optimizer"] for p, m in memory.items()}
    largest = max(state.values())
    out = host_bytes_per_rank(cfg, memory)
    assert out == {p: 5 * state[p] + 5 * largest for p in range(2)}  # own 3 + first 1 + staging 1; held 3 + 2
    on_cpu = host_bytes_per_rank(cfg, memory, on_cpu=True)
    assert on_cpu[0] - out[0] == sum(memory[0][k] for k in ("params", "grads", "optimizer", "activations"))


def test_node_rooms_count_the_ranks_each_node_can_hold():
    rooms = node_rooms([("a" * 40, {"CPU": 8.0, "memory": 3e9, "object_store_memory": 1e9}),
                        ("b" * 40, {"CPU": 1.0, "GPU": 4.0, "memory": 2e9})], {"CPU": 2.0})
    assert rooms == [NodeRoom("a" * 40, 4_000_000_000, 4), NodeRoom("b" * 40, 2_000_000_000, 0)]
    assert node_rooms([("c", {"CPU": 8.0, "GPU": 2.0})], {"CPU": 1.0, "GPU": 1.0})[0].rank_slots == 2


def test_launch_check_refuses_a_node_the_copies_do_not_fit(tmp_path):
    cfg = _cfg(tmp_path, "mesh.dp=4", "train.global_batch_size=8", "train.micro_batch_size=2")
    plan = make_plan(cfg)
    memory = {0: rank_memory(cfg, plan, 0)}
    per_rank = host_bytes_per_rank(cfg, memory)[0]
    # Room for the 4 ranks' copies on a node that holds 4 ranks; a node of 2 slots needs half.
    check_node_memory(cfg, 4, memory, [NodeRoom("n1", 4 * per_rank, 4), NodeRoom("n2", 2 * per_rank, 2)],
                      on_cpu=False)
    with pytest.raises(UserInputError) as refused:
        check_node_memory(cfg, 4, memory, [NodeRoom("n1", 4 * per_rank, 8), NodeRoom("bignode" * 6, 4 * per_rank - 1, 4)],
                          on_cpu=False)
    line = str(refused.value)
    assert "\n" not in line and refused.value.exit_code == 2
    for needle in ("checkpoint.memory_keep=3", "4 ranks on Ray node bignodebigno", "10 copies",
                   "checkpoint.memory_every=0", "resources.cpus_per_worker"):
        assert needle in line, line
    # Fewer copies fit: memory_keep=2 needs 8 copies a rank.
    fewer = _cfg(tmp_path, "mesh.dp=4", "train.global_batch_size=8", "train.micro_batch_size=2", "checkpoint.memory_keep=2")
    check_node_memory(fewer, 4, memory, [NodeRoom("n", 4 * per_rank - 1, 4)], on_cpu=False)
    # No snapshots and no background write: nothing to count, nothing refused.
    off = _cfg(tmp_path, "checkpoint.memory_every=0", "checkpoint.async=false")
    check_node_memory(off, 4, memory, [NodeRoom("n", 1, 4)], on_cpu=True)
