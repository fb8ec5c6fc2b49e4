"""The controller's rank-health paths on a fake worker group: bad steps (skipped everywhere, recorded,
rolled back after ``train.max_bad_steps`` in a row), stragglers (reported, evicted when asked) and hot
spares (kept beside the mesh, promoted on a failure, replaced by a new one).

Uses the ``make`` fixture and ``Run`` helper of ``tests/unit/test_controller.py``.
"""

from __future__ import annotations

from checkpoints.catalog import list_checkpoints
from meshspeak.messages import StepResult
from meshspeak.rank_calls import RankCalls
from orchestrator.control.controller import State
from orchestrator.recovery.bad_steps import BadSteps, bad_reason
from testbed.controller_run import make  # noqa: F401  (the fixture)


def _result(rank: int, bad: str = "") -> StepResult:
    return StepResult(step=1, world_rank=rank, ok=True, bad=bad, skipped=bool(bad))


# -- bad steps: the pure part -------------------------------------------------------------------------
def test_bad_reason_is_one_decision():
    assert bad_reason(1, [_result(0), _result(1)]) == ""
    assert bad_reason(1, [_result(0, "grad_norm"), _result(1, "loss")]) == "loss"
    assert bad_reason(1, [_result(0, "grad_norm"), _result(1, "grad_norm")]) == "grad_norm"
    try:
        bad_reason(1, [_result(0, "grad_norm"), _result(1)])
    except Exception as exc:
        assert "diverged" in str(exc)
    else:
        raise AssertionError("ranks disagreeing on a skip must stop the run")


def test_bad_steps_in_a_row_call_for_a_rollback():
    b = BadSteps(2)
    assert not b.bad(3)
    b.good()
    assert not b.bad(5) and b.bad(6)  # two in a row
    assert b.skipped == {3, 5, 6} and b.is_skipped(5) and not b.is_skipped(4)
    assert not b.bad(9)  # the count starts over after a rollback


# -- bad steps: the controller --------------------------------------------------------------------
def test_bad_step_is_skipped_logged_and_recorded_in_the_checkpoint(make):
    r = make("train.steps=6", "checkpoint.every=2")
    r.steps(1)  # formed
    r.group.bad_step(3)
    r.steps(6)
    assert r.c.advance() == State.FINISHED
    bad, = r.events("bad_step")
    assert (bad["step"], bad["reason"]) == (3, "grad_norm")
    assert 3 not in r.c.losses and sorted(r.c.losses) == [1, 2, 4, 5, 6]
    assert not r.events("rollback")
    manifests = {i.step: i.manifest for i in list_checkpoints(str(r.ckpt)) if i.valid}
    assert manifests[2].skipped_steps == [] and manifests[4].skipped_steps == [3] and manifests[6].skipped_steps == [3]


def test_max_bad_steps_in_a_row_roll_back_and_replay_them_as_skips(make):
    r = make("train.steps=8", "checkpoint.every=2", "train.max_bad_steps=2")
    r.steps(1)
    r.group.bad_step(5)
    r.group.bad_step(6)
    r.steps(6)  # steps 1..6: 6 is the second bad one in a row
    rollback, = r.events("rollback")
    assert (rollback["step"], rollback["resumed_from_step"], rollback["skipped"]) == (6, 4, [5, 6])
    assert r.c.next_step == 5
    loads = len(r.group.calls(RankCalls.load_checkpoint))
    assert loads == 4  # every member reloaded step 4 in place (same generation)
    assert r.c.generation.number == 1
    r.steps(4)  # 5 and 6 replayed as recorded skips (not trained), then 7, 8
    trained = sorted({args[0] for _, args in r.group.calls(RankCalls.train_step)})
    assert trained == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [a[0] for _, a in r.group.calls(RankCalls.train_step)].count(5) == 4  # trained once (4 ranks), not again
    recorded = [e["step"] for e in r.events("bad_step") if e["reason"] == "recorded"]
    assert recorded == [5, 6]
    assert r.c.advance() == State.FINISHED and sorted(r.c.losses) == [1, 2, 3, 4, 7, 8]


