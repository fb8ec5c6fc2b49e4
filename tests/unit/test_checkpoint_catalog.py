"""Driver-side checkpoint catalog: manifests, validation, fallback, commit, purge, storage backends.

No processes: real DCP files come from a one-process ``dcp.save(..., no_dist=True)``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import uuid

import pytest

from checkpoints.catalog import (
    BackgroundPurger,
    commit,
    ensure_writable,
    latest_valid,
    list_checkpoints,
    prepare_step,
    purge,
)
from checkpoints.errors import CheckpointError, CheckpointMismatchError, ManifestError
from checkpoints.inspect_view import describe, format_table, require_root
from checkpoints.layout import DCP_METADATA, MANIFEST, expected_file_sizes, parse_step, step_dir_name
from checkpoints.manifest import FORMAT_VERSION, CheckpointManifest
from checkpoints.storage import FsspecStorage, LocalStorage, storage_for
from meshspeak.locations import local_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's one-process notices
SHARD = "__0_0.distcp"


def _manifest(step: int, files: dict[str, int] | None = None, **changes) -> CheckpointManifest:
    fields = dict(step=step, generation=1, mesh={"dp": 1, "pp": 1, "tp": 1}, model_fingerprint="fp-1",
                  data_cursor=step * 8, global_batch_size=8, world_size=1, ranks_acked=[0],
                  schedule="1f1b", stage_layers=[[0, 1]], model_config={"n_layers": 2}, files=files or {})
    fields.update(changes)
    return CheckpointManifest(**fields)


def _write_shards(root: str, step: int) -> dict[str, int]:
    """A real DCP checkpoint of a couple of tensors in ``root/step-N``; returns its file sizes."""
    import torch
    import torch.distributed.checkpoint as dcp

    from checkpoints.writer import dcp_writer

    storage = storage_for(root)
    path = storage.join(root, step_dir_name(step))
    state = {"model": {"w": torch.arange(64.0).reshape(8, 8) + step, "b": torch.ones(8)}, "extra": {"step": step}}
    metadata = dcp.save(state, storage_writer=dcp_writer(path), no_dist=True)
    files = expected_file_sizes(metadata)
    files[DCP_METADATA] = storage.file_size(storage.join(path, DCP_METADATA))
    return files


def _checkpoint(root: str, step: int, *, with_files: bool = True) -> str:
    files = _write_shards(root, step)
    return commit(root, _manifest(step, files if with_files else None))


def test_step_dir_names():
    assert step_dir_name(120) == "step-00000120"
    assert parse_step("step-00000120") == 120 and parse_step("step-00000120/") == 120
    assert parse_step(step_dir_name(123456789)) == 123456789
    for bad in ("step-12", "step-0000012x", "foo", "step-00000120.tmp", "manifest.json"):
        assert parse_step(bad) is None
    with pytest.raises(ValueError):
        step_dir_name(-1)


def test_manifest_round_trip():
    m = _manifest(40, {SHARD: 10, DCP_METADATA: 5})
    again = CheckpointManifest.from_json(m.to_json())
    assert again == m and again.mesh_str == "dp=1 pp=1 tp=1" and again.format_version == FORMAT_VERSION == 2
    assert json.loads(m.to_json())["data_cursor"] == 320
    with pytest.raises(ManifestError, match="pp=2"):  # 3 stages cannot spread over 2 pipeline ranks
        _manifest(1, mesh={"dp": 1, "pp": 2, "tp": 1}, world_size=2, ranks_acked=[0, 1], stage_layers=[[0], [1], [2]])


@pytest.mark.parametrize("text", [
    "", "{", "[1, 2]", "null", '{"format_version": 1}',
    "CHANGE step='12'", "CHANGE world_size=3", "CHANGE mesh={'dp': 1, 'pp': 1}", "CHANGE format_version=99",
    "CHANGE ranks_acked=[0, 7]", "CHANGE data_cursor=-8", "CHANGE files={'../x': 3}", "CHANGE created_at='now'",
    "CHANGE stage_layers=[[0], ['x']]", "CHANGE mesh={'dp': 1, 'pp': 0, 'tp': 1}", "CHANGE dcp_dir='../g1'",
    "CHANGE dcp_dir='g1/x'", "CHANGE dcp_dir='..'", "CHANGE dcp_dir=3",
])
def test_mangled_manifest_raises(text):
    if text.startswith("CHANGE "):
        data = json.loads(_manifest(10).to_json())
        key, value = text[len("CHANGE "):].split("=", 1)
        data[key] = eval(value)  # test-only literals
        text = json.dumps(data)
    with pytest.raises(ManifestError) as info:
        CheckpointManifest.from_json(text, "/r/step-00000010/manifest.json")
    assert "/r/step-00000010/manifest.json" in str(info.value)


def test_errors_pickle():
    for err in (CheckpointError("boom", "/p"), ManifestError("bad", "/m"), CheckpointMismatchError(["a.b"], "/c", "d")):
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is type(err) and str(again) == str(err) and again.path == err.path
    assert pickle.loads(pickle.dumps(CheckpointMismatchError(["x", "y"]))).keys == ["x", "y"]


@pytest.mark.parametrize("with_files", [True, False], ids=["manifest-sizes", "dcp-metadata-fallback"])
def test_latest_valid_skips_damaged_newer_ones(tmp_path, caplog, with_files):
    root = str(tmp_path)
    for step in (10, 20):
        _checkpoint(root, step, with_files=with_files)
    truncated = _checkpoint(root, 30, with_files=with_files)
    with open(os.path.join(truncated, SHARD), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    mangled = _checkpoint(root, 40, with_files=with_files)
    with open(os.path.join(mangled, MANIFEST), "w") as f:
        f.write('{"step": 40, "mesh": ')
    _write_shards(root, 50)  # shards but never committed
    no_metadata = _checkpoint(root, 60, with_files=with_files)
    os.remove(os.path.join(no_metadata, DCP_METADATA))
    os.makedirs(os.path.join(root, "not-a-step"))

    with caplog.at_level(logging.WARNING, logger="checkpoints.catalog"):
        best = latest_valid(root)
    assert best is not None and best.step == 20 and best.valid and best.manifest.data_cursor == 160
    reasons = {i.step: i.reason for i in list_checkpoints(root)}
    assert [i.step for i in list_checkpoints(root)] == [10, 20, 30, 40, 50, 60]
    assert reasons[10] == reasons[20] == ""
    assert "truncated" in reasons[30] and "bad manifest.json" in reasons[40]
    assert reasons[50].startswith("partial") and ".metadata" in reasons[60]
    warned = " ".join(r.getMessage() for r in caplog.records)
    for step in (30, 40, 50, 60):
        assert step_dir_name(step) in warned


def test_missing_root_lists_nothing(tmp_path):
    assert list_checkpoints(str(tmp_path / "nope")) == [] and latest_valid(str(tmp_path / "nope")) is None


def test_latest_valid_among_steps_and_reporting_skips(tmp_path, caplog):
    """The resume decision's options (CheckpointCoordinator.resume_point): only the steps a run
    committed, and skipped damaged ones handed to the caller instead of logged."""
    root = str(tmp_path)
    for step in (10, 20, 30):
        _checkpoint(root, step)
    _write_shards(root, 40)  # never committed
    skipped = []
    with caplog.at_level(logging.WARNING, logger="checkpoints.catalog"):
        assert latest_valid(root, on_skip=skipped.append).step == 30
        assert latest_valid(root, among={10, 20, 40}, on_skip=skipped.append).step == 20
        assert latest_valid(root, among=set()) is None
    assert [i.step for i in skipped] == [40, 40]
    assert not [r for r in caplog.records if r.name == "checkpoints.catalog" and "skipping" in r.getMessage()]


def test_purge_keeps_newest_and_cleans_partials(tmp_path):
    root = str(tmp_path)
    for step in (10, 20, 30, 40):
        _checkpoint(root, step)
    for step in (15, 35, 50):  # 50 is newer than every commit: maybe a save in flight
        _write_shards(root, step)
    assert purge(root, keep=0) == []
    removed = purge(root, keep=2)
    assert sorted(parse_step(os.path.basename(p)) for p in removed) == [10, 15, 20, 35]
    assert sorted(os.listdir(root)) == [step_dir_name(s) for s in (30, 40, 50)]


class _FlakyStorage(LocalStorage):
    def __init__(self, fail_on: str) -> None:
        self.fail_on = fail_on

    def remove_tree(self, path: str) -> None:
        if path.endswith(self.fail_on):
            raise PermissionError(f"cannot delete {path}")
        super().remove_tree(path)


def test_background_purger_logs_and_continues(tmp_path, caplog):
    root = str(tmp_path)
    for step in (10, 20, 30):
        _checkpoint(root, step)
    storage = _FlakyStorage(step_dir_name(10))
    purger = BackgroundPurger(storage)
    with caplog.at_level(logging.WARNING, logger="checkpoints.catalog"):
        purger.request(root, keep=1)
        purger.wait_idle()
    assert sorted(os.listdir(root)) == [step_dir_name(10), step_dir_name(30)]
    assert "could not delete" in caplog.text
    storage.fail_on = "never"
    purger.request(root, keep=1)  # the thread survived the failure and retries
    purger.wait_idle()
    assert os.listdir(root) == [step_dir_name(30)]
    purger.close()


def test_commit_writes_manifest_last_and_atomically(tmp_path, monkeypatch):
    root = str(tmp_path)
    _checkpoint(root, 10)
    files = _write_shards(root, 20)
    final = os.path.join(root, step_dir_name(20), MANIFEST)
    assert latest_valid(root).step == 10
    real_replace = os.replace
    seen = {}

    def checking_replace(src, dst):
        seen["visible_before_rename"] = os.path.exists(final)
        seen["tmp_complete"] = CheckpointManifest.from_json(open(src).read()).step == 20
        real_replace(src, dst)

    monkeypatch.setattr("checkpoints.storage.os.replace", checking_replace)
    commit(root, _manifest(20, files))
    assert seen == {"visible_before_rename": False, "tmp_complete": True}
    assert latest_valid(root).step == 20


def test_failed_commit_leaves_older_checkpoints(tmp_path, monkeypatch):
    root = str(tmp_path)
    _checkpoint(root, 10)
    files = _write_shards(root, 20)

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("checkpoints.storage.os.replace", full_disk)
    with pytest.raises(CheckpointError, match="No space left") as info:
        commit(root, _manifest(20, files))
    assert step_dir_name(20) in str(info.value)
    monkeypatch.undo()
    step20 = os.listdir(os.path.join(root, step_dir_name(20)))
    assert MANIFEST not in step20 and not [n for n in step20 if ".tmp" in n]
    assert latest_valid(root).step == 10


def test_commit_refuses_missing_acks_and_bad_shards(tmp_path):
    root = str(tmp_path)
    files = _write_shards(root, 20)
    two = dict(mesh={"dp": 2, "pp": 1, "tp": 1}, world_size=2)
    with pytest.raises(CheckpointError, match=r"ranks \[1\] of 2 never acked"):
        commit(root, _manifest(20, files, ranks_acked=[0], **two))
    with pytest.raises(CheckpointError, match="truncated"):
        commit(root, _manifest(20, {**files, SHARD: files[SHARD] + 1}))
    os.remove(os.path.join(root, step_dir_name(20), DCP_METADATA))
    with pytest.raises(CheckpointError, match="metadata"):
        commit(root, _manifest(20, files))
    assert latest_valid(root) is None


def test_root_beneath_a_file_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    root = str(blocker / "ckpt")
    with pytest.raises(CheckpointError, match="checkpoint.dir") as info:
        ensure_writable(root)
    assert root in str(info.value)
    with pytest.raises(CheckpointError):
        prepare_step(root, 10)
    ensure_writable(str(tmp_path / "fine" / "ckpt"))  # creates it
    assert os.listdir(tmp_path / "fine" / "ckpt") == []


def test_require_root_wants_an_existing_directory(tmp_path):
    """`ckpt list` of a mistyped path is an error, although a resume treats an absent root as empty."""
    missing = str(tmp_path / "nope")
    assert list_checkpoints(missing) == []
    with pytest.raises(CheckpointError, match="no such checkpoint directory: give .*checkpoint.dir") as info:
        require_root(missing)
    assert info.value.path == missing
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        require_root(str(blocker))
    require_root(str(tmp_path))
    with pytest.raises(CheckpointError, match="ckpt list DIR"):
        describe(missing)


def test_prepare_step_clears_a_leftover(tmp_path, caplog):
    root = str(tmp_path)
    _write_shards(root, 10)  # an interrupted save: shards, no manifest (a committed one is never removed)
    with caplog.at_level(logging.WARNING, logger="checkpoints.catalog"):
        path = prepare_step(root, 10)
    assert os.listdir(path) == [] and "leftover" in caplog.text


def test_memory_fsspec_root(caplog):
    root = f"memory://elastimesh-{uuid.uuid4().hex[:8]}/ckpt"
    storage = storage_for(root)
    assert isinstance(storage, FsspecStorage) and not storage.is_local and local_path(root) is None
    for step in (10, 20):
        _checkpoint(root, step)
    broken = _checkpoint(root, 30)
    shard = storage.join(broken, SHARD)
    storage.fs.pipe_file(shard, storage.fs.cat_file(shard)[:100])
    with caplog.at_level(logging.WARNING, logger="checkpoints.catalog"):
        assert latest_valid(root).step == 20
    assert "truncated" in caplog.text
    assert describe(storage.join(root, step_dir_name(20)))["mesh"] == {"dp": 1, "pp": 1, "tp": 1}
    assert purge(root, keep=1) == [storage.join(root, step_dir_name(10))]
    assert storage.listdir(root) == [step_dir_name(20), step_dir_name(30)]
    storage.write_text_atomic(storage.join(root, "note.txt"), "hi")
    assert storage.read_text(storage.join(root, "note.txt")) == "hi" and storage.size_of_tree(root) > 0
    storage.remove_tree(root)
    assert storage.listdir(root) == []


def test_describe_and_table(tmp_path):
    root = str(tmp_path)
    good = _checkpoint(root, 10)
    _write_shards(root, 20)
    facts = describe(good)
    assert facts["valid"] and facts["step"] == 10 and facts["mesh"]["dp"] == 1 and facts["size_bytes"] > 0
    assert facts["data_cursor"] == 80 and json.dumps(facts)
    partial = describe(os.path.join(root, step_dir_name(20)) + "/")
    assert not partial["valid"] and partial["step"] == 20 and partial["reason"].startswith("partial")
    with pytest.raises(CheckpointError):
        describe(os.path.join(root, step_dir_name(99)))
    table = format_table(list_checkpoints(root)).splitlines()
    assert table[0].startswith("STEP") and "yes" in table[1] and "NO" in table[2] and "partial" in table[2]


def test_file_uri_is_local(tmp_path):
    uri = f"file://{tmp_path}"
    assert isinstance(storage_for(uri), LocalStorage) and local_path(uri) == str(tmp_path)
    _checkpoint(uri, 10)
    assert latest_valid(uri).step == 10
