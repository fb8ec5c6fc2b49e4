"""Faults injected on purpose: the run shrinks in place (same survivor pids) and still equals one process."""

from __future__ import annotations

import json

import pytest

from orchestrator.config import load_config
from tests.ray.conftest import make_group
from tests.ray.harness import assert_matches_reference, events, last_losses, make_controller

pytestmark = pytest.mark.ray

BASE = ["model.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=8",
        "checkpoint.every=2", "elastic.collective_timeout_s=60", "elastic.grow_check_s=1e6"]


def _run_with_fault(tmp_path, store_address, mesh: list[str], kind: str, victim_rank: int, at_step: int,
                    extra: list[str] = ()):
    overrides = BASE + mesh + list(extra) + [f"checkpoint.dir={tmp_path / 'ckpt'}",
                                             f"metrics.path={tmp_path / 'm.jsonl'}"]
    cfg = load_config(None, overrides)
    group = make_group(cfg.mesh.world)
    try:
        controller = make_controller(cfg, group, store_address)
        controller.step()  # INITIALIZING -> RUNNING (generation 1 formed)
        victim = controller.generation.members[victim_rank]
        survivors = {a: group.pids[a] for a in group.live_ids if a != victim}
        group.call([victim], "arm_fault", (at_step, kind, 0.2), timeout_s=10)
        summary = controller.run()
        for actor, pid in survivors.items():  # no survivor was restarted
            assert group.pids[actor] == pid
        assert victim not in group.live_ids
        return controller, summary, overrides
    finally:
        group.shutdown()


@pytest.mark.timeout(400)
def test_kill_one_actor_of_dp4_shrinks_and_matches(ray_local, store_address, tmp_path):
    controller, summary, overrides = _run_with_fault(
        tmp_path, store_address, ["mesh.dp=4", "mesh.tp=1"], "kill", victim_rank=1, at_step=5)
    assert summary.restarts == 1 and summary.final_step == 8
    # 3 live actors; dp=3 does not divide the 8-sample batch into 2-sample microbatches -> dp=2 + a spare
    assert controller.generation.shape.dp == 2
    failure, = events(tmp_path / "m.jsonl", "failure")
    assert failure["step"] == 5 and failure["ranks"] == [1]
    rebuild, = events(tmp_path / "m.jsonl", "rebuild")
    # Step 4's shards may still be in flight when the rank dies at step 5: then step 4 is never
    # committed and the run resumes from step 2. Either way only a committed step is used.
    assert rebuild["resumed_from_step"] in (2, 4) and rebuild["recovery_s"] > 0
    records = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    failed_at = next(i for i, r in enumerate(records) if r.get("event") == "failure")
    committed_before = {r["step"] for r in records[:failed_at] if r.get("event") == "checkpoint"}
    assert rebuild["resumed_from_step"] == max(committed_before)
    assert_matches_reference(last_losses(tmp_path / "m.jsonl"), None, overrides, 8)


@pytest.mark.timeout(400)
def test_sigstopped_rank_is_detected_and_dropped(ray_local, store_address, tmp_path):
    controller, summary, overrides = _run_with_fault(
        tmp_path, store_address, ["mesh.dp=2", "mesh.tp=1"], "hang", victim_rank=0, at_step=3,
        extra=["elastic.step_timeout_s=20"])
    assert summary.restarts == 1 and controller.generation.shape.dp == 1
    failure, = events(tmp_path / "m.jsonl", "failure")
    # The SIGSTOP fires 0.2 s into step 3; when step 3 is faster than that it lands in step 4.
    assert failure["step"] in (3, 4)
    assert_matches_reference(last_losses(tmp_path / "m.jsonl"), None, overrides, 8)
