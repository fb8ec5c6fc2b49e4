"""The controller at a step boundary when a node is announced as draining (orchestrator/recovery/preemption.py)
or a stop is requested (`ray job stop`, Ctrl-C; orchestrator/launch.py StopRequest), on a fake worker
group (testbed/controller_run.py).

Preemption notices, at a step boundary:

* RUNNING -> FORMING -> RUNNING (time for a save: the step is committed, the node's actors dropped,
  the mesh re-formed without them; no failure, no restart counted, no step re-run):
  ``test_drain_with_time_for_a_save_evacuates_at_the_step_boundary``
* RUNNING -> RUNNING (too short for a save: an event says so, training goes on) then
  RUNNING -> REBUILDING when the node dies, not counted against the budget:
  ``test_drain_too_short_for_a_save_falls_back_to_the_failure_path``
* RUNNING -> RUNNING (a drain of spares only: dropped, the mesh stays):
  ``test_drain_of_spares_only_keeps_the_mesh``

A stop signal (`ray job stop`, Ctrl-C; orchestrator/launch.py StopRequest):

* RUNNING -> FINISHED at the next step boundary, the step committed first, resume_step after it:
  ``test_stop_request_saves_the_step_and_finishes``
"""

from __future__ import annotations

from meshspeak.rank_calls import RankCalls
from orchestrator.control.controller import State
from testbed.controller_run import make  # noqa: F401  (the fixture)


def on_node_b(r, *actors):
    for actor in actors:
        r.group.node_ids[actor] = "node-b"


def test_drain_with_time_for_a_save_evacuates_at_the_step_boundary(make):
    r = make("train.steps=8")
    r.steps(4)  # generation 1 and steps 1-3 (checkpoint of step 2 committed)
    on_node_b(r, 3)
    pids = {a: r.group.pids[a] for a in (0, 1, 2)}
    r.group.draining = {"node-b": 20.0, "node-x": 5.0}  # node-x holds nothing of ours
    r.clock.t += 1.0
    assert r.c.advance() == State.FORMING  # the boundary before step 4 decides to evacuate
    assert r.c.advance() == State.RUNNING  # save 3, re-form without rank 3
    preemption, = r.events("preemption")
    assert {k: preemption[k] for k in ("nodes", "ranks", "deadline_s", "step", "action")} == \
        {"nodes": ["node-b"], "ranks": [3], "deadline_s": 20.0, "step": 4, "action": "evacuate"}
    assert 3 in r.group.killed and r.committed()[-1] == 3
    assert (r.c.generation.number, r.c.generation.shape.dp, r.c.next_step) == (2, 2, 4)
    r.c.run()
    assert r.c.state.kind == State.FINISHED and r.c.restarts == 0 and not r.events("failure")
    rebuild, = r.events("rebuild")
    assert (rebuild["reason"], rebuild["resumed_from_step"]) == ("preemption", 3)
    trained = [x["step"] for x in r.records() if "loss" in x]
    assert trained == list(range(1, 9))  # no step trained twice
    assert {a: r.group.pids[a] for a in (0, 1, 2)} == pids  # survivors kept their processes


def test_drain_too_short_for_a_save_falls_back_to_the_failure_path(make):
    r = make("train.steps=8", "elastic.max_restarts=0")
    r.steps(4)
    on_node_b(r, 3)
    r.group.draining = {"node-b": 1.0}  # the fake's saves measure 0.12 s: a save needs 1.18 s
    r.group.fail(RankCalls.train_step, 3, "die", at=5)  # the node goes during step 5
    r.clock.t += 1.0
    assert r.c.advance() == State.RUNNING  # step 4 trained as usual
    preemption, = r.events("preemption")
    assert preemption["action"] == "fallback" and "shorter than" in preemption["reason"]
    assert r.c.advance() == State.REBUILDING  # step 5: the node's loss takes the failure path
    failure, = r.events("failure")
    assert failure["ranks"] == [3]
    r.c.run()  # max_restarts=0, yet not ERRORED: a preempted node's loss is not a fault
    assert r.c.state.kind == State.FINISHED and r.c.restarts == 0


def test_drain_of_spares_only_keeps_the_mesh(make):
    r = make(actors=5)
    r.steps(2)
    spare = 4
    assert spare not in r.c.generation.members.values()
    on_node_b(r, spare)
    r.group.draining = {"node-b": 0.5}
    r.clock.t += 1.0
    assert r.c.advance() == State.RUNNING
    preemption, = r.events("preemption")
    assert preemption["ranks"] == [] and preemption["action"] == "evacuate"
    assert r.group.killed == [spare] and r.c.generation.number == 1 and r.c.next_step == 3


def test_stop_request_saves_the_step_and_finishes(make):
    r = make("train.steps=8")
    r.steps(4)  # steps 1-3 trained; the save of step 2 committed
    stop = []
    r.c.stop_requested = lambda: bool(stop)
    stop.append(15)
    assert r.c.advance() == State.FINISHED  # at the boundary before step 4
    assert r.committed()[-1] == 3 and r.c.summary().resume_step == 4 and r.c.summary().final_step == 3
    stopped, = r.events("stopped")
    assert (stopped["step"], stopped["resume_step"]) == (3, 4)
    assert [x["step"] for x in r.records() if "loss" in x] == [1, 2, 3] and not r.events("done")


def test_a_drain_held_across_a_failure_still_evacuates_the_node(make):
    """#36 item 7: with steps in flight the evacuation is held until they are read; a rank that dies in
    one of them ends those steps with a failure. The held decision outlives it: once the mesh re-formed
    from the survivors, the draining node's actor is still dropped at the next boundary (the node was
    marked decided, so nothing else would ever evacuate it)."""
    # No save (no boundary empties the window); a global batch of 24 lets the 3 survivors form dp=3.
    r = make("train.steps=10", "checkpoint.every=0", "train.global_batch_size=24", window=3)
    r.group.fail(RankCalls.train_step, 1, "die", at=4)
    r.steps(3)  # generation 1, steps 1-2 read (3 and 4 in flight)
    on_node_b(r, 3)
    r.group.draining = {"node-b": 60.0}
    r.clock.t += 1.0
    assert r.c.advance() == State.DRAINING  # step 3 read; the boundary before 5 decides the drain: held (4 in flight)
    assert r.c.state.decision.notice.actors == {3}
    assert r.c.advance() == State.REBUILDING  # step 4: actor 1 died
    assert r.c.advance() == State.DRAINING  # generation 2 from actors 0, 2, 3 (node-b's 3 still in it)
    assert r.c.state.stale  # the held evacuation is taken again at the next boundary
    assert 3 in r.c.generation.members.values()
    assert r.c.advance() == State.FORMING  # the held evacuation, refreshed: drop actor 3
    assert r.c.advance() == State.RUNNING
    assert 3 not in r.c.generation.members.values() and 3 in r.group.killed
    r.c.run()
    assert r.c.state.kind == State.FINISHED
    assert [e["reason"] for e in r.events("rebuild")][-1] == "preemption"
    assert len(r.events("preemption")) == 1
