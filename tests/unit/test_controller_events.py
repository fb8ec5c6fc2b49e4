"""The controller's rebuild / grow events: none is lost when the next recovery begins before the
rebuilt generation trained its first step. Uses ``make`` and ``Run`` of ``tests/unit/test_controller.py``."""

from __future__ import annotations

from meshspeak.rank_calls import RankCalls
from orchestrator.control.controller import State
from testbed.controller_run import make  # noqa: F401  (the fixture)


def test_a_rebuild_superseded_by_a_grow_before_its_first_step_is_still_told(make):
    r = make("mesh.dp=2", "elastic.max_dp=4", "train.steps=8")
    r.group.fail(RankCalls.train_step, 1, "die", at=3)
    r.steps(3)  # start + steps 1-2
    r.clock.t = 100.0
    assert r.c.advance() == State.REBUILDING  # rank 1 dies in step 3
    r.clock.t = 103.0
    assert r.c.advance() == State.RUNNING  # generation 2 at dp=1; its event waits for its first step
    assert r.c.generation.shape.dp == 1 and not r.events("rebuild")
    r.group.capacity = 1  # a node came back, and an actor started in the background answers now
    r.group.start_background(1)
    r.clock.t = 110.0
    assert r.c.advance() == State.FORMING  # the next boundary grows, before generation 2 trained
    assert r.c.advance() == State.RUNNING
    assert r.c.generation.number == 3 and r.c.generation.shape.dp == 2
    rebuild, = r.events("rebuild")  # told when the grow began, with the recovery up to then
    assert (rebuild["generation"], rebuild["dp"], rebuild["recovery_s"]) == (2, 1, 10.0)
    r.clock.t = 111.0
    r.steps(1)
    grow, = r.events("grow")
    assert (grow["generation"], grow["dp"], grow["recovery_s"]) == (3, 2, 1.0)
    assert r.c.run().final_step == 8
