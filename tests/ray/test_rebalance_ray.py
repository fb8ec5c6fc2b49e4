"""``elastic.rebalance`` end to end on rank actors: the driver measures, splits and hands out the split.

dp=3 at ZeRO-3 with one FSDP unit per block (the layout whose all-gathers depend on a replica's
count); world rank 0 sleeps 50 ms in every microbatch (the ``sleep`` fault at "microbatch", a slow
device). The controller rebalances it to fewer microbatches (``rebalance`` event), a requested
resize to dp=2 at step 8 starts the new generation even and rebalances it again from the slow
actor's history at once, and every step's loss and the final parameters equal one process's.
"""

from __future__ import annotations

import pytest

from meshspeak.rank_calls import RankCalls
from orchestrator.config.load import load_config
from testbed.ray_cluster import make_group
from testbed.ray_harness import events, last_losses, make_controller, mesh_params
from testbed.reference import CONTROLLER_FP32, TEST_LR, assert_matches_reference, reference

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 12
BASE = [TEST_LR, "model.seq_len=32", "model.d_model=32", "model.n_heads=4", "train.global_batch_size=24",
        "train.micro_batch_size=1", f"train.steps={STEPS}", "mesh.tp=1", "mesh.zero=3", "mesh.fsdp_unit_mb=0",
        "checkpoint.every=2", "elastic.collective_timeout_s=60", "elastic.grow_check_s=1e6"]


@pytest.mark.timeout(600)
def test_slow_replica_rebalanced_across_a_resize_equals_one_process(ray_local, store_address, tmp_path):
    overrides = BASE + ["mesh.dp=3", "elastic.rebalance=true", f"checkpoint.dir={tmp_path / 'ckpt'}",
                        f"metrics.path={tmp_path / 'm.jsonl'}"]
    cfg = load_config(None, overrides)
    group = make_group(3)
    try:
        controller = make_controller(cfg, group, store_address)
        controller.advance()  # generation 1 formed
        slow = controller.generation.members[0]
        group.call([slow], RankCalls.arm_fault, (1, "sleep", 0.05, "microbatch", STEPS + 1), timeout_s=10)
        controller.resize_requests = {8: 2}
        summary = controller.run()
        final = dict(controller.generation.members)
        params = mesh_params(controller)
    finally:
        group.shutdown()
    assert summary.final_step == STEPS and summary.restarts == 0
    assert controller.generation.number == 2 and final[0] == slow  # dp=2 keeps the slow actor at rank 0
    moves = events(tmp_path / "m.jsonl", "rebalance")
    before = [e for e in moves if e["step"] < 8]
    after = [e for e in moves if e["step"] >= 8]
    # Generation 1: the slow replica (dp 0) gets fewer than the even 8 of 24 microbatches.
    assert before and len(before[-1]["microbatches"]) == 3 and before[-1]["microbatches"][0] < 8
    assert before[-1]["speeds"][0] < min(before[-1]["speeds"][1:])
    # Generation 2 starts even (12, 12) and is rebalanced at its first step from the actor's history.
    assert after[0]["step"] == 8 and len(after[0]["microbatches"]) == 2 and after[0]["microbatches"][0] < 12
    assert sum(after[0]["microbatches"]) == 24
    assert_matches_reference(last_losses(tmp_path / "m.jsonl"), params, reference(BASE, STEPS), CONTROLLER_FP32)
