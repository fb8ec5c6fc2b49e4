"""Failures at the awkward moments: while a generation is being formed, and while a checkpoint is
being written. Each still ends equal to one process, with the survivors' processes unchanged."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from checkpoints.catalog import check_checkpoint
from checkpoints.layout import step_dir_name
from testbed.fault_runs import resumed_from_newest_committed, run_with_fault
from testbed.ray_harness import events, last_losses
from testbed.reference import CONTROLLER_FP32, assert_matches_reference, reference

pytestmark = pytest.mark.ray

# A group (and store) timeout longer than the test's own timeout: recovery must come from the driver
# freeing the survivors. Had actor 0 been left to wait out gloo or the store, the test would overrun
# its pytest timeout and fail; no wall-clock assertion needed.
TEST_TIMEOUT_S = 500
SLOW_TIMEOUT = f"elastic.collective_timeout_s={TEST_TIMEOUT_S + 100}"


@pytest.mark.timeout(TEST_TIMEOUT_S)
# "load" in the slow run only (~22 s): a rank lost while loading is freed the same way on the fake
# group (tests/unit/test_controller.py, test_member_dies_while_rebuilding); "join" keeps the
# rendezvous kick on real ranks.
@pytest.mark.parametrize("where", ["join", pytest.param("load", marks=pytest.mark.slow)])
def test_rank_dies_during_rebuild(ray_local, store_address, tmp_path, where):
    """Rank 1 dies in step 5; while generation 2 (dp=2: actors 0 and 2) forms, actor 2 dies too —
    at the start of joining (actor 0 is then blocked in the rendezvous, waiting in the store for a
    peer that never registers) or at the start of loading the checkpoint (actor 0 is blocked in
    DCP's collectives). The driver frees actor 0 and forms generation 3 with the spare, actor 3."""
    controller, summary, overrides = run_with_fault(
        tmp_path, store_address, ["mesh.dp=4", "mesh.tp=1"], "kill", victim_rank=1, at_step=5,
        delay_s=0.0, extra=[SLOW_TIMEOUT], more=[(2, 2, "kill", 0.0, where)])
    metrics = tmp_path / "m.jsonl"
    assert summary.restarts == 2 and summary.final_step == 8
    first, second = events(metrics, "failure")
    assert first["step"] == 5 and first["ranks"] == [1]
    stage = {"join": "joining", "load": "loading the checkpoint"}[where]
    assert second["reason"].startswith(f"rebuild of generation 2 failed while {stage}")
    assert second["ranks"] == [1]  # actor 2 held rank 1 of generation 2
    rebuild, = events(metrics, "rebuild")  # generation 2 never trained
    assert (rebuild["generation"], rebuild["dp"]) == (3, 2)
    assert sorted(controller.generation.members.values()) == [0, 3]
    assert resumed_from_newest_committed(metrics) == [rebuild["resumed_from_step"]]
    assert_matches_reference(last_losses(metrics), None, reference(overrides, 8), CONTROLLER_FP32)


@pytest.mark.timeout(400)
def test_rank_dies_while_its_checkpoint_shard_is_written(ray_local, store_address, tmp_path):
    """Rank 1 is killed on DCP's writer thread after the first item of its step-4 shard is on disk.
    Step 4 is never committed: the rebuild resumes from step 2, and step 4 is committed later by
    generation 2 only."""
    ckpt = tmp_path / "ckpt"
    seen: dict[int, tuple] = {}

    def look_at_step4(controller, step):  # runs before every step
        if controller.generation.number == 2 and not seen:
            path = str(ckpt / step_dir_name(4))
            files = sorted(f.name for f in Path(path).rglob("*") if f.is_file())  # the attempt dir's too
            seen[step] = (check_checkpoint(path), files if os.path.isdir(path) else None)

    controller, summary, overrides = run_with_fault(
        tmp_path, store_address, ["mesh.dp=2", "mesh.tp=1"], "kill", victim_rank=1, at_step=4,
        where="ckpt_write", hooks=[look_at_step4])
    metrics = tmp_path / "m.jsonl"
    assert summary.restarts == 1 and summary.final_step == 8
    failure, = events(metrics, "failure")
    assert failure["ranks"] == [1]
    records = [json.loads(line) for line in open(metrics)]
    failed_at = next(i for i, r in enumerate(records) if r.get("event") == "failure")
    assert {r["step"] for r in records[:failed_at] if r.get("event") == "checkpoint"} == {2}
    rebuild, = events(metrics, "rebuild")
    assert rebuild["resumed_from_step"] == 2
    # When generation 2 started, step 4 was a partial directory: the victim's shard file was
    # begun (the kill landed inside the write), but no manifest, so it is not a checkpoint.
    (valid, reason, manifest), files = seen[3]
    assert not valid and manifest is None and reason.startswith("partial"), reason
    assert any(name.startswith("__1_") for name in files), files
    # The step-4 checkpoint that exists now was committed by generation 2 (dp=1).
    valid, _, manifest = check_checkpoint(str(ckpt / step_dir_name(4)))
    assert valid and manifest.generation == 2 and manifest.world_size == 1
    assert_matches_reference(last_losses(metrics), None, reference(overrides, 8), CONTROLLER_FP32)
