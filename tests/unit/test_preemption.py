"""Drain notices turned into decisions (orchestrator.recovery.preemption): pure, no Ray."""

from __future__ import annotations

import pytest

from orchestrator.recovery.preemption import SAVE_GUESS_S, PreemptionWatcher, save_budget_s

# Actors 0-3 are the members (ranks 0-3); 4 is a spare. Node "b" holds rank 3 and the spare.
ACTOR_NODES = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b"}
MEMBERS = {0: 0, 1: 1, 2: 2, 3: 3}


def check(watcher, draining, *, step=7, measured=2.0, actor_nodes=ACTOR_NODES, covered=None):
    return watcher.check(draining, actor_nodes=actor_nodes, members=MEMBERS, step=step,
                         save_measured_s=measured, covered=covered)


def test_drain_with_time_for_a_save_evacuates_the_nodes_ranks():
    w = PreemptionWatcher()
    p = check(w, {"b": 20.0, "elsewhere": 5.0})  # a drained node without our actors is no business
    assert p.action == "evacuate" and p.nodes == ("b",) and p.actors == {3, 4} and p.ranks == (3,)
    assert p.deadline_s == 20.0 and p.step == 7 and p.needed_s == pytest.approx(save_budget_s(2.0))
    assert "saving step 6" in p.reason
    event = p.event()
    assert {k: event[k] for k in ("nodes", "ranks", "deadline_s", "step")} == \
        {"nodes": ["b"], "ranks": [3], "deadline_s": 20.0, "step": 7}


def test_deadline_too_short_for_a_save_falls_back():
    w = PreemptionWatcher()
    p = check(w, {"b": 1.0})
    assert p.action == "fallback" and p.ranks == (3,) and p.deadline_s == 1.0
    assert "shorter than" in p.reason and "the last save took 2.0s" in p.reason


def test_deadline_too_short_for_a_save_evacuates_from_snapshots_that_cover_the_state_without_the_node():
    asked = []

    def covered(actors):
        asked.append(actors)
        return True

    p = check(PreemptionWatcher(), {"b": 1.0}, covered=covered)
    assert asked == [{3, 4}]  # the draining node's actors: the snapshots must do without them
    assert p.action == "evacuate" and p.from_snapshots and p.ranks == (3,) and p.actors == {3, 4}
    assert "in-memory snapshots hold every shard" in p.reason and p.event()["from_snapshots"] is True


def test_the_snapshots_must_also_do_without_a_node_that_fell_back_before():
    actor_nodes = {0: "a", 1: "a", 2: "c", 3: "b", 4: "b"}
    w = PreemptionWatcher()
    assert check(w, {"c": 1.0}, actor_nodes=actor_nodes, covered=lambda actors: False).action == "fallback"
    asked = []
    check(w, {"c": 0.5, "b": 1.0}, actor_nodes=actor_nodes, covered=lambda actors: asked.append(actors) or True)
    assert asked == [{2, 3, 4}]  # node c's actor 2 is still alive, and goes too


def test_deadline_too_short_for_a_save_without_covering_snapshots_still_falls_back():
    p = check(PreemptionWatcher(), {"b": 1.0}, covered=lambda actors: False)
    assert p.action == "fallback" and not p.from_snapshots and "shorter than" in p.reason


def test_a_drain_with_time_for_a_save_evacuates_from_covering_snapshots_without_waiting_for_one():
    """Time for a save, but the snapshots hold every shard outside the draining node: the mesh
    re-forms from them at once and the save is owed, as with a short deadline (a save first cost the
    chaos bench's drains 0.3-0.6 s, 4.2 s behind a save to slow storage still writing)."""
    asked = []
    p = check(PreemptionWatcher(), {"b": 20.0}, covered=lambda actors: asked.append(actors) or True)
    assert asked == [{3, 4}]
    assert p.action == "evacuate" and p.from_snapshots and p.event()["from_snapshots"] is True
    assert "re-forming from them now, the save of step 6 owed" in p.reason and "deadline in 20.0s" in p.reason


def test_a_drain_with_time_for_a_save_saves_first_when_the_snapshots_do_not_cover():
    p = check(PreemptionWatcher(), {"b": 20.0}, covered=lambda actors: False)
    assert p.action == "evacuate" and not p.from_snapshots and "saving step 6" in p.reason


def test_the_measured_save_time_decides():
    assert check(PreemptionWatcher(), {"b": 10.0}, measured=8.0).action == "fallback"  # needs 13 s
    assert check(PreemptionWatcher(), {"b": 10.0}, measured=1.0).action == "evacuate"  # needs 2.5 s
    # Before any save was measured, a guess stands in.
    guess = check(PreemptionWatcher(), {"b": save_budget_s(None) - 0.5}, measured=None)
    assert guess.action == "fallback" and "a guess" in guess.reason
    assert save_budget_s(None) == save_budget_s(SAVE_GUESS_S)


def test_no_deadline_evacuates():
    p = check(PreemptionWatcher(), {"b": None})
    assert p.action == "evacuate" and p.deadline_s is None and p.event()["deadline_s"] is None


def test_each_node_is_decided_once_and_nodes_draining_together_are_one_decision():
    w = PreemptionWatcher()
    p = check(w, {"a": 30.0, "b": 25.0})
    assert p.nodes == ("a", "b") and p.ranks == (0, 1, 2, 3) and p.deadline_s == 25.0
    assert check(w, {"a": 29.0, "b": 24.0}) is None  # already decided
    assert check(w, {}) is None


def test_a_drain_of_spares_only_drops_them_without_a_save():
    actor_nodes = {0: "a", 1: "a", 2: "a", 3: "a", 4: "b"}
    p = check(PreemptionWatcher(), {"b": 0.5}, actor_nodes=actor_nodes)
    assert p.action == "evacuate" and p.actors == {4} and p.ranks == () and p.needed_s == 0.0


def test_polls_every_poll_s_and_never_when_zero():
    w = PreemptionWatcher(poll_s=1.0)
    assert w.due(100.0) and not w.due(100.5) and w.due(101.0) and not w.due(101.9)
    off = PreemptionWatcher(poll_s=0)
    assert not off.due(0.0) and not off.due(1e9)
