"""A checkpoint directory is data, never code (README, Trust boundary), through the real CLI.

A crafted committed checkpoint whose DCP ``.metadata`` pickle would create a file when unpickled:
resuming from it (``checkpoint.resume``), starting from it (``checkpoint.init_from``) and exporting it
(``elastimesh export``) each exit 2 with one line, and the file is never created. Both manifest forms
are tried: with a ``files`` map (the pickle is first met by the resume check and the exporter's
restricted unpickler) and without one (met by the catalog's size check). A checkpoint that records a
model family outside elastimesh is exported only when ``--family`` names it.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from checkpoints.layout import DCP_METADATA, MANIFEST, step_dir_name
from checkpoints.manifest import CheckpointManifest
from checkpoints.safe_pickle import UnsafeCheckpointError, check_metadata_bytes, restricted_loads, scan_globals
from testbed.command_line import assert_bad_input

pytestmark = pytest.mark.timeout(2400)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # Each call imports torch (export) or more: generous on a loaded 2-core machine.
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, timeout=600)


class _CreatesFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # unpickling calls open(path, "w")


def crafted_checkpoint(root, marker: str, *, files_map: bool) -> str:
    step_dir = os.path.join(str(root), step_dir_name(2))
    os.makedirs(step_dir)
    with open(os.path.join(step_dir, DCP_METADATA), "wb") as fh:
        fh.write(pickle.dumps(_CreatesFile(marker)))
    with open(os.path.join(step_dir, "__0_0.distcp"), "wb") as fh:
        fh.write(b"\0" * 64)
    files = {name: os.path.getsize(os.path.join(step_dir, name)) for name in (DCP_METADATA, "__0_0.distcp")}
    manifest = CheckpointManifest(
        step=2, generation=1, mesh={"dp": 1, "pp": 1, "tp": 1}, model_fingerprint="any", data_cursor=8,
        global_batch_size=4, world_size=1, ranks_acked=[0], files=files if files_map else {}, run_id="someone")
    with open(os.path.join(step_dir, MANIFEST), "w") as fh:  # committed, as the driver writes it
        fh.write(manifest.to_json())
    return step_dir


@pytest.mark.parametrize("files_map", [True, False], ids=["files-map", "no-files-map"])
def test_a_crafted_checkpoint_is_refused_by_resume_init_from_and_export(tmp_path, files_map):
    marker = str(tmp_path / "created-by-the-pickle")
    root = tmp_path / "ckpt"
    step_dir = crafted_checkpoint(root, marker, files_map=files_map)
    resume = run_cli("train", "--set", f"checkpoint.dir={root}", "--set", "checkpoint.resume=true")
    assert_bad_input(resume, "imports io.open", "Trust boundary")
    if files_map:  # init_from reads safetensors only: DCP's pickles are never opened
        init_from = run_cli("train", "--set", "model.family=llama", "--set", f"checkpoint.init_from={step_dir}")
        assert_bad_input(init_from, "checkpoint.init_from", "no *.safetensors")
    export = run_cli("export", step_dir, "--out", str(tmp_path / "out"))
    assert_bad_input(export, "imports io.open", "Trust boundary")
    assert not os.path.exists(marker)
    assert not (tmp_path / "out").exists()


def test_the_static_check_and_the_restricted_unpickler_refuse_what_pickle_would_run(tmp_path):
    marker = str(tmp_path / "created")
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        data = pickle.dumps(_CreatesFile(marker), protocol=protocol)
        assert ("io", "open") in scan_globals(data)
        with pytest.raises(UnsafeCheckpointError, match="imports io.open"):
            check_metadata_bytes(data)
        with pytest.raises(UnsafeCheckpointError, match="imports io.open"):
            restricted_loads(data)
    assert not os.path.exists(marker)
    # An import whose name is not a string constant of the stream cannot be read statically: refused.
    computed = b"\x80\x04\x8c\x02io\x94)\x93."  # STACK_GLOBAL("io", <an empty tuple>)
    with pytest.raises(UnsafeCheckpointError, match="computed"):
        check_metadata_bytes(computed)


def test_real_dcp_metadata_passes_both_checks(tmp_path):
    """What DCP writes for an FSDP2 model, its optimizer and our extras (one process) loads."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from checkpoints.reader import load
    from checkpoints.state import ModelState, OptimizerState, capture_extras

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        extra = capture_extras(3, 24, loss_scale={"scale": 2.0**15, "growth_tracker": 1})
        extra["model"] = json.dumps({"family": "gpt"})
        path = str(tmp_path / "ckpt")
        dcp.save({"model": ModelState([model]), "optim": OptimizerState([model], [opt]), "extra": extra},
                 checkpoint_id=path)
        data = open(os.path.join(path, DCP_METADATA), "rb").read()
        check_metadata_bytes(data)
        assert restricted_loads(data).state_dict_metadata.keys() == pickle.loads(data).state_dict_metadata.keys()
        state = {"model": ModelState([model]), "optim": OptimizerState([model], [opt])}
        got = load(state, path)  # byte items (the optimizer's hyperparameters, the extras): weights_only
        assert {k: got[k] for k in ("step", "data_cursor", "loss_scale", "model")} == {
            "step": 3, "data_cursor": 24, "loss_scale": {"scale": 2.0**15, "growth_tracker": 1}, "model": extra["model"]}
        assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    finally:
        dist.destroy_process_group()


