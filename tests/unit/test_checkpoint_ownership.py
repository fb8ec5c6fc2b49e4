"""Checkpoint ownership: a run purges, replaces and resumes only its own step directories, and the
CLI's view of a checkpoint never unpickles DCP's .metadata."""

from __future__ import annotations

import os
import pickle

import pytest

from checkpoints.catalog import commit, latest_valid, list_checkpoints, prepare_step, purge
from checkpoints.inspect_view import describe, format_table
from checkpoints.errors import CheckpointError
from checkpoints.layout import DCP_METADATA, step_dir_name
from checkpoints.manifest import CheckpointManifest


def _manifest(step: int, run_id: str, files: dict[str, int] | None = None) -> CheckpointManifest:
    return CheckpointManifest(step=step, generation=1, mesh={"dp": 1, "pp": 1, "tp": 1}, model_fingerprint="fp",
                              data_cursor=step * 8, global_batch_size=8, world_size=1, ranks_acked=[0],
                              files=files if files is not None else {"shard": 4, DCP_METADATA: 2}, run_id=run_id)


def _save(root: str, step: int, run_id: str, *, files: dict[str, int] | None = None) -> str:
    """What a save does on disk, without tensors: prepare (owner marker), shard files, commit."""
    path = prepare_step(root, step, run_id=run_id)
    for name, size in {"shard": 4, DCP_METADATA: 2}.items():
        with open(os.path.join(path, name), "wb") as fh:
            fh.write(b"x" * size)
    return commit(root, _manifest(step, run_id, files))


def test_purge_keeps_other_runs_checkpoints(tmp_path):
    root = str(tmp_path)
    for step in (10, 20, 30):
        _save(root, step, "run-a")
    for step in (1, 2, 3):  # run b (resume=false elsewhere) writes lower step numbers
        _save(root, step, "run-b")
    removed = purge(root, keep=1, run_id="run-b")
    assert sorted(os.path.basename(p) for p in removed) == [step_dir_name(1), step_dir_name(2)]
    by_step = {i.step: i for i in list_checkpoints(root)}
    assert {s for s, i in by_step.items() if i.valid} == {3, 10, 20, 30}  # run a untouched
    assert by_step[3].owner == "run-b" and by_step[30].owner == "run-a"


def test_latest_valid_of_one_run(tmp_path):
    root = str(tmp_path)
    _save(root, 30, "run-a")
    _save(root, 2, "run-b")
    assert latest_valid(root).step == 30
    assert latest_valid(root, run_id="run-b").step == 2
    assert latest_valid(root, run_id="run-c") is None


def test_prepare_step_never_removes_a_committed_or_foreign_directory(tmp_path):
    root = str(tmp_path)
    committed = _save(root, 5, "run-a")
    with pytest.raises(CheckpointError, match="committed checkpoint of run run-a"):
        prepare_step(root, 5, run_id="run-b")
    with pytest.raises(CheckpointError, match="committed checkpoint"):
        prepare_step(root, 5, run_id="run-a")  # even its own run: a committed step is never redone
    in_flight = prepare_step(root, 6, run_id="run-a")  # a save of run a in progress (no manifest)
    with pytest.raises(CheckpointError, match="a save of run run-a"):
        prepare_step(root, 6, run_id="run-b")
    assert os.path.exists(os.path.join(committed, "manifest.json")) and os.path.isdir(in_flight)
    # Its own interrupted try, and a leftover of no known run, are replaced.
    assert prepare_step(root, 6, run_id="run-a") == in_flight
    os.makedirs(os.path.join(root, step_dir_name(7)))
    prepare_step(root, 7, run_id="run-a")
    assert list_checkpoints(root)[-1].owner == "run-a"


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/elastimesh-pwned",))


def test_cli_view_never_unpickles_dcp_metadata(tmp_path):
    root = str(tmp_path)
    path = _save(root, 4, "run-a")
    with open(os.path.join(path, "manifest.json"), "w") as fh:  # a manifest without a file map
        fh.write(_manifest(4, "run-a", files={}).to_json())
    with open(os.path.join(path, DCP_METADATA), "wb") as fh:
        fh.write(pickle.dumps(_Boom()))
    marker = "/tmp/elastimesh-pwned"
    if os.path.exists(marker):
        os.remove(marker)
    infos = list_checkpoints(root, read_dcp_metadata=False)
    facts = describe(path)
    assert not os.path.exists(marker)
    assert infos[0].valid and "no file map" in infos[0].reason and facts["valid"]
    assert "run-a" in format_table(infos)
    os.makedirs(os.path.join(root, step_dir_name(8)))
    assert "no manifest.json" in describe(os.path.join(root, step_dir_name(8)))["reason"]


def test_old_manifests_without_run_id_still_load():
    data = _manifest(3, "x").to_dict()
    del data["run_id"]
    assert CheckpointManifest.from_dict(data).run_id == ""
