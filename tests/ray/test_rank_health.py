"""Rank health with real actors: bad steps, stragglers and hot spares, each against the reference.

* A NaN put into one rank's gradient (``arm_fault(kind="nan")``) makes every rank skip that step; the
  run's losses and parameters equal the single-process run that skipped the same batch.
* A rank sleeping in each step's forward (``arm_fault(kind="sleep")``) is reported as a straggler within
  ``straggler_steps + 1`` steps and, with ``evict_stragglers``, swapped for the hot spare at the next
  step boundary: dp unchanged, the other rank's process kept, losses still equal one process.
* A step slower than ``elastic.step_timeout_s`` whose ranks keep finishing actions (one sleeps in every
  microbatch's forward) is waited for: no failure, losses equal one process. Time alone never fails a
  live run; only a step in which no rank progressed for that long is a hang.
* A rank killed mid-step with ``elastic.spares = 1``: dp unchanged, the spare promoted, a new spare
  started.

The tests that lose no process share one pair of actors (``pair``), disarmed after each run
(``RankActor.disarm_faults``: a step fault stays armed for its step numbers, which the next run counts
again from 1); the rollback's restore among them reads its own run's snapshots only (an actor joining
another run drops the last one's: ``RankActor._enter_run``). Those with a spare start their own three.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from meshspeak.rank_calls import RankCalls
from orchestrator.config.load import load_config
from testbed.ray_cluster import make_group
from testbed.ray_harness import events, last_losses, make_controller, mesh_params, step_records
from testbed.reference import CONTROLLER_FP32, TEST_LR, assert_matches_reference, assert_params_match, reference

pytestmark = pytest.mark.ray

BASE = [TEST_LR, "model.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=8",
        "checkpoint.every=2", "elastic.collective_timeout_s=60", "elastic.grow_check_s=1e6", "mesh.tp=1"]


@pytest.fixture(scope="module")
def pair(ray_local):
    """Two actors for the tests that kill none (each disarms them when done: ``_disarm``)."""
    group = make_group(2)
    yield group
    group.shutdown()


def _start(tmp_path, store_address, extra: list[str], group):
    overrides = BASE + extra + [f"checkpoint.dir={tmp_path / 'ckpt'}", f"metrics.path={tmp_path / 'm.jsonl'}"]
    cfg = load_config(None, overrides)
    controller = make_controller(cfg, group, store_address)
    controller.advance()  # INITIALIZING -> RUNNING
    return overrides, controller


def _disarm(group) -> None:
    """The pair's faults dropped for the next test (a spent step fault would fire again there)."""
    assert group.call(group.live_ids, RankCalls.disarm_faults, timeout_s=30).ok


@pytest.mark.timeout(300)
def test_nan_in_one_rank_gradient_is_skipped_everywhere(pair, store_address, tmp_path):
    overrides, controller = _start(tmp_path, store_address, ["mesh.dp=2"], pair)
    try:
        victim = controller.generation.members[1]
        pair.call([victim], RankCalls.arm_fault, (3, "nan", 0.0, "step"), timeout_s=10)
        summary = controller.run()
        params = mesh_params(controller)
    finally:
        _disarm(pair)
    assert summary.final_step == 8 and summary.restarts == 0
    bad, = events(tmp_path / "m.jsonl", "bad_step")
    assert (bad["step"], bad["reason"]) == (3, "grad_norm")
    ref = reference(overrides, 8, skip={3})
    losses = last_losses(tmp_path / "m.jsonl")
    assert sorted(losses) == [1, 2, 4, 5, 6, 7, 8]
    np.testing.assert_allclose([losses[s] for s in sorted(losses)], [ref.losses[s - 1] for s in sorted(losses)],
                               rtol=1e-5)
    assert_params_match(params, ref.params, CONTROLLER_FP32)


@pytest.mark.timeout(300)
def test_a_slow_step_that_progresses_outlives_the_step_timeout(pair, store_address, tmp_path):
    extra = ["mesh.dp=2", "elastic.step_timeout_s=3", "elastic.hang_probe_factor=0"]
    overrides, controller = _start(tmp_path, store_address, extra, pair)
    try:
        slow = controller.generation.members[1]
        # Steps 3-4: 1.5 s in each of the rank's 2 microbatch forwards, so each step runs past the 3 s
        # bound while the rank finishes an action every 1.5 s (its peer waits in the gradients' reduce);
        # 1.5 s of slack for a loaded host's scheduling, as 2.5 s under 4 s had.
        pair.call([slow], RankCalls.arm_fault, (3, "sleep", 1.5, "microbatch", 2), timeout_s=10)
        summary = controller.run()
    finally:
        _disarm(pair)
    assert summary.final_step == 8 and summary.restarts == 0
    assert events(tmp_path / "m.jsonl", "failure") == []
    records = step_records(tmp_path / "m.jsonl")
    assert min(records[3]["step_time_s"], records[4]["step_time_s"]) > 3.0  # past elastic.step_timeout_s
    ref = reference(overrides, 8)
    losses = last_losses(tmp_path / "m.jsonl")
    np.testing.assert_allclose([losses[s] for s in range(1, 9)], ref.losses[:8], rtol=1e-5)


