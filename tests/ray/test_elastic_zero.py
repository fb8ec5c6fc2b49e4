"""A shrink and a grow under ZeRO-0 and under HSDP: losses and parameters still equal one process.

ZeRO-0 (mesh.zero=0) is FSDP2 on a (replicate=dp, shard=1) mesh, so a resize changes the replicate
axis; HSDP (dp=4, dp_replicate=2) keeps shard groups of 2 ranks: the shrink to dp=2 drops a whole
replica (one group of 2: plain FSDP over 2), the grow back to dp=4 adds it again
(meshspeak.dp_plan.replicate_degree). State crosses each resize through the checkpoint (DCP reshards).
Both runs use the module's four actors (tests/ray/conftest.py ``pool4``): a resize kills no process.
"""

from __future__ import annotations

import pytest

from orchestrator.config.load import load_config
from testbed.ray_harness import events, last_losses, make_controller, mesh_params
from testbed.reference import CONTROLLER_FP32, TEST_LR, assert_matches_reference, reference

pytestmark = pytest.mark.ray

STEPS = 6
OVERRIDES = [TEST_LR, "model.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
             f"train.steps={STEPS}", "mesh.dp=4", "mesh.pp=1", "mesh.tp=1", "checkpoint.every=2",
             "elastic.collective_timeout_s=60", "elastic.grow_check_s=1e6"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", [("mesh.zero=0",), ("mesh.zero=3", "mesh.dp_replicate=2")],
                         ids=["zero0", "hsdp"])
def test_shrink_and_grow_match_reference(strategy, pool4, store_address, tmp_path):
    overrides = [*OVERRIDES, *strategy, f"checkpoint.dir={tmp_path / 'ckpt'}",
                 f"metrics.path={tmp_path / 'm.jsonl'}"]
    cfg = load_config(None, overrides)
    pids = dict(pool4.pids)
    controller = make_controller(cfg, pool4, store_address)
    controller.resize_requests = {3: 2, 5: 4}
    summary = controller.run()
    assert summary.final_step == STEPS
    # (dp, replica groups) of each generation, as the ranks were told to build them
    resizes = events(tmp_path / "m.jsonl", "rebuild") + events(tmp_path / "m.jsonl", "grow")
    got = [(e["dp"], e["dp_replicate"]) for e in sorted(resizes, key=lambda e: e["generation"])]
    assert got == ([(2, 2), (4, 4)] if strategy[0] == "mesh.zero=0" else [(2, 1), (4, 2)])
    assert_matches_reference(last_losses(tmp_path / "m.jsonl"), mesh_params(controller),
                             reference(overrides, STEPS), CONTROLLER_FP32)
    assert pool4.pids == pids  # the shrink and the grow re-formed the same processes
