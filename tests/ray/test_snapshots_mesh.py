"""In-memory snapshots of a dp x pp x tp mesh restore into the smaller mesh left after a rank dies:
every stage's TP shards of one replica, merged and resharded by DCP, equal the single-process
reference (tests/ray/test_snapshots.py covers the kill/fallback acceptance on a multi-node cluster)."""

from __future__ import annotations

import pytest

from testbed.fault_runs import run_with_fault
from testbed.ray_harness import events, last_losses
from testbed.reference import CONTROLLER_FP32, assert_matches_reference, reference

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.timeout(400)
def test_pp_tp_mesh_restores_from_snapshots(ray_local, store_address, tmp_path):
    def settled(c, step):  # the snapshot of step 4 reached its holders before the kill in step 5
        if step in (4, 5):
            c.snapshots.settle(c.group)

    controller, summary, overrides = run_with_fault(
        tmp_path, store_address, ["mesh.dp=2", "mesh.pp=2", "mesh.tp=2", "checkpoint.memory_every=1"], "kill",
        victim_rank=5, at_step=5, where="forward", hooks=[settled])
    assert summary.restarts == 1 and summary.final_step == 8
    rebuild, = events(tmp_path / "m.jsonl", "rebuild")
    assert (rebuild["restored_from"], rebuild["resumed_from_step"]) == ("snapshot", 4)
    assert (rebuild["dp"], rebuild["pp"], rebuild["tp"]) == (1, 2, 2)
    assert_matches_reference(last_losses(tmp_path / "m.jsonl"), None, reference(overrides, 8), CONTROLLER_FP32)
