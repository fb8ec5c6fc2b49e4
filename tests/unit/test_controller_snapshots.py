"""In-memory snapshots through the controller on a fake worker group (no processes): every step each
rank's snapshot is relayed to its holder; after a failure the run restores from them when every
shard has a live copy, else from storage, and the rebuild event says which
(orchestrator/saves/snapshots.py; the real ranks: tests/ray/test_snapshots.py)."""

from __future__ import annotations

import logging

import pytest

from checkpoints.layout import step_dir_name
from orchestrator.control.controller import State
from testbed.controller_run import Run


@pytest.fixture
def make(tmp_path):
    runs = []

    def make(*overrides, actors=None, capacity=0, nodes=None) -> Run:
        run = Run(tmp_path, ["checkpoint.memory_every=1", *overrides], actors, capacity)
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


def test_every_step_is_relayed_to_a_holder_on_another_node(make):
    r = make(nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    r.steps(3)  # start + steps 1-2
    keeps = r.group.calls("keep_snapshot")
    # The ring visits the nodes in turn: 0 -> 2 -> 1 -> 3 -> 0, so every holder is on the other node.
    step2 = {args[2]: actor for actor, args in keeps if args[1] == 2}
    assert step2 == {0: 2, 2: 1, 1: 3, 3: 0}
    # The holder gets the owner's snapshot_blob answer (a ref, resolved on its side) and is told to
    # keep the newest complete set (step 1) besides this one.
    assert all(args[4] == ((1, 1),) for actor, args in keeps if args[1] == 2)
    assert [e["step"] for e in r.events("snapshot")] == [1]  # step 2's completes after step 3
    assert r.group.ranks[2].held[(1, 2, 0)] == {"generation": 1, "step": 2, "rank": 0}


def test_a_lost_rank_is_restored_from_snapshots(make):
    r = make(nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    r.group.fail("train_step", 1, "die", at=5)
    r.steps(5)
    assert r.c.step() == State.REBUILDING
    assert r.c.step() == State.RUNNING
    assert not r.group.calls("load_checkpoint")  # storage has step 4, snapshots too: the faster one
    # Rank 1's shard comes from its holder (rank 3 = actor 3), the survivors' from themselves.
    gives = {args[2]: actor for actor, args in r.group.calls("give_snapshot")}
    assert gives == {0: 0, 1: 3, 2: 2, 3: 3}
    loaded = r.group.ranks[0].snapshots_loaded[-1]
    assert [s["rank"] for s in loaded] == [0, 1, 2, 3] and {s["step"] for s in loaded} == {4}
    assert r.c.next_step == 5  # only step 5 is re-run
    r.steps(1)
    rebuild = _restored(r)
    assert (rebuild["restored_from"], rebuild["resumed_from_step"]) == ("snapshot", 4)
    summary = r.c.run()
    assert summary.final_step == 6 and summary.losses[5] == pytest.approx(5)


def test_a_rank_and_its_holder_lost_fall_back_to_storage(make):
    r = make(nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    # Rank 1's snapshot lives on rank 3 and rank 3's on rank 0: losing 1 and 3 loses rank 1's shard.
    r.group.fail("train_step", 1, "die", at=5)
    r.group.fail("train_step", 3, "die", at=5)
    r.steps(5)
    assert r.c.step() == State.REBUILDING
    assert r.c.step() == State.RUNNING
    assert not r.group.calls("load_snapshot") and not r.group.calls("give_snapshot")
    assert r.group.calls("load_checkpoint")[0][1] == (str(r.ckpt / step_dir_name(2)),)
    r.steps(1)
    rebuild = _restored(r)
    assert (rebuild["restored_from"], rebuild["resumed_from_step"]) == ("storage", 2)


def test_a_relay_cut_by_the_failure_falls_back_to_the_set_before(make):
    r = make(nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    # Actor 3 hangs while taking in rank 1's snapshot of step 4, and is killed as hung in step 5:
    # step 4's set never completed; step 3's is complete and covered (rank 3's copy lives on rank 0).
    r.group.fail("keep_snapshot", 3, "hang", at=4)
    r.steps(5)
    assert r.c.step() == State.REBUILDING
    assert 3 in r.group.killed
    assert r.c.step() == State.RUNNING
    loaded = r.group.ranks[0].snapshots_loaded[-1]
    assert {s["step"] for s in loaded} == {3} and r.c.next_step == 4  # steps 4 and 5 re-run


def test_rebuild_restores_twice_from_the_same_set_when_forming_fails(make):
    r = make(nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    r.group.fail("train_step", 1, "die", at=5)
    r.group.fail("load_snapshot", 0, "die")  # the next rebuild loses another member while loading
    r.steps(5)
    assert r.c.step() == State.REBUILDING
    assert r.c.step() == State.REBUILDING  # actor 0 died loading: rank 0's copy lives on rank 2
    assert r.c.step() == State.RUNNING
    assert r.c.next_step == 5 and not r.group.calls("load_checkpoint")


def test_one_node_warns_once_and_off_takes_no_snapshot(make, caplog):
    with caplog.at_level(logging.WARNING, logger="orchestrator.saves.snapshots"):
        r = make()
        r.group.fail("train_step", 1, "die", at=3)
        r.steps(3)
        r.steps(1, State.REBUILDING)
        r.steps(2)
    warnings = [m for m in caplog.messages if "one node" in m]
    assert len(warnings) == 1 and "not a lost node" in warnings[0]


def test_memory_every_zero_takes_no_snapshot(make):
    off = make("checkpoint.memory_every=0")
    off.steps(3)
    assert not off.group.calls("snapshot") and not off.group.calls("keep_snapshot")


def test_snapshots_need_checkpoint_dir(make):
    r = make("checkpoint.dir=", "checkpoint.every=0")
    r.steps(3)
    assert not r.group.calls("snapshot")


def test_a_step_whose_previous_relay_still_runs_is_skipped_not_waited_for(make):
    r = make(nodes={0: "A", 1: "A", 2: "B", 3: "B"})
    r.group.fail("keep_snapshot", 2, "slow", at=2)  # rank 0's snapshot of step 2 is slow to arrive
    r.steps(5)  # start + steps 1-4: steps 3 and 4 come while step 2's relay runs
    assert sorted({args[1] for _, args in r.group.calls("snapshot")}) == [1, 2]
    for call in r.c.snapshots._pending.refs:  # the relay ends
        call.state, call.value = "done", 64
    r.steps(1)  # step 5: step 2's set completes (2 steps skipped meanwhile), step 5's starts
    assert [(e["step"], e["skipped"]) for e in r.events("snapshot")] == [(1, 0), (2, 2)]
    assert sorted({args[1] for _, args in r.group.calls("snapshot")}) == [1, 2, 5]