def test_a_resume_skips_the_recorded_steps_again(make, tmp_path):
    first = make("train.steps=4", "checkpoint.every=2")
    first.steps(1)
    first.group.bad_step(3)
    first.steps(4)
    assert first.c.advance() == State.FINISHED
    again = make("train.steps=6", "checkpoint.every=2")  # same checkpoint.dir: resumes from step 4
    again.steps(1)
    assert again.c.next_step == 5 and again.c.bad_steps.skipped == {3}


# -- stragglers -----------------------------------------------------------------------------------
def test_straggler_reported_after_straggler_steps_and_kept_without_eviction(make):
    r = make("train.steps=8", "elastic.straggler_steps=2", "elastic.straggler_factor=2.0")
    r.steps(1)
    slow = r.c.generation.members[2]
    r.group.ranks[slow].forward_s = 1.0  # 2.5x the others' 0.4
    r.steps(3)  # steps 1..3: reported after the second slow step
    event, = r.events("straggler")
    assert (event["rank"], event["actor"], event["factor"]) == (2, slow, 2.5) and event["node"] == "10.0.0.1"
    r.steps(5)
    assert r.c.advance() == State.FINISHED and len(r.events("straggler")) == 1  # once per streak
    assert r.c.generation.number == 1 and not r.group.killed


def test_straggler_evicted_for_a_spare_at_the_next_step_boundary(make):
    r = make("train.steps=8", "elastic.straggler_steps=2", "elastic.evict_stragglers=true", "elastic.spares=1",
             actors=5, capacity=1)
    r.steps(1)
    assert r.c.generation.shape.dp == 4 and len(r.c.spare_ids) == 1
    spare, = r.c.spare_ids
    slow = r.c.generation.members[1]
    r.group.ranks[slow].forward_s = 2.0
    r.steps(2)  # steps 1, 2: reported at step 2
    assert r.events("straggler") and r.c.next_step == 3
    r.steps(1, State.FORMING)  # the boundary before step 3 decides the eviction
    r.steps(1)  # step 2 committed, the straggler dropped, the spare in
    assert slow in r.group.killed and r.c.generation.number == 2 and r.c.generation.shape.dp == 4
    assert spare in r.c.generation.members.values() and r.c.next_step == 3
    evict, = r.events("evict")
    assert (evict["step"], evict["actors"]) == (2, [slow])
    promoted, = r.events("spare_promoted")
    assert promoted["actors"] == [spare]
    assert r.c.restarts == 0 and 2 in r.committed()
    assert not r.events("spare_requested")  # asked for once the new generation's first step was read
    r.steps(1)
    requested, = r.events("spare_requested")  # begun in the background, taken in at the next boundary
    assert requested["count"] == 1 and len(r.c.group.live_ids) == 4 and r.c.group.starting == 1
    r.steps(1)
    ready, = r.events("actors_ready")
    assert len(r.c.group.live_ids) == 5 and r.c.spare_ids == ready["actors"]
    r.steps(4)
    assert r.c.advance() == State.FINISHED and sorted(r.c.losses) == list(range(1, 9))


# -- hot spares -----------------------------------------------------------------------------------
def test_the_first_generation_asks_for_its_spares_once_its_first_step_was_read(make):
    """``elastimesh train`` starts the mesh's actors only (orchestrator/launch.py): waited for there, the
    spares added one actor's start (a process importing torch) to every run's start-up. The first
    formation asks for them once its first step was read, in the background, as every formation does.
    (This is the controller's half; the launch's is that it no longer adds them.)"""
    r = make("train.steps=6", "elastic.spares=1", actors=4, capacity=1)
    assert r.c.advance() == State.RUNNING  # generation 1 formed from the 4 actors there are
    assert r.c.generation.shape.dp == 4 and not r.c.spare_ids and not r.events("spare_requested")
    r.steps(1)  # step 1 read: the spare is asked for
    requested, = r.events("spare_requested")
    assert requested["count"] == 1 and r.group.starting == 1
    r.steps(1)  # the next boundary takes it in
    assert len(r.c.spare_ids) == 1 and len(r.group.live_ids) == 5 and r.c.generation.shape.dp == 4


