"""run_job refuses a checkpoint it cannot continue before Ray and the actors start (launch.check_checkpoint_dir):
another model, another global batch: one line, exit 2, the checkpoint left as it was."""

from __future__ import annotations

import pickle

import pytest

import orchestrator.launch as launch
from checkpoints.layout import step_dir_name
from orchestrator.config.load import load_config
from orchestrator.errors import UserInputError
from testbed.committed import commit_checkpoint

SAVED = ["model.d_model=64", "model.n_layers=2", "train.global_batch_size=8", "train.micro_batch_size=2"]


def _saved_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    # The metadata imports nothing: it passes the driver's .metadata check.
    commit_checkpoint(ckpt, load_config(None, SAVED), 4, pickle.dumps({"fake": "metadata"}))
    return ckpt


def _digest(step_dir):
    return sorted((p.name, p.read_bytes()) for p in step_dir.iterdir())


@pytest.mark.parametrize("change,needles", [
    (["model.d_model=32", "model.n_layers=3"], ["model.d_model", "model.n_layers", "different model config"]),
    (["train.global_batch_size=4"], ["train.global_batch_size=8", "skip or repeat"]),
], ids=["other-model", "other-global-batch"])
def test_a_checkpoint_the_job_cannot_continue_is_refused_before_ray_starts(tmp_path, monkeypatch, change, needles):
    ckpt = _saved_run(tmp_path)
    before = _digest(ckpt / step_dir_name(4))

    def no_cluster(cfg):
        raise AssertionError("Ray was started for a job that cannot resume its checkpoint")

    monkeypatch.setattr(launch, "connect", no_cluster)
    cfg = load_config(None, [*SAVED, f"checkpoint.dir={ckpt}", *change])
    with pytest.raises(UserInputError) as refused:
        launch.run_job(cfg, progress=False)
    line = str(refused.value)
    assert refused.value.exit_code == 2 and "\n" not in line and "checkpoint.dir" in line
    assert all(n in line for n in needles), line
    assert "model.vocab_size" not in line  # only the keys that differ
    assert _digest(ckpt / step_dir_name(4)) == before


def test_the_same_job_passes_and_a_new_run_is_not_checked_against_it(tmp_path):
    ckpt = _saved_run(tmp_path)
    launch.check_checkpoint_dir(load_config(None, [*SAVED, f"checkpoint.dir={ckpt}"]))  # resumes it
    launch.check_checkpoint_dir(load_config(None, [*SAVED, f"checkpoint.dir={tmp_path / 'new'}",
                                                   "model.d_model=32"]))  # an empty directory: nothing to continue
