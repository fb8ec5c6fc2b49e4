"""Steps in flight (orchestrator/control/window.py) on the fake worker group: the driver sends step k+1
before it reads step k, what must happen between two steps (a checkpoint save, an eval, a resize)
drains the window first, action lists go once per generation, and a step that breaks takes the
steps queued behind it to the failure path unrecorded (the exactly-once rule: each step's record and
loss comes from one generation's complete run of it)."""

from __future__ import annotations

from meshspeak.rank_calls import RankCalls
from orchestrator.control.controller import State
from orchestrator.control.evaluation import Evaluator
from testbed.controller_run import make  # noqa: F401  (the fixture)


def _order(r, actor: int) -> list[tuple[str, int]]:
    """(call, step) of actor ``actor``'s training calls, in the order they were sent."""
    out = []
    for method, who, args in r.group.log:
        if who != actor:
            continue
        if method is RankCalls.train_step:
            out.append(("train", args[0]))
        elif method is RankCalls.save_checkpoint:
            out.append(("save", args[1]))
        elif method is RankCalls.eval_step:
            out.append(("eval", args[1]))
    return out


def test_the_next_step_is_sent_before_the_last_is_read(make):
    r = make("checkpoint.every=0", window=2)
    r.steps(1)  # FORMING -> RUNNING
    r.steps(1)  # sends steps 1 and 2, reads step 1
    assert [args[0] for _, args in r.group.calls(RankCalls.train_step)][::4] == [1, 2]
    assert [rec["step"] for rec in r.records() if "loss" in rec and "event" not in rec] == [1]
    r.steps(1)  # sends step 3, reads step 2
    assert [args[0] for _, args in r.group.calls(RankCalls.train_step)][::4] == [1, 2, 3]


def test_action_lists_go_once_per_generation_and_steps_carry_their_number(make):
    r = make(window=2)
    r.steps(7)
    assert r.c.advance() == State.FINISHED
    joins = r.group.calls(RankCalls.join_generation)
    assert len(joins) == 4 and all(args[2].actions for _, args in joins)  # GenerationOrders
    steps = r.group.calls(RankCalls.train_step)
    assert len(steps) == 4 * 6
    # (step, keep, after): nothing per-step but the step's number and the snapshot key to keep
    assert {len(args) for _, args in steps} == {3}
    assert [args[2] for actor, args in steps if actor == 0] == [0, 1, 2, 3, 4, 5]


def test_a_checkpoint_save_goes_between_its_step_read_good_and_the_next(make):
    r = make(window=2)  # checkpoint.every=2
    r.steps(3)  # forms, reads step 1, reads step 2 and starts its save (step 3 is sent after it)
    assert _order(r, 0) == [("train", 1), ("train", 2), ("save", 2)]
    assert r.c.run().final_step == 6
    assert _order(r, 0) == [("train", 1), ("train", 2), ("save", 2), ("train", 3), ("train", 4), ("save", 4),
                            ("train", 5), ("train", 6), ("save", 6)]
    assert r.committed() == [2, 4, 6]


def test_an_eval_drains_the_window_and_runs_between_its_step_and_the_next(make):
    r = make("eval.every=3", "checkpoint.every=0", window=3)
    r.c.context.evaluator = Evaluator(r.cfg.eval, last_step=r.cfg.train.steps,
                                      step_timeout_s=r.cfg.elastic.step_timeout_s, eval_path="builtin",
                                      mask_eos_id=None)
    assert r.c.run().final_step == 6
    assert _order(r, 0) == [("train", 1), ("train", 2), ("train", 3)] + [("eval", b) for b in range(4)] + [
        ("train", 4), ("train", 5), ("train", 6)] + [("eval", b) for b in range(4)] + [("save", 6)]  # the last step
    assert [e["step"] for e in r.events("eval")] == [3, 6]


def test_a_requested_resize_drains_the_window_first(make):
    r = make(window=3, actors=4)
    r.c.resize_requests = {4: 2}
    assert r.c.run().final_step == 6
    sent_by_gen1 = [args[0] for actor, args in r.group.calls(RankCalls.train_step) if actor == 3]
    assert sent_by_gen1 == [1, 2, 3]  # actor 3 left at the resize: step 4 was never sent to it
    assert r.c.generation.shape.dp == 2