def test_killed_rank_replaced_by_a_spare_keeps_dp_and_requests_a_new_spare(make):
    r = make("train.steps=6", "elastic.spares=1", actors=5, capacity=1)
    r.steps(1)
    gen1 = r.c.generation
    spare, = r.c.spare_ids
    assert spare not in gen1.members.values()
    victim = gen1.members[3]
    r.group.fail(RankCalls.train_step, victim, "die", at=3)
    r.steps(2)  # steps 1, 2
    assert r.c.advance() == State.REBUILDING
    assert r.c.advance() == State.RUNNING
    gen2 = r.c.generation
    assert gen2.shape.dp == 4 and spare in gen2.members.values() and victim not in gen2.members.values()
    promoted, = r.events("spare_promoted")
    assert promoted["actors"] == [spare] and promoted["generation"] == 2
    assert not r.events("spare_requested")  # not while the new generation's first step runs
    assert r.c.advance() == State.RUNNING  # its first step read, the new spare is asked for
    requested, = r.events("spare_requested")
    assert requested["count"] == 1 and r.group.starting == 1
    assert r.c.advance() == State.RUNNING  # the next boundary takes the new spare in
    # both spares warmed, with the job's model.family (default: gpt) to import while they wait
    assert r.group.calls(RankCalls.warm) == [(spare, ("gpt",)), (r.c.spare_ids[0], ("gpt",))]
    assert len(r.c.spare_ids) == 1 and r.c.spare_ids[0] not in gen1.members.values()  # a new actor
    assert len(r.group.live_ids) == 5
    for _ in range(10):  # resumed from step 0 or 2 (step 2's save may have been in flight)
        if r.c.advance() == State.FINISHED:
            break
    assert r.c.state.kind == State.FINISHED and r.c.generation.shape.dp == 4


def _spare_beside_a_member_failing_in_step_3(r, rank: int, fault: str) -> tuple[int, int]:
    """Form generation 1 (dp 4, one spare), move ``rank``'s actor and the spare to a node of their own,
    arm ``fault`` in that member's step 3 and train steps 1-2: (spare, the member's actor)."""
    r.steps(1)
    spare, = r.c.spare_ids
    victim = r.c.generation.members[rank]
    r.group.node_ids[victim] = r.group.node_ids[spare] = "node-b"
    r.group.fail(RankCalls.train_step, victim, fault, at=3)
    r.steps(2)  # steps 1, 2
    return spare, victim


def test_a_spare_gone_with_a_lost_members_node_is_dropped_not_promoted(make):
    """A node holding a member and the spare vanishes: the member's step never answers, nor does any
    call to the spare (Ray reports them dead only once the GCS declares the node dead). The failure
    path probes the spare beside the lost member and drops it (``spares_lost``): the next generation
    forms at once without it (dp 2) instead of promoting it and failing its join
    (recovery/settle.py, ``silent_spares_beside``)."""
    r = make("train.steps=8", "elastic.spares=1", actors=5, capacity=0)
    spare, victim = _spare_beside_a_member_failing_in_step_3(r, rank=1, fault="hang")
    r.group.ranks[spare].hung = True  # its node goes with the member's, during step 3
    assert r.c.advance() == State.REBUILDING
    lost, = r.events("spares_lost")
    assert lost["actors"] == [spare] and "liveness probe" in lost["reason"]
    failure, = r.events("failure")
    assert failure["ranks"] == [1]  # the spare is no rank: not blamed
    assert sorted(r.group.killed) == sorted([victim, spare]) and spare not in r.c.spare_ids
    assert r.c.advance() == State.RUNNING
    assert r.c.generation.shape.dp == 2 and not r.events("spare_promoted")
    assert len(r.events("failure")) == 1  # no failed join behind it


def test_a_live_spare_beside_a_crashed_member_is_asked_and_promoted(make):
    """A member's process dies; the spare on its node answers the probe in time and takes its place."""
    r = make("train.steps=8", "elastic.spares=1", actors=5, capacity=0)
    spare, victim = _spare_beside_a_member_failing_in_step_3(r, rank=2, fault="die")
    assert r.c.advance() == State.REBUILDING
    assert spare in [a for a, _ in r.group.calls(RankCalls.status)]  # asked, as the spare beside the lost member
    assert not r.events("spares_lost") and r.group.killed == [victim]
    assert r.c.advance() == State.RUNNING
    promoted, = r.events("spare_promoted")
    assert promoted["actors"] == [spare] and r.c.generation.shape.dp == 4


