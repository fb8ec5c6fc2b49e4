"""A run never deletes or resumes another run's checkpoints: the coordinator's side of ownership, driven
through the real controller on a fake worker group (no processes), with a real checkpoint catalog.

Cases: a new run (resume=false) beside another run's newer steps is refused (exit 2) and nothing of
either is deleted; a resuming run continues the run it resumes (same run id, purges only its own);
after a failure a run resumes its own newest checkpoint, never a newer one another run wrote.
"""

from __future__ import annotations

import os

import pytest

from checkpoints.catalog import latest_valid, list_checkpoints
from checkpoints.layout import MANIFEST
from meshspeak.rank_calls import RankCalls
from orchestrator.control.controller import State
from orchestrator.errors import UserInputError
from testbed.controller_run import Run


def _committed(root) -> dict[int, str]:
    """step -> owning run of every committed checkpoint under root."""
    return {i.step: i.owner for i in list_checkpoints(str(root)) if i.committed}


def _train(run: Run) -> None:
    summary = run.c.run()
    assert summary.final_step == run.cfg.train.steps


def test_new_run_beside_another_runs_checkpoints_is_refused(tmp_path):
    first = Run(tmp_path, ["train.steps=6", "checkpoint.keep=10"], None, 0)
    _train(first)
    before = _committed(first.ckpt)
    assert sorted(before) == [2, 4, 6] and set(before.values()) == {first.c.ckpt.run_id}
    with pytest.raises(UserInputError) as info:
        Run(tmp_path, ["train.steps=2", "checkpoint.resume=false"], None, 0)
    msg = str(info.value)
    assert "checkpoint.resume=false" in msg and first.c.ckpt.run_id in msg and "empty directory" in msg
    assert "\n" not in msg
    assert _committed(first.ckpt) == before  # nothing deleted


def test_resuming_run_continues_that_run_and_purges_only_its_own(tmp_path):
    first = Run(tmp_path, ["train.steps=4", "checkpoint.keep=10"], None, 0)
    _train(first)
    # A foreign run's committed checkpoint at a lower step, as another tool or an old run left it.
    foreign = tmp_path / "ckpt" / "step-00000001"
    os.makedirs(foreign)
    with open(foreign / "__0_0.distcp", "wb") as f:
        f.write(b"x" * 16)
    with open(foreign / ".metadata", "wb") as f:
        f.write(b"x" * 8)
    manifest = latest_valid(str(first.ckpt)).manifest.to_dict()
    manifest.update(step=1, data_cursor=8, run_id="someone-else", files={"__0_0.distcp": 16, ".metadata": 8},
                    dcp_dir="", ranks_acked=list(range(manifest["world_size"])))  # format 1: files in the step dir
    import json
    (foreign / MANIFEST).write_text(json.dumps(manifest))

    second = Run(tmp_path, ["train.steps=10", "checkpoint.keep=2"], None, 0)
    assert second.c.ckpt.run_id == first.c.ckpt.run_id  # a resume continues the run
    _train(second)
    second.c.ckpt.purger.wait_idle()
    committed = _committed(first.ckpt)
    assert committed[1] == "someone-else"  # another run's: never purged
    own = sorted(s for s, owner in committed.items() if owner == first.c.ckpt.run_id)
    assert own == [8, 10]  # keep=2 of its own


def test_after_a_failure_a_run_resumes_its_own_not_a_newer_foreign_one(tmp_path):
    run = Run(tmp_path, ["train.steps=8", "checkpoint.keep=10"], None, 0)
    run.steps(5)  # start + steps 1-4: step 2 committed, step 4 in flight or committed
    run.c.ckpt._try_commit(run.group, block=True)
    # Another run (same model) commits a newer step in the same directory meanwhile.
    newest = latest_valid(str(run.ckpt))
    foreign = run.ckpt / "step-00000007"
    os.makedirs(foreign)
    for name, size in newest.manifest.files.items():
        with open(foreign / name, "wb") as f:
            f.write(b"x" * size)
    data = newest.manifest.to_dict()
    data.update(step=7, data_cursor=7 * 8, run_id="other-run")
    import json
    (foreign / MANIFEST).write_text(json.dumps(data))

    run.group.fail(RankCalls.train_step, 1, "die", at=5)
    assert run.c.advance() == State.REBUILDING
    assert run.c.advance() == State.RUNNING
    loaded = {args[0] for _, args in run.group.calls(RankCalls.load_checkpoint)}
    assert loaded == {str(run.ckpt / "step-00000004" / "g1")}  # its own newest, not other-run's step 7
    assert _committed(run.ckpt)[7] == "other-run"
