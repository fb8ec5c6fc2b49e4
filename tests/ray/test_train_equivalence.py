"""The real controller + Ray actors train exactly what one process trains, and re-form in place."""

from __future__ import annotations

import pytest

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
