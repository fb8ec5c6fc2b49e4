"""A rebuild's plan asks storage only for the newest committed step (``resume_point(vet_metadata=False)``:
DCP's pickled ``.metadata`` unread, 20-60 ms saved on every recovery that restores snapshots); a load
from storage still refuses a crafted ``.metadata`` before any rank is called (README, Trust boundary;
the CLI's refusal: tests/process/test_trust_boundary.py)."""

from __future__ import annotations

import pickle

import pytest

from checkpoints.safe_pickle import UnsafeCheckpointError
from orchestrator.config.load import load_config
from orchestrator.saves.checkpointing import coordinator_for
from testbed.committed import commit_checkpoint


class _Events:
    def event(self, *_a, **_k) -> None:
        pass


class _CreatesFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # unpickling calls open(path, "w")


class _NoGroup:
    """A worker group no call may reach: the refusal must come before any rank loads."""

    def submit(self, *_a, **_k):
        raise AssertionError("a rank was asked to load a crafted checkpoint")


def test_the_plan_reads_the_step_and_the_load_refuses_a_crafted_metadata(tmp_path):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "created-by-the-pickle"
    cfg = load_config(None, [f"checkpoint.dir={ckpt}"])
    coord = coordinator_for(cfg, _Events())
    try:
        # As if this run had committed it.
        commit_checkpoint(ckpt, cfg, 5, pickle.dumps(_CreatesFile(str(marker))), run_id=coord.run_id)
        assert coord.resume_point(vet_metadata=False).step == 5
        with pytest.raises(UnsafeCheckpointError, match="io.open"):
            coord.resume_point()
        with pytest.raises(UnsafeCheckpointError, match="io.open"):
            coord.restore(_NoGroup(), None)
    finally:
        coord.close()
    assert not marker.exists()
