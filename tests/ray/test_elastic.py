"""Faults injected on purpose: the run shrinks in place (same survivor pids) and still equals one process."""

from __future__ import annotations

import json

import pytest

from testbed.fault_runs import resumed_from_newest_committed, run_with_fault
from testbed.ray_harness import events, last_losses
from testbed.reference import CONTROLLER_FP32, assert_matches_reference, reference

pytestmark = pytest.mark.ray

# These (and tests/ray/test_elastic_rebuild.py) prove recovery from committed checkpoints; from
# in-memory snapshots: tests/ray/test_snapshots.py.


@pytest.mark.timeout(400)
def test_kill_one_actor_of_dp4_shrinks_and_matches(ray_local, store_address, tmp_path):
    # Killed right after its first forward of step 5 (not on a timer, which a fast step can outrun):
    # the survivors are then blocked in step 5's backward collectives.
    controller, summary, overrides = run_with_fault(
        tmp_path, store_address, ["mesh.dp=4", "mesh.tp=1"], "kill", victim_rank=1, at_step=5,
        where="forward")
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
    assert_matches_reference(last_losses(tmp_path / "m.jsonl"), None, reference(overrides, 8), CONTROLLER_FP32)


@pytest.mark.timeout(400)
def test_sigstopped_rank_is_detected_and_dropped(ray_local, store_address, tmp_path):
    # Stopped in step 3, before the generation's pace is known (HangWatch's MIN_HISTORY), so no probe
    # runs: it is found when elastic.step_timeout_s runs out and the stopped rank answers no status,
    # while its live peer does (a live rank is never failed by the timeout alone: extended_bound). The
    # timeout only bounds how long that takes (20 s until this took most of the test's 31 s).
    controller, summary, overrides = run_with_fault(
        tmp_path, store_address, ["mesh.dp=2", "mesh.tp=1"], "hang", victim_rank=0, at_step=3,
        extra=["elastic.step_timeout_s=8"], where="forward")
    assert summary.restarts == 1 and controller.generation.shape.dp == 1
    failure, = events(tmp_path / "m.jsonl", "failure")
    assert failure["step"] == 3 and failure["ranks"] == [0]  # stopped after its first forward of step 3
    assert_matches_reference(last_losses(tmp_path / "m.jsonl"), None, reference(overrides, 8), CONTROLLER_FP32)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("dp,pp,tp,victim", [
    (2, 2, 1, 1),
    # slow (8 actors, ~55 s): the replica drop with tp as well; tp survives shrinks in test_elastic_zero
    # and test_checkpoint_resume's reshards in the default run
    pytest.param(2, 2, 2, 5, marks=pytest.mark.slow),
])
def test_kill_drops_the_whole_replica_keeps_pp_tp(ray_local, store_address, tmp_path, dp, pp, tp, victim):
    """A rank of a (2,2,1) / (2,2,2) mesh dies mid-step: one whole replica goes, pp x tp stays."""
    controller, summary, overrides = run_with_fault(
        tmp_path, store_address, [f"mesh.dp={dp}", f"mesh.pp={pp}", f"mesh.tp={tp}"], "kill",
        victim_rank=victim, at_step=5, delay_s=0.0)
    assert summary.restarts == 1 and summary.final_step == 8
    shape = controller.generation.shape
    assert (shape.dp, shape.pp, shape.tp) == (1, pp, tp)
    # The survivors not in the new mesh stay as spares, alive.
    assert len(summary.pids) == dp * pp * tp - 1  # live actors at the end
    failure, = events(tmp_path / "m.jsonl", "failure")
    assert failure["step"] == 5 and failure["ranks"] == [victim]
    rebuild, = events(tmp_path / "m.jsonl", "rebuild")
    assert (rebuild["dp"], rebuild["pp"], rebuild["tp"]) == (1, pp, tp)
    assert resumed_from_newest_committed(tmp_path / "m.jsonl") == [rebuild["resumed_from_step"]]
    assert_matches_reference(last_losses(tmp_path / "m.jsonl"), None, reference(overrides, 8), CONTROLLER_FP32)


@pytest.mark.timeout(400)
def test_two_failures_in_a_row(ray_local, store_address, tmp_path):
    """Rank 1 dies in step 3; after that rebuild (dp=2 + a spare) rank 2 dies in step 6: the spare
    takes its place (dp=2 again) and the run still equals one process."""
    controller, summary, overrides = run_with_fault(
        tmp_path, store_address, ["mesh.dp=4", "mesh.tp=1"], "kill", victim_rank=1, at_step=3,
        delay_s=0.0, more=[(2, 6, "kill", 0.0, "step")])
    assert summary.restarts == 2 and summary.final_step == 8
    assert [f["step"] for f in events(tmp_path / "m.jsonl", "failure")] == [3, 6]
    rebuilds = events(tmp_path / "m.jsonl", "rebuild")
    assert [(r["generation"], r["dp"], r["spares"]) for r in rebuilds] == [(2, 2, 1), (3, 2, 0)]
    # Generation 1's rank 3 was the spare of generation 2 and is a member of generation 3.
    assert sorted(controller.generation.members.values()) == [0, 3]
    assert len(resumed_from_newest_committed(tmp_path / "m.jsonl")) == 2
    assert_matches_reference(last_losses(tmp_path / "m.jsonl"), None, reference(overrides, 8), CONTROLLER_FP32)
