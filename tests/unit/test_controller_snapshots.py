"""In-memory snapshots through the controller on a fake worker group (no processes): every step each
rank pushes its snapshot itself to the holder the driver named once per generation (the driver makes
no call for them: the bytes never reach it); sets complete from the acknowledgements in the step
results; after a failure the run restores from the newest set every shard of which has a live copy,
else from storage, and the rebuild event says which (orchestrator/saves/snapshots.py; the real
ranks: tests/ray/test_snapshots.py)."""

from __future__ import annotations

import logging

import pytest

from checkpoints.layout import step_dir_name
from meshspeak.rank_calls import RankCalls
from orchestrator.control.context import GROW_HOLD_STEPS
from orchestrator.control.controller import State
from orchestrator.control.scaling import ResizeDecision
from orchestrator.control.states import Forming
from testbed.controller_run import Run
from testbed.fake_call import FakeCall


@pytest.fixture
def make(tmp_path):
    runs = []

    def make(*overrides, actors=None, capacity=0, nodes=None, window=1) -> Run:
        run = Run(tmp_path, ["checkpoint.memory_every=1", *overrides], actors, capacity, window)
        for actor, node in (nodes or {}).items():
            run.group.node_ids[actor] = node
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.close()


def _restored(r: Run) -> dict:
    rebuild, = r.events("rebuild")
    return rebuild


def _pushes(r: Run, step: int) -> dict[int, int]:
    """Owner's world rank -> holder actor, of the pushes of ``step``'s snapshots."""
    return {args[1]: holder for holder, args in r.group.calls(RankCalls.keep_snapshot) if args[0][2] == step}