def test_a_broken_step_takes_the_steps_behind_it_unrecorded(make):
    """A rank dies in step 5 while step 6 is queued behind it: generation 1 records neither (nor is the
    save of step 4, still being written, committed); generation 2 resumes from the checkpoint of step
    2 and records steps 3..6."""
    r = make(window=2)
    r.group.fail(RankCalls.train_step, 1, "die", at=5)
    assert r.c.run().final_step == 6
    sent = [args[0] for actor, args in r.group.calls(RankCalls.train_step) if actor == 0]
    assert sent == [1, 2, 3, 4, 5, 6, 3, 4, 5, 6]  # step 6 was in flight when step 5 broke
    records = [(rec["step"], rec["generation"]) for rec in r.records() if "loss" in rec and "event" not in rec]
    assert records == [(1, 1), (2, 1), (3, 1), (4, 1), (3, 2), (4, 2), (5, 2), (6, 2)]
    (rebuild,) = r.events("rebuild")
    assert rebuild["resumed_from_step"] == 2 and r.c.generation.number == 2
    assert r.c.losses == {s: float(s) for s in range(1, 7)}


def test_a_rollback_with_steps_in_flight_restores_from_before_the_bad_steps(make):
    """Two bad steps in a row (5, 6) with step 7 queued behind step 6: the ranks train 7 and snapshot it
    before the driver reads 6 and rolls back. The rollback restores the newest set up to step 6 (step 4:
    bad steps take no snapshot), never step 7's, which the driver did not record; 5 and 6 replay as
    recorded skips."""
    r = make("checkpoint.memory_every=1", "checkpoint.every=0", "train.max_bad_steps=2", "train.steps=8", window=2)
    r.group.bad_step(5)
    r.group.bad_step(6)
    r.steps(1)
    while r.c.next_step <= 6:
        r.steps(1)
    for rank in r.group.ranks.values():
        rank.bad_at.clear()  # the replay skips them as recorded, it does not run them
    assert r.c.run().final_step == 8
    sent = [args[0] for actor, args in r.group.calls(RankCalls.train_step) if actor == 0]
    assert sent == [1, 2, 3, 4, 5, 6, 7, 7, 8]  # step 7 was in flight when step 6 was read
    (rollback,) = r.events("rollback")
    assert (rollback["step"], rollback["resumed_from_step"], rollback["restored_from"]) == (6, 4, "snapshot")
    assert [(e["step"], e["reason"]) for e in r.events("bad_step")] == [
        (5, "grad_norm"), (6, "grad_norm"), (5, "recorded"), (6, "recorded")]


def test_a_step_that_reached_a_rank_early_is_sent_again_not_failed(make):
    # Ray may deliver a threaded actor's step k+1 before step k (tests/ray/test_rank_health.py saw
    # "step 2 arrived after step 0" once in a full suite): the rank answers early, untrained, and the
    # window sends that step again to it once the step before was read; no failure, no restart.
    r = make("train.steps=6", window=2)
    r.group.fail(RankCalls.train_step, 1, "early", at=3)
    while r.c.advance() != State.FINISHED:
        pass
    assert not r.events("failure") and r.c.restarts == 0 and sorted(r.c.losses) == list(range(1, 7))
    sent = [args[0] for actor, args in r.group.calls(RankCalls.train_step) if actor == 1]
    assert sent.count(3) == 2 and sent.count(2) == 1
    assert r.group.ranks[1].step == 6


def test_a_rank_that_keeps_answering_early_fails_the_step(make):
    r = make("train.steps=6", window=2)
    calls = []  # step 3 reaches actor 1 early every time: the first send and each resend
    original = r.group._take_fault

    def always_early(call, rank):
        if call.method is RankCalls.train_step and call.actor == 1 and call.args[0] == 3:
            calls.append(call)
            return "early", ""
        return original(call, rank)

    r.group._take_fault = always_early
    while (state := r.c.advance()) not in (State.REBUILDING, State.FINISHED):
        pass
    assert state == State.REBUILDING and len(calls) == 4  # sent, then sent again RESENDS = 3 times
    failure, = r.events("failure")
    assert failure["step"] == 3 and failure["reason"].startswith("step 3 arrived before")
