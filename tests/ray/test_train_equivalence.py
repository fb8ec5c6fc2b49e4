"""The real controller + Ray actors train exactly what one process trains, and re-form in place."""

from __future__ import annotations

import pytest

from meshspeak.rank_calls import RankCalls
from orchestrator.config.load import load_config
from testbed.ray_harness import last_losses, make_controller, mesh_params
from testbed.reference import CONTROLLER_FP32, TEST_LR, assert_matches_reference, reference

pytestmark = pytest.mark.ray

SMALL = [TEST_LR, "model.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_mesh_matches_single_process(dp, tp, pool4, store_address, tmp_path):
    overrides = SMALL + [f"mesh.dp={dp}", "mesh.pp=1", f"mesh.tp={tp}", "train.steps=10",
                         f"metrics.path={tmp_path / 'm.jsonl'}"]
    cfg = load_config(None, overrides)
    controller = make_controller(cfg, pool4, store_address)
    summary = controller.run()
    assert summary.final_step == 10
    assert_matches_reference(summary.losses, mesh_params(controller), reference(overrides, 10), CONTROLLER_FP32)
    assert last_losses(tmp_path / "m.jsonl") == summary.losses


@pytest.mark.timeout(400)
def test_rebuild_twice_in_same_processes(pool4, store_address, tmp_path):
    """dp=2 x tp=2 -> rebuilt at the same size -> rebuilt smaller (dp=1): same math, same pids."""
    overrides = SMALL + ["mesh.dp=2", "mesh.pp=1", "mesh.tp=2", "train.steps=10", "elastic.grow_check_s=1e6",
                         f"metrics.path={tmp_path / 'm.jsonl'}"]
    cfg = load_config(None, overrides)
    pids_before = dict(pool4.pids)
    controller = make_controller(cfg, pool4, store_address)
    controller.resize_requests = {4: 2, 7: 1}
    summary = controller.run()
    assert summary.generations == 3
    assert controller.generation.shape.dp == 1
    assert pool4.pids == pids_before  # no actor was restarted
    assert_matches_reference(summary.losses, mesh_params(controller), reference(overrides, 10), CONTROLLER_FP32)


@pytest.mark.timeout(300)
def test_a_new_run_on_the_same_actors_finds_none_of_the_last_runs_snapshots(pool4, store_address, tmp_path):
    """In-memory snapshots are keyed (generation, life, step), which every run counts from 1, so a new
    run on reused actors must never count the last run's as its own: the restore's inventory poll,
    which every formation sends to every live actor and which carries the run id, is answered with none
    of them, each actor dropping them then (``RankActor._enter_run``), spares included."""
    def cfg(run: str, dp: int):
        return load_config(None, SMALL + [f"mesh.dp={dp}", "mesh.pp=1", "mesh.tp=1", "train.steps=3",
                                          f"checkpoint.dir={tmp_path / run / 'ckpt'}",
                                          f"metrics.path={tmp_path / run / 'm.jsonl'}"])

    def inventories(*run_id: str):
        return pool4.call(pool4.live_ids, RankCalls.snapshot_inventory, run_id, timeout_s=30).results

    pids = dict(pool4.pids)
    assert make_controller(cfg("first", 4), pool4, store_address).run().final_step == 3
    assert all(inv.own and inv.held for inv in inventories().values())  # its snapshots, and a peer's copy
    second = make_controller(cfg("second", 2), pool4, store_address)
    second.advance()  # the second run's generation 1 formed on two of the four, no step trained yet
    members = set(second.generation.members.values())
    assert len(members) == 2 and len(set(pool4.live_ids) - members) == 2
    # Members and spares dropped the first run's when the formation's restore plan polled them.
    assert all(not inv.own and not inv.held for inv in inventories().values()), inventories()
    assert all(not inv.own for inv in inventories(second.context.identity.run_id).values())
    assert second.run().final_step == 3
    assert all(inventories()[a].own for a in members)  # the second run's own
    assert pool4.pids == pids