def test_every_step_is_pushed_by_the_rank_to_a_holder_on_another_node(make):
    r = make(nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    r.steps(3)  # start + steps 1-2
    # The ring visits the nodes in turn: 0 -> 2 -> 1 -> 3 -> 0, so every holder is on the other node.
    assert _pushes(r, 2) == {0: 2, 2: 1, 1: 3, 3: 0}
    # Each rank was told its holder once, when it joined; the steps carry the newest complete set.
    joins = {actor: args[2] for actor, args in r.group.calls(RankCalls.join_generation)}
    assert {actor: o.holder for actor, o in joins.items()} == {0: 2, 2: 1, 1: 3, 3: 0}
    assert {args[1] for _, args in r.group.calls(RankCalls.train_step) if args[0] == 2} == {()}
    assert r.c.snapshots.keep == (1, 0, 1)  # what step 3 will carry
    assert [e["step"] for e in r.events("snapshot")] == [1]  # step 2's acks come with step 3's results
    assert r.group.ranks[2].held[((1, 0, 2), 0)] == {"generation": 1, "step": 2, "rank": 0}


def test_a_lost_rank_is_restored_from_snapshots(make):
    r = make(nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    r.group.fail(RankCalls.train_step, 1, "die", at=5)
    r.steps(5)
    assert r.c.advance() == State.REBUILDING
    assert r.c.advance() == State.RUNNING
    assert not r.group.calls(RankCalls.load_checkpoint)  # storage has step 4, snapshots too: the faster one
    # Rank 1's shard comes from its holder (rank 3 = actor 3), the survivors' from themselves.
    source = r.group.ranks[0].snapshots_loaded[-1]
    assert source.key == (1, 0, 4) and source.world == 4
    assert {rank: actor for rank, actor, _ in source.providers} == {0: 0, 1: 3, 2: 2, 3: 3}
    assert r.c.next_step == 5  # only step 5 is re-run
    # The members were told at their join what they would load (they ask for its metadata then).
    joins = [args[2] for _, args in r.group.calls(RankCalls.join_generation) if args[0].generation == 2]
    assert len(joins) == 2 and all(orders.restore == source for orders in joins)  # dp=2: actor 3 spare
    r.steps(1)
    rebuild = _restored(r)
    assert (rebuild["restored_from"], rebuild["resumed_from_step"]) == ("snapshot", 4)
    summary = r.c.run()
    assert summary.final_step == 6 and summary.losses[5] == pytest.approx(5)


def test_a_save_lost_to_a_failure_is_made_good_from_the_restored_state(make):
    """#36 item 5: the save of step 3 is still writing when a rank dies in step 5; the snapshots restore
    step 4, past it, so replaying never reaches step 3 again. The first step trained after the restore
    (5) is saved instead of waiting for the next periodic save (6): no save lost in silence."""
    r = make("checkpoint.every=3", "train.steps=8", nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    r.group.slow_writes = True
    r.group.fail(RankCalls.train_step, 1, "die", at=5)
    r.steps(5)  # start, steps 1-4; step 3's save still writing
    assert r.c.advance() == State.REBUILDING
    assert r.c.ckpt.owed_step == 3 and r.committed() == []
    r.group.finish_writes()
    r.group.slow_writes = False
    assert r.c.advance() == State.RUNNING and r.c.next_step == 5  # restored step 4 from snapshots
    r.c.run()
    assert [e["step"] for e in r.events("checkpoint")] == [5, 6, 8]  # 5: the save owed for 3
    assert r.c.ckpt.owed_step is None


def test_a_save_a_rank_died_staging_is_owed_after_the_recovery(make):
    """A rank dies inside step 3's save call (staging): never started, so there is no save in flight to
    abandon, yet it is owed as an abandoned one is: the snapshots restore step 3, and the first step
    trained after the recovery (4) is saved instead of waiting for the next periodic save (6)."""
    r = make("checkpoint.every=3", "train.steps=8", nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    r.group.fail(RankCalls.save_checkpoint, 1, "die", at=3)
    summary = r.c.run()
    assert summary.restarts == 1 and r.c.ckpt.owed_step is None
    assert [e["step"] for e in r.events("checkpoint")] == [4, 6, 8]  # 4: the save owed for 3


def test_a_rank_and_its_holder_lost_fall_back_to_storage(make):
    r = make(nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    # Rank 1's snapshot lives on rank 3 and rank 3's on rank 0: losing 1 and 3 loses rank 1's shard.
    r.group.fail(RankCalls.train_step, 1, "die", at=5)
    r.group.fail(RankCalls.train_step, 3, "die", at=5)
    r.steps(5)
    assert r.c.advance() == State.REBUILDING
    assert r.c.advance() == State.RUNNING
    assert not r.group.calls(RankCalls.load_snapshot)
    assert r.group.calls(RankCalls.load_checkpoint)[0][1] == (str(r.ckpt / step_dir_name(2) / "g1"),)  # its attempt dir
    assert {args[2].restore for _, args in r.group.calls(RankCalls.join_generation)} == {None}
    r.steps(1)
    rebuild = _restored(r)
    assert (rebuild["restored_from"], rebuild["resumed_from_step"]) == ("storage", 2)


def test_a_push_cut_by_the_failure_falls_back_to_the_set_before(make):
    r = make(nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    # Actor 3 hangs while taking in rank 1's snapshot of step 4, before it pushed its own, and is
    # killed as hung in step 5: step 4's set has no copy of rank 3's shard; step 3's is complete and
    # kept (rank 3's copy lives on rank 0, the driver's ``keep``).
    r.group.fail(RankCalls.keep_snapshot, 3, "hang", at=4)
    r.steps(5)
    assert r.c.advance() == State.REBUILDING
    assert 3 in r.group.killed
    assert r.c.advance() == State.RUNNING
    assert r.group.ranks[0].snapshots_loaded[-1].key == (1, 0, 3) and r.c.next_step == 4  # 4 and 5 re-run


def test_a_shard_left_with_one_copy_gets_a_second_before_the_rebuild_joins(make):
    """A loss leaves the dead rank's shard on its holder only (and the shard it held on its owner
    only): each gets a second copy before the members join, so the one holder dying as it joins the
    rebuild still leaves the set covered (without the copies: back to storage, steps re-run)."""
    r = make(nodes={0: "A", 1: "A", 2: "B", 3: "B"})  # the ring: rank 0 -> 2 -> 1 -> 3 -> 0
    r.group.fail(RankCalls.train_step, 1, "die", at=5)
    # Rank 2's snapshot was held by rank 1: its only copy is its owner's, which dies joining the rebuild.
    r.group.fail(RankCalls.join_generation, 2, "die", at=2)
    r.steps(5)
    assert r.c.advance() == State.REBUILDING
    assert r.c.advance() == State.REBUILDING  # the join broke
    first = [(args[1], actor) for actor, args in r.group.calls(RankCalls.give_snapshot)]
    assert sorted(first) == [(1, 3), (2, 2)]  # rank 1 from its holder (actor 3), rank 2 from itself
    # each kept by another actor, handed the give's answer (the driver never reads it)
    kept = {args[1]: actor for actor, args in r.group.calls(RankCalls.keep_snapshot) if isinstance(args[2], FakeCall)}
    assert sorted(kept) == [1, 2] and kept[1] != 3 and kept[2] != 2
    while r.c.advance() != State.RUNNING:
        pass
    assert not r.group.calls(RankCalls.load_checkpoint)
    assert r.group.ranks[0].snapshots_loaded[-1].key == (1, 0, 4) and r.c.next_step == 5
    r.steps(1)
    assert _restored(r)["restored_from"] == "snapshot" and "given" in _restored(r)["phases_s"]


def test_rebuild_restores_twice_from_the_same_set_when_forming_fails(make):
    r = make(nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    r.group.fail(RankCalls.train_step, 1, "die", at=5)
    r.group.fail(RankCalls.load_snapshot, 0, "die")  # the next rebuild loses another member while loading
    r.steps(5)
    assert r.c.advance() == State.REBUILDING
    assert r.c.advance() == State.REBUILDING  # actor 0 died loading: rank 0's copy lives on rank 2
    assert r.c.advance() == State.RUNNING
    assert r.c.next_step == 5 and not r.group.calls(RankCalls.load_checkpoint)


def test_one_node_warns_once_and_off_takes_no_snapshot(make, caplog):
    with caplog.at_level(logging.WARNING, logger="orchestrator.saves.snapshots"):
        r = make()
        r.group.fail(RankCalls.train_step, 1, "die", at=3)
        r.steps(3)
        r.steps(1, State.REBUILDING)
        r.steps(2)
    warnings = [m for m in caplog.messages if "one node" in m]
    assert len(warnings) == 1 and "not a lost node" in warnings[0]


def test_memory_every_zero_takes_no_snapshot(make):
    off = make("checkpoint.memory_every=0")
    off.steps(3)
    assert not off.group.calls(RankCalls.keep_snapshot)
    assert {args[2].snapshot_every for _, args in off.group.calls(RankCalls.join_generation)} == {0}


def test_snapshots_need_checkpoint_dir(make):
    r = make("checkpoint.dir=", "checkpoint.every=0")
    r.steps(3)
    assert not r.group.calls(RankCalls.keep_snapshot)


def test_a_step_whose_last_push_still_runs_is_skipped_not_waited_for(make):
    r = make(nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    r.group.fail(RankCalls.keep_snapshot, 2, "slow", at=2)  # rank 0's snapshot of step 2 is slow to arrive
    r.steps(5)  # start + steps 1-4: rank 0 takes none in steps 3 and 4 while step 2's push runs
    assert sorted(k[2] for k, owner in _own_pushes(r, 0)) == [1, 2]
    for call in r.group._calls:  # the push ends
        if call.method is RankCalls.keep_snapshot and call.state == "blocked":
            call.state, call.value = "done", 64
    r.steps(2)  # step 5: step 2's set completes and rank 0 takes step 5's; step 6: step 5's completes
    assert [(e["step"], e["skipped"]) for e in r.events("snapshot")] == [(1, 0), (2, 0), (5, 2)]


def _own_pushes(r: Run, owner: int) -> list[tuple]:
    return [(args[0], args[1]) for _, args in r.group.calls(RankCalls.keep_snapshot) if args[1] == owner]


def test_with_steps_in_flight_a_lost_rank_restores_from_the_newest_complete_set(make):
    """Two steps in flight: a failure in step 5 also breaks step 6, already queued; neither is
    recorded, the run resumes from step 4's snapshots and re-runs 5 and 6."""
    r = make(nodes={0: "A", 1: "A", 2: "B", 3: "B"}, window=2)
    r.group.fail(RankCalls.train_step, 1, "die", at=5)
    r.steps(5)  # start + steps 1-4 read (5 already sent with 4)
    assert r.c.advance() == State.REBUILDING
    assert r.c.advance() == State.RUNNING
    assert r.group.ranks[0].snapshots_loaded[-1].key == (1, 0, 4) and r.c.next_step == 5
    summary = r.c.run()
    assert summary.final_step == 6 and sorted(summary.losses) == [1, 2, 3, 4, 5, 6]
    trained = [x["step"] for x in r.records() if "loss" in x and "event" not in x]
    assert trained == [1, 2, 3, 4, 5, 6]  # nothing the broken generation sent beyond step 4 counted


def test_a_grow_resumes_from_the_snapshot_of_the_last_step_without_saving_it(make):
    """A planned re-form that loses no state (a grow) needs no checkpoint of the step just trained when
    its snapshot set has a live copy of every shard: the new generation loads that set, and no save
    is written (controller ``_forming``, ``SnapshotCoordinator.covers``)."""
    r = make("mesh.dp=2", "elastic.max_dp=4", "checkpoint.every=3", capacity=2, nodes={0: "A", 1: "B"})
    r.steps(4)  # start, steps 1-3 (step 3 committed)
    r.clock.t = 10.0
    assert r.c.advance() == State.RUNNING  # the step-4 boundary's grow check: 2 actors begun, step 4 trains
    assert r.c.advance() == State.FORMING  # the step-5 boundary: grow now
    assert r.c.advance() == State.RUNNING
    assert r.committed() == [3] and not r.group.calls(RankCalls.load_checkpoint)
    assert {args[1] for _, args in r.group.calls(RankCalls.save_checkpoint)} == {3}
    source = r.group.ranks[0].snapshots_loaded[-1]
    assert source.key[2] == 4 and source.world == 2 and r.c.next_step == 5
    r.steps(1)
    grow, = r.events("grow")
    assert (grow["restored_from"], grow["resumed_from_step"], grow["generation"]) == ("snapshot", 4, 2)


def test_an_eviction_whose_straggler_holds_a_shard_alone_saves_first(make):
    """Dropping an actor whose copy of some shard is the only one left would lose that step: then the
    re-form saves the step first, as without snapshots."""
    r = make(nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    r.steps(4)  # start, steps 1-3
    # Rank 1's snapshot lives on actor 3 (the ring 0 -> 2 -> 1 -> 3 -> 0): evicting 1 and 3 together
    # leaves no copy of rank 1's shard, so step 3 is saved before they go.
    r.c.state = Forming(ResizeDecision(dp=2, reason="evict"), save_first=True, drop=frozenset({1, 3}),
                        drop_event="evict", snapshot_may_replace_save=True)
    assert r.c.advance() == State.RUNNING
    assert 3 in r.committed() and r.group.calls(RankCalls.load_checkpoint)


def test_a_grow_without_a_save_still_commits_the_save_in_flight(make):
    """Step 4's periodic save is still being written when the run grows (held by that write for
    GROW_HOLD_STEPS boundaries: the fake's slow write ends only when waited for): the snapshot of the
    last step replaces a new save, but the one in flight commits before the ranks leave their
    generation (leaving would abandon it, and the driver would take storage as failing)."""
    r = make("mesh.dp=2", "elastic.max_dp=4", "checkpoint.every=4", "train.steps=12", capacity=2,
             nodes={0: "A", 1: "B"})
    r.group.slow_writes = True
    r.steps(4)  # start, steps 1-3
    r.clock.t = 10.0
    assert r.c.advance() == State.RUNNING  # the grow check begins 2 actors; step 4 trains, its save starts
    for _ in range(GROW_HOLD_STEPS):
        assert r.c.advance() == State.RUNNING  # held while step 4's save writes
    assert r.committed() == []
    assert r.c.advance() == State.FORMING
    assert r.c.advance() == State.RUNNING
    assert r.committed() == [4] and r.c.generation.shape.dp == 4
    assert [args[1] for _, args in r.group.calls(RankCalls.save_checkpoint)] == [4, 4]  # one save, 2 ranks
    assert r.group.ranks[0].snapshots_loaded[-1].key[2] == 4 + GROW_HOLD_STEPS
    summary = r.c.run()
    assert summary.final_step == 12


@pytest.mark.parametrize("notice_s", [1.0, 20.0], ids=["too-short-for-a-save", "time-for-a-save"])
def test_a_drain_evacuates_from_the_snapshots_and_owes_the_save(make, notice_s):
    """Node B (actors 2 and 3) is drained with 1 s of notice, less than a save needs (the fake's saves
    measure 0.12 s: a save needs 1.18 s), or with 20 s: the snapshots of step 3 have copies of B's
    shards on A (the ring 0 -> 2 -> 1 -> 3 -> 0), so the mesh re-forms from them at the boundary, without
    waiting for a save or for the node to die: no failure, no step re-run, and the save not made
    before is owed and made at the new generation's first boundary."""
    r = make("train.steps=6", nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    r.steps(4)  # start, steps 1-3 (step 2 committed)
    r.group.draining = {"B": notice_s}
    r.clock.t += 1.0
    assert r.c.advance() == State.FORMING  # the boundary before step 4
    assert r.c.advance() == State.RUNNING
    preemption, = r.events("preemption")
    assert (preemption["action"], preemption["from_snapshots"], preemption["ranks"]) == ("evacuate", True, [2, 3])
    deferred, = r.events("checkpoint_deferred")
    assert (deferred["step"], deferred["reason"]) == (3, "drain")
    assert sorted(r.group.killed) == [2, 3] and r.committed() == [2]  # nothing saved before the re-form
    assert (r.c.generation.number, r.c.generation.shape.dp, r.c.next_step) == (2, 2, 4)
    assert r.group.ranks[0].snapshots_loaded[-1].key[2] == 3 and not r.group.calls(RankCalls.load_checkpoint)
    r.c.run()
    assert r.c.state.kind == State.FINISHED and r.c.restarts == 0 and not r.events("failure")
    assert 4 in r.committed()  # the owed save: the first step trained after the re-form
    rebuild = _restored(r)
    assert (rebuild["reason"], rebuild["restored_from"], rebuild["resumed_from_step"]) == ("preemption", "snapshot", 3)
    assert [x["step"] for x in r.records() if "loss" in x] == list(range(1, 7))  # no step trained twice


def test_a_drain_too_short_for_a_save_that_takes_a_shard_and_its_copy_falls_back(make):
    """Node B holds actors 1-3, so some of its shards have their copy on B too (rank 1's on actor 3): no
    snapshot covers the state without B, and the drain falls back to the failure path as without
    snapshots."""
    r = make("train.steps=6", nodes={0: "A", 1: "B", 2: "B", 3: "B"})
    r.steps(4)
    assert _pushes(r, 3)[1] == 3
    r.group.draining = {"B": 1.0}
    r.clock.t += 1.0
    assert r.c.advance() == State.RUNNING  # step 4 trains; the node's loss will take the failure path
    preemption, = r.events("preemption")
    assert preemption["action"] == "fallback" and not preemption["from_snapshots"]
    assert not r.events("checkpoint_deferred") and not r.group.killed


def test_with_steps_in_flight_a_short_drain_still_evacuates_from_the_snapshots(make):
    """With a window of 2 the boundary that reads the notice comes while the step before it is still in
    flight, its snapshots not taken: the decision asks about the newest step read (the same holders),
    and the re-form, once the window drained, resumes from the step it read last."""
    r = make("train.steps=8", nodes={0: "A", 1: "A", 2: "B", 3: "B"}, window=2)
    r.steps(4)
    r.group.draining = {"B": 1.0}
    r.clock.t += 1.0
    r.c.run()
    preemption, = r.events("preemption")
    assert (preemption["action"], preemption["from_snapshots"]) == ("evacuate", True)
    assert r.c.state.kind == State.FINISHED and r.c.restarts == 0 and not r.events("failure")
    assert sorted(r.group.killed) == [2, 3] and r.c.generation.shape.dp == 2
    rebuild = _restored(r)
    assert (rebuild["reason"], rebuild["restored_from"]) == ("preemption", "snapshot")
    # Step 4's periodic save had written everything (the fake's writes are instant): it commits, and
    # nothing is owed (CheckpointCoordinator.set_aside).
    assert rebuild["resumed_from_step"] == 4 and 4 in r.committed() and not r.events("checkpoint_deferred")
    assert [x["step"] for x in r.records() if "loss" in x] == list(range(1, 9))  # no step trained twice


@pytest.mark.parametrize("notice_s", [1.0, 20.0], ids=["too-short-for-a-save", "time-for-a-save"])
def test_a_drain_abandons_the_save_still_writing_and_owes_it(make, notice_s):
    """Step 3's save is still being written when node B's notice comes: the draining actors write it
    too, so it cannot be waited for without waiting for its storage (with a 20 s notice it could be,
    and the chaos bench's drain then waited 4.2 s behind a save to slow storage). It is abandoned
    (never committed) and owed: the first step trained after the re-form is saved instead."""
    r = make("train.steps=6", "checkpoint.every=3", nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    r.group.slow_writes = True
    r.steps(4)  # start, steps 1-3; step 3's save staged, its writes not answered
    r.group.draining = {"B": notice_s}
    r.clock.t += 1.0
    assert r.c.advance() == State.FORMING
    assert r.c.advance() == State.RUNNING
    deferred, = r.events("checkpoint_deferred")
    assert (deferred["step"], deferred["writing"], deferred["reason"]) == (3, 3, "drain")
    assert r.committed() == [] and r.c.ckpt.owed_step == 3
    r.c.run()
    assert 3 not in r.committed() and 4 in r.committed()  # the owed save: step 4, the first after the re-form
    assert not r.events("failure") and r.c.restarts == 0
