"""A mesh that lost a replica grows back once the replacement answers (#37 item 3), on the fake group.

bench/torchft_compare.py (dp=4, 4 microbatches, a SIGKILL at step 10 of 20) stayed at dp=2 after the
kill: dp=3 does not divide the 4 microbatches, so the mesh re-formed at dp=2 with the third live actor
left out, and the replacement was asked for only at the next grow check after the rebuild
(``elastic.grow_check_s`` later); the actor's start (a process importing torch) then took longer
than the 10 steps left. The replacement is now asked for once the re-formed mesh's first step was
read (at once when the formation itself broke), and the mesh grows back at the first step boundary
after it answered.
"""

from __future__ import annotations

from meshspeak.rank_calls import RankCalls
from orchestrator.control.controller import State
from testbed.controller_run import make  # noqa: F401  (the fixture)

FOUR_MICROBATCHES = ("train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=12",
                     "checkpoint.every=0", "checkpoint.memory_every=1")


def dp_by_step(r) -> dict[int, int]:
    """The dp each step was recorded at (the last record of a re-run step wins)."""
    return {rec["step"]: rec["dp"] for rec in r.records() if "loss" in rec and "event" not in rec}


def test_dp4_shrinks_to_dp2_and_grows_back_when_the_replacement_answers(make):
    r = make(*FOUR_MICROBATCHES, capacity=1)  # room for one actor more: the replacement's
    r.group.start_polls = 3  # it answers at the 4th step boundary after it was asked for
    r.group.fail(RankCalls.train_step, 1, "die", at=3)
    r.steps(3)  # start, steps 1-2 at dp=4
    assert r.c.advance() == State.REBUILDING  # step 3: rank 1 died
    assert r.c.advance() == State.RUNNING  # re-formed without it
    assert r.c.generation.shape.dp == 2 and r.group.live_ids == [0, 2, 3]  # dp=3 would not divide 4
    # Asked for once the new generation's first step was read, not while that step runs (the clock
    # stands still, so it is no grow check: elastic.grow_check_s 5 s).
    assert r.group.starting == 0
    r.steps(1)  # step 3 at dp=2
    assert r.group.starting == 1
    r.steps(3)  # steps 4-6 at dp=2 while the replacement starts
    assert r.c.generation.shape.dp == 2
    assert r.c.advance() == State.FORMING  # the boundary where it answered: grow now
    assert r.c.advance() == State.RUNNING
    assert r.c.generation.shape.dp == 4 and r.group.live_ids == [0, 2, 3, 4]
    while r.c.advance() != State.FINISHED:
        pass
    grow, = r.events("grow")
    assert (grow["dp"], grow["reason"], grow["restored_from"], grow["resumed_from_step"]) == (4, "grow", "snapshot", 6)
    assert r.events("actors_ready")[0]["actors"] == [4]
    dps = dp_by_step(r)
    assert [dps[s] for s in range(1, 13)] == [4, 4] + [2] * 4 + [4] * 6
    assert len(r.events("failure")) == 1


def test_no_replacement_is_started_beyond_elastic_max_dp(make):
    """A rebuild at the full mesh (a latched error, nobody lost) asks for no actor."""
    r = make(*FOUR_MICROBATCHES, capacity=4)
    r.group.fail(RankCalls.train_step, 2, "raise", at=3)
    r.steps(3)
    assert r.c.advance() == State.REBUILDING
    assert r.c.advance() == State.RUNNING
    assert r.c.generation.shape.dp == 4 and r.group.starting == 0 and r.group.live_ids == [0, 1, 2, 3]


def test_a_replacement_is_asked_for_at_once_when_the_rebuild_broke(make):
    """A rebuild whose formation broke (a member died joining) has no first step near: the replacement
    for what the failure took is asked for then, not after a step that may be long in coming."""
    r = make(*FOUR_MICROBATCHES, capacity=2)
    r.group.fail(RankCalls.train_step, 1, "die", at=3)
    r.group.fail(RankCalls.join_generation, 2, "die", at=2)
    r.steps(3)
    assert r.c.advance() == State.REBUILDING  # step 3: rank 1 died
    assert r.c.advance() == State.REBUILDING  # generation 2's join broke (rank 2 died): again
    assert r.group.starting >= 1
    while r.c.advance() != State.FINISHED:
        pass
    assert sorted(dp_by_step(r)) == list(range(1, 13))
