"""A checkpoint remembers its data by content: a moved corpus resumes, other data is one line (exit 2)
pointing at a new run from the weights (tests/process/test_data_cli.py: a tokenizer larger than the
model is exit 2 before any actor)."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

from meshdata import open_source, prepare
from orchestrator.config.load import load_config
from orchestrator.errors import UserInputError
from orchestrator.saves.checkpointing import coordinator_for
from testbed.committed import commit_checkpoint


class _Events:
    def event(self, *_a, **_k) -> None:
        pass


def _committed(root: Path, cfg, identity: str) -> None:
    # The metadata imports nothing: it passes the driver's .metadata check.
    commit_checkpoint(root, cfg, 5, pickle.dumps({"fake": "metadata"}), data_identity=identity)


def test_resume_follows_data_content_not_path(tmp_path):
    (tmp_path / "a.txt").write_text("the first corpus " * 400)
    (tmp_path / "b.txt").write_text("another corpus! " * 400)
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "a"))
    prepare([str(tmp_path / "b.txt")], str(tmp_path / "b"))
    ckpt = tmp_path / "ckpt"
    cfg = load_config(None, [f"data.path={tmp_path / 'a'}", f"checkpoint.dir={ckpt}"])
    _committed(ckpt, cfg, open_source(str(tmp_path / "a")).identity)

    first = coordinator_for(cfg, _Events())
    assert first.resume_point().step == 5
    first.close()  # each coordinator is one driver: it gives back its lease on the directory
    shutil.move(tmp_path / "a", tmp_path / "moved")  # same content elsewhere: resumes
    moved = load_config(None, [f"data.path={tmp_path / 'moved'}", f"checkpoint.dir={ckpt}"])
    coord = coordinator_for(moved, _Events())
    assert coord.resume_point().step == 5 and coord.job.data_identity == open_source(str(tmp_path / "moved")).identity
    coord.close()

    other = load_config(None, [f"data.path={tmp_path / 'b'}", f"checkpoint.dir={ckpt}"])
    with pytest.raises(UserInputError) as ei:
        coordinator_for(other, _Events())
    msg = str(ei.value)
    assert ei.value.exit_code == 2 and "\n" not in msg
    assert "other data" in msg and "checkpoint.init_from" in msg and "new checkpoint.dir" in msg
