"""The controller's rank-health paths on a fake worker group: bad steps (skipped everywhere, recorded,
rolled back after ``train.max_bad_steps`` in a row), stragglers (reported, evicted when asked) and hot
spares (kept beside the mesh, promoted on a failure, replaced by a new one).

Uses the ``make`` fixture and ``Run`` helper of ``tests/unit/test_controller.py``.
"""

from __future__ import annotations

import json

from checkpoints.catalog import list_checkpoints
from orchestrator.bad_steps import BadSteps, bad_reason
from orchestrator.controller import State
from orchestrator.messages import StepResult
from tests.unit.test_controller import make  # noqa: F401  (the fixture)


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
    assert r.c.step() == State.FINISHED
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
    loads = len(r.group.calls("load_checkpoint"))
    assert loads == 4  # every member reloaded step 4 in place (same generation)
    assert r.c.generation.number == 1
    r.steps(4)  # 5 and 6 replayed as recorded skips (not trained), then 7, 8
    trained = sorted({args[0] for _, args in r.group.calls("train_step")})
    assert trained == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [a[0] for _, a in r.group.calls("train_step")].count(5) == 4  # trained once (4 ranks), not again
    recorded = [e["step"] for e in r.events("bad_step") if e["reason"] == "recorded"]
    assert recorded == [5, 6]
    assert r.c.step() == State.FINISHED and sorted(r.c.losses) == [1, 2, 3, 4, 7, 8]


def test_a_resume_skips_the_recorded_steps_again(make, tmp_path):
    first = make("train.steps=4", "checkpoint.every=2")
    first.steps(1)
    first.group.bad_step(3)
    first.steps(4)
    assert first.c.step() == State.FINISHED
    again = make("train.steps=6", "checkpoint.every=2")  # same checkpoint.dir: resumes from step 4
    again.steps(1)
    assert again.c.next_step == 5 and again.c.bad_steps.skipped == {3}