def test_spare_that_cannot_be_placed_yet_is_asked_for_once_the_cluster_has_room(make):
    """No room: no placement group is left pending for the spare (issue 25/29: the autoscaler request
    stands for it), the steps go on; a node joins: the next grow check starts it."""
    r = make("train.steps=6", "elastic.spares=1", "elastic.grow_check_s=1", actors=5, capacity=0)
    r.steps(1)
    r.group.fail(RankCalls.train_step, r.c.generation.members[0], "die", at=2)
    r.steps(1)
    assert r.c.advance() == State.REBUILDING and r.c.advance() == State.RUNNING
    assert r.c.generation.shape.dp == 4
    assert not r.events("spare_requested") and r.group.starting == 0
    r.clock.t += 5
    r.steps(1)  # a grow check with still no room: still nothing asked for
    assert not r.events("spare_requested") and len(r.group.live_ids) == 4
    r.group.capacity = 1  # a node joins
    r.clock.t += 5
    r.steps(1)  # the grow check asks for it
    assert [e["count"] for e in r.events("spare_requested")] == [1] and r.group.starting == 1
    r.steps(1)  # and the next boundary takes it in
    assert len(r.events("actors_ready")) == 1 and len(r.group.live_ids) == 5 and r.group.starting == 0


def test_a_spare_lost_with_its_node_is_dropped_and_replaced(make):
    r = make("train.steps=8", "elastic.spares=1", "elastic.grow_check_s=1", actors=5, capacity=1)
    r.steps(1)
    spare, = r.c.spare_ids
    r.group.lost = {spare}  # its node died: WorkerGroup removed its placement group and reports it
    r.clock.t += 5
    r.steps(1)  # the boundary drops it; the grow check asks for a new one where there is room
    assert spare in r.group.killed and spare not in r.c.spare_ids
    assert [e["count"] for e in r.events("spare_requested")] == [1]
    r.steps(1)
    assert len(r.c.spare_ids) == 1 and r.c.spare_ids[0] != spare and r.c.generation.number == 1
    assert not r.events("failure")


def test_spares_are_kept_out_of_a_grow():
    from orchestrator.config.load import load_config
    from orchestrator.control.scaling import NoResize, policy_for

    policy = policy_for(load_config(None, ["mesh.dp=2", "mesh.tp=1", "elastic.max_dp=4", "elastic.spares=2"]))
    assert isinstance(policy.grow(2, 4), NoResize)  # 2 in the mesh + 2 spares: nothing to grow with
    assert policy.grow(2, 6).dp == 4
    assert policy.actors_to_adopt(4, lambda: 8) == 2  # up to max_dp's 4 ranks + 2 spares: 6


def test_straggler_not_evicted_when_the_mesh_would_fall_below_min_dp(make):
    r = make("mesh.dp=2", "train.steps=4", "elastic.min_dp=2", "elastic.straggler_steps=1",
             "elastic.evict_stragglers=true")
    r.steps(1)
    slow = r.c.generation.members[0]
    r.group.ranks[slow].forward_s = 3.0
    r.steps(4)
    assert r.events("straggler") and not r.events("evict") and not r.group.killed
    assert r.c.advance() == State.FINISHED


def test_manifest_skipped_steps_must_be_steps_up_to_its_own():
    import pytest

    from checkpoints.errors import ManifestError
    from checkpoints.manifest import CheckpointManifest

    base = dict(step=4, generation=1, mesh={"dp": 1, "pp": 1, "tp": 1}, model_fingerprint="f", data_cursor=32,
                global_batch_size=8, world_size=1, ranks_acked=[0])
    assert CheckpointManifest(**base, skipped_steps=[2, 4]).skipped_steps == [2, 4]
    assert CheckpointManifest.from_dict({**CheckpointManifest(**base).to_dict()}).skipped_steps == []
    for bad in ([5], [0], ["3"]):
        with pytest.raises(ManifestError, match="skipped_steps"):
            CheckpointManifest(**base, skipped_steps=bad)