def test_export_imports_a_recorded_family_only_when_the_user_names_it(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from checkpoints.errors import CheckpointError
    from meshmodels import export

    imported = []
    monkeypatch.setattr("checkpoints.reader.load", lambda state, path: {"model": json.dumps(
        {"family": "evil_pkg.mod:Family", "hf_config": {"x": 1}})})
    monkeypatch.setattr("meshmodels.family.load_family", lambda ref: imported.append(ref) or SimpleNamespace(
        shape_from_hf=lambda config, stub, where: "shape"))
    manifest = SimpleNamespace(model_config={})
    with pytest.raises(CheckpointError, match="--family evil_pkg.mod:Family"):
        export.model_of("step", manifest)
    assert imported == []
    assert export.model_of("step", manifest, family="evil_pkg.mod:Family")[1] == "shape"
    assert imported == ["evil_pkg.mod:Family"]
    assert export.tokenizer_source("s3://bucket/data") == "" and export.tokenizer_source("/data/x") == "/data/x"
    assert export.tokenizer_source("s3://bucket/data", "s3://mine") == "s3://mine"


def _checkpoint_storing_at(tmp_path, relative_path: str) -> str:
    """A committed checkpoint of real DCP files whose ``.metadata`` says one tensor lives at
    ``relative_path`` (DCP itself writes plain file names only)."""
    import torch
    import torch.distributed.checkpoint as dcp

    step_dir = os.path.join(str(tmp_path / "ckpt"), step_dir_name(2))
    dcp.save({"w": torch.ones(4)}, checkpoint_id=step_dir, no_dist=True)
    meta_path = os.path.join(step_dir, DCP_METADATA)
    metadata = pickle.loads(open(meta_path, "rb").read())
    for info in metadata.storage_data.values():
        info.relative_path = relative_path
    with open(meta_path, "wb") as fh:
        fh.write(pickle.dumps(metadata))
    manifest = CheckpointManifest(
        step=2, generation=1, mesh={"dp": 1, "pp": 1, "tp": 1}, model_fingerprint="any", data_cursor=8,
        global_batch_size=4, world_size=1, ranks_acked=[0], files={}, run_id="someone")
    with open(os.path.join(step_dir, MANIFEST), "w") as fh:
        fh.write(manifest.to_json())
    return step_dir


@pytest.mark.parametrize("where", ["../../secret.distcp", "/etc/hostname", ".."])
def test_metadata_that_stores_data_outside_its_directory_is_refused(tmp_path, where):
    """#36 item 11: DCP joins ``relative_path`` as it stands; a path that is absolute or climbs is refused
    before any file is read, by the ranks' reader and by ``elastimesh export`` (exit 2, one line)."""
    import torch

    from checkpoints.reader import load, read_metadata

    step_dir = _checkpoint_storing_at(tmp_path, where)
    with pytest.raises(UnsafeCheckpointError, match="a path rather than a file name"):
        read_metadata(step_dir)
    with pytest.raises(UnsafeCheckpointError, match="a path rather than a file name"):
        load({"w": torch.zeros(4)}, step_dir)
    export = run_cli("export", step_dir, "--out", str(tmp_path / "out"))
    assert_bad_input(export, "a path rather than a file name", "Trust boundary")
    assert not (tmp_path / "out").exists()