@pytest.mark.timeout(400)
def test_straggler_reported_and_evicted_for_the_spare(ray_local, store_address, tmp_path):
    # elastic.min_dp=2: once the slow rank is swapped for the spare, the driver starts a new spare, and on a
    # 2-core machine that process's start (importing torch) can starve one of the two ranks for the steps
    # left, which is then reported as a straggler too (seen in CI). With dp held at 2 such a rank is kept
    # while no new spare is ready, and swapped for it if one is; the test is about the rank that sleeps.
    extra = ["mesh.dp=2", "elastic.spares=1", "elastic.straggler_steps=2", "elastic.straggler_factor=2.0",
             "elastic.evict_stragglers=true", "elastic.min_dp=2"]
    group = make_group(3)
    try:
        overrides, controller = _start(tmp_path, store_address, extra, group)
        members = dict(controller.generation.members)
        spare, = controller.spare_ids
        slow, other = members[1], members[0]
        other_pid = group.pids[other]
        # From step 2 on, a 0.5 s sleep inside the rank's first block forward of every step (the
        # issue's fault: a rank that is slow without computing more; the others' forwards take ~0.01 s).
        group.call([slow], RankCalls.arm_fault, (2, "sleep", 0.5, "step", 100), timeout_s=10)
        summary = controller.run()
        final = dict(controller.generation.members)
    finally:
        group.shutdown()
    straggler, *starved = events(tmp_path / "m.jsonl", "straggler")
    assert straggler["rank"] == 1 and straggler["actor"] == slow and straggler["factor"] > 2.0
    assert all(s["actor"] != slow and s["step"] > straggler["step"] for s in starved), starved  # see min_dp above
    evict, *later = events(tmp_path / "m.jsonl", "evict")
    assert evict["actors"] == [slow] and 2 <= evict["step"] <= 2 + 2  # within straggler_steps + 1 steps
    assert events(tmp_path / "m.jsonl", "spare_promoted")[0]["actors"] == [spare]
    assert len(final) == 2 and slow not in final.values() and summary.restarts == 0  # dp unchanged
    assert all(slow not in e["actors"] for e in later), later
    if not later:  # the usual case: nothing else was evicted, the other rank kept its process
        assert sorted(final.values()) == sorted([other, spare]) and group.pids.get(other, other_pid) == other_pid
    assert_matches_reference(last_losses(tmp_path / "m.jsonl"), None, reference(overrides, 8), CONTROLLER_FP32)


@pytest.mark.timeout(400)
def test_killed_rank_replaced_by_the_spare_and_a_new_spare_started(ray_local, store_address, tmp_path):
    group = make_group(3)
    try:
        overrides, controller = _start(tmp_path, store_address, ["mesh.dp=2", "elastic.spares=1"], group)
        spare, = controller.spare_ids
        victim = controller.generation.members[0]
        group.call([victim], RankCalls.arm_fault, (4, "kill", 0.0, "forward"), timeout_s=10)
        summary = controller.run()
        final = dict(controller.generation.members)
        # The new spare was started in the background; the run may end before it answers.
        late = []
        while group.starting:
            late += group.adopt_started()
            time.sleep(0.2)
        live = list(group.live_ids)
    finally:
        group.shutdown()
    assert summary.restarts == 1 and controller.generation.shape.dp == 2
    assert spare in final.values() and victim not in live
    promoted, = events(tmp_path / "m.jsonl", "spare_promoted")
    assert promoted["actors"] == [spare] and promoted["generation"] == 2
    requested, = events(tmp_path / "m.jsonl", "spare_requested")
    assert requested["count"] == 1
    new_spare, = [a for e in events(tmp_path / "m.jsonl", "actors_ready") for a in e["actors"]] + late
    assert len(live) == 3 and new_spare in live and new_spare not in final.values()
    assert_matches_reference(last_losses(tmp_path / "m.jsonl"), None, reference(overrides, 8), CONTROLLER_FP32)


@pytest.mark.timeout(300)
def test_bad_steps_in_a_row_roll_back_and_go_on_past_the_batches(pair, store_address, tmp_path):
    overrides, controller = _start(tmp_path, store_address, ["mesh.dp=2", "train.max_bad_steps=2"], pair)
    try:
        victim = controller.generation.members[0]
        pair.call([victim], RankCalls.arm_fault, (5, "nan", 0.0, "step", 2), timeout_s=10)  # steps 5 and 6
        summary = controller.run()
        params = mesh_params(controller)
    finally:
        _disarm(pair)
    assert summary.final_step == 8 and summary.restarts == 0
    rollback, = events(tmp_path / "m.jsonl", "rollback")
    assert (rollback["step"], rollback["resumed_from_step"], rollback["skipped"]) == (6, 4, [5, 6])
    assert [(e["step"], e["reason"]) for e in events(tmp_path / "m.jsonl", "bad_step")] == [
        (5, "grad_norm"), (6, "grad_norm"), (5, "recorded"), (6, "recorded")]
    ref = reference(overrides, 8, skip={5, 6})
    losses = last_losses(tmp_path / "m.jsonl")
    assert sorted(losses) == [1, 2, 3, 4, 7, 8]
    np.testing.assert_allclose([losses[s] for s in sorted(losses)], [ref.losses[s - 1] for s in sorted(losses)],
                               rtol=1e-5)
    assert_params_match(params, ref.params, CONTROLLER_FP32)
