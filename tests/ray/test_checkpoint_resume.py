"""Checkpoints through the real controller and Ray actors: stop a run, resume it in a NEW controller.

A run at mesh A trains steps 1..5 with a checkpoint every 2 steps and stops (steps 2 and 4 committed,
step 5 lost). A fresh controller on the same ``checkpoint.dir`` — at mesh B, with another dp, pp or
tp — resumes from step 4 and trains to the end. The whole run's per-step losses (step 5 is trained
twice, the last record wins) and the final gathered parameters must equal one uninterrupted
process. That proves the resharded load (model, AdamW state) and the data cursor: step k always
trains samples [(k-1)*G, k*G), so a resume at another mesh uses every sample exactly once.

The fault cases damage the newest checkpoint (a truncated shard, a mangled manifest), fill the disk
in the middle of a save, or point a run at a checkpoint of another model.

One pool of 8 actors serves the whole module (the (2,2,2) mesh needs all of them; smaller meshes
leave spares), and each stopped run is made once and copied for every resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints.catalog import list_checkpoints
from checkpoints.layout import step_dir_name
from orchestrator.config.load import load_config
from orchestrator.control.controller import State
from orchestrator.errors import TrainingFailed
from orchestrator.saves import checkpointing
from testbed.ray_cluster import make_group
from testbed.ray_harness import events, last_losses, make_controller, mesh_params
from testbed.reference import CONTROLLER_FP32, TEST_LR, assert_matches_reference, reference

pytestmark = pytest.mark.ray

STEPS, STOP_AFTER, EVERY, BATCH = 6, 5, 2, 8
BASE = [TEST_LR, "model.seq_len=32", f"train.global_batch_size={BATCH}", "train.micro_batch_size=2",
        f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "elastic.collective_timeout_s=60",
        "elastic.grow_check_s=1e6"]
ROOT = Path(__file__).resolve().parents[2]


def _mesh_id(shape) -> str:
    return "x".join(map(str, shape))


def _overrides(run_dir: Path, shape: tuple[int, int, int]) -> list[str]:
    dp, pp, tp = shape
    return BASE + [f"mesh.dp={dp}", f"mesh.pp={pp}", f"mesh.tp={tp}",
                   f"checkpoint.dir={run_dir / 'ckpt'}", f"metrics.path={run_dir / 'm.jsonl'}"]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "m.jsonl")]


def _steps_of_last_run(run_dir: Path) -> list[int]:
    """Steps the newest controller logged (everything after the last ``start`` event)."""
    records = _records(run_dir)
    last_start = max(i for i, r in enumerate(records) if r.get("event") == "start")
    return [r["step"] for r in records[last_start:] if "loss" in r]


def _valid_steps(run_dir: Path) -> list[int]:
    return [i.step for i in list_checkpoints(str(run_dir / "ckpt")) if i.valid]


def _digest(directory: Path) -> dict[str, str]:
    """Every file under a step directory (its attempt subdirectory's DCP files too) -> its hash."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def pool8(ray_local):
    group = make_group(8)
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def stopped_run(pool8, store_address, tmp_path_factory):
    """``get(shape)`` -> directory of a run at ``shape`` stopped after step 5 (made once per shape)."""
    made: dict[tuple[int, int, int], Path] = {}

    def get(shape: tuple[int, int, int]) -> Path:
        if shape not in made:
            made[shape] = _train_and_stop(tmp_path_factory.mktemp(f"stopped-{_mesh_id(shape)}"), shape,
                                          pool8, store_address)
        return made[shape]

    return get


def _train_and_stop(run_dir: Path, shape, pool, store_address) -> Path:
    cfg = load_config(None, _overrides(run_dir, shape))
    controller = make_controller(cfg, pool, store_address)
    while controller.next_step <= STOP_AFTER:  # the first call forms generation 1
        assert controller.advance() == State.RUNNING, controller.error
    # Let the step-4 write land so that two checkpoints exist (a real stop could lose it; the
    # fallback test needs a previous one), then drop the controller as a stopped job would.
    controller.ckpt.finish(pool, controller.generation, STOP_AFTER)
    controller.ckpt.close()
    controller.metrics.close()
    assert _valid_steps(run_dir) == [2, 4]
    manifest = list_checkpoints(str(run_dir / "ckpt"))[-1].manifest
    dp, pp, tp = shape
    assert manifest.mesh == {"dp": dp, "pp": pp, "tp": tp}
    # The cursor is global: samples of the (seed, epoch) order consumed, whatever the mesh.
    assert manifest.data_cursor == 4 * BATCH and manifest.global_batch_size == BATCH
    assert _steps_of_last_run(run_dir) == [1, 2, 3, 4, 5]
    return run_dir


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _resume(run_dir: Path, shape, pool, store_address):
    overrides = _overrides(run_dir, shape)
    controller = make_controller(load_config(None, overrides), pool, store_address)
    try:
        summary = controller.run()
    finally:
        controller.metrics.close()
    return controller, summary, overrides


RESHARD_CASES = [
    ((4, 1, 1), (1, 1, 1)), ((4, 1, 1), (2, 1, 2)), ((4, 1, 1), (4, 1, 1)),
    ((2, 2, 2), (4, 1, 1)), ((2, 2, 2), (1, 1, 1)), ((2, 2, 2), (2, 2, 2)),
]
# In the slow run only: dp 4 -> 2 alone is covered in the default run by 4 -> 1 (dp shrinks) and
# 4 -> (2, 1, 2) (dp halves while tp appears); (2, 2, 2) -> (1, 2, 2) (~25 s: dp shrinks, pp and tp
# kept) by (2, 2, 2) -> (1, 1, 1) and -> (2, 2, 2).
SLOW_RESHARD_CASES = [((4, 1, 1), (2, 1, 1)), ((2, 2, 2), (1, 2, 2))]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("source,target", [
    *[pytest.param(s, t, id=f"{_mesh_id(s)}-to-{_mesh_id(t)}") for s, t in RESHARD_CASES],
    *[pytest.param(s, t, id=f"{_mesh_id(s)}-to-{_mesh_id(t)}", marks=pytest.mark.slow)
      for s, t in SLOW_RESHARD_CASES]])
def test_resume_at_another_mesh_equals_one_process(source, target, stopped_run, pool8, store_address, tmp_path):
    run_dir = _copy_run(stopped_run(source), tmp_path / "run")
    pids = dict(pool8.pids)
    controller, summary, overrides = _resume(run_dir, target, pool8, store_address)
    assert summary.final_step == STEPS and summary.restarts == 0
    assert [e["resumed_from_step"] for e in events(run_dir / "m.jsonl", "start")] == [0, 4]
    # The new controller trained exactly the steps after the checkpoint, at the target mesh.
    assert _steps_of_last_run(run_dir) == [5, 6]
    shape = controller.generation.shape
    assert (shape.dp, shape.pp, shape.tp) == target
    assert [(r["dp"], r["pp"], r["tp"]) for r in _records(run_dir) if r.get("step") in (5, 6) and "loss" in r][-2:] \
        == [target, target]
    assert_matches_reference(last_losses(run_dir / "m.jsonl"), mesh_params(controller),
                             reference(overrides, STEPS), CONTROLLER_FP32)
    assert pool8.pids == pids  # the same processes did both runs: rebuilt in place, never restarted


def _truncate_a_shard(step_dir: Path) -> str:
    shard = sorted(step_dir.rglob("*.distcp"))[-1]  # in the attempt subdirectory the manifest names
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    return "truncated"


def _mangle_manifest(step_dir: Path) -> str:
    manifest = step_dir / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])  # cut mid-write: not JSON any more
    return "bad manifest.json"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("damage", [_truncate_a_shard, _mangle_manifest], ids=["truncated-shard", "mangled-manifest"])
def test_damaged_newest_checkpoint_resumes_from_the_previous(damage, stopped_run, pool8, store_address,
                                                             tmp_path, caplog):
    run_dir = _copy_run(stopped_run((4, 1, 1)), tmp_path / "run")
    newest = run_dir / "ckpt" / step_dir_name(4)
    reason = damage(newest)
    with caplog.at_level(logging.WARNING):
        controller, summary, overrides = _resume(run_dir, (2, 1, 1), pool8, store_address)
    skipped, = events(run_dir / "m.jsonl", "checkpoint_skipped")
    assert skipped["step"] == 4 and reason in skipped["reason"]
    assert any("skipping checkpoint" in r.getMessage() and str(newest) in r.getMessage() for r in caplog.records)
    assert [e["resumed_from_step"] for e in events(run_dir / "m.jsonl", "start")] == [0, 2]
    assert _steps_of_last_run(run_dir) == [3, 4, 5, 6]
    assert_matches_reference(last_losses(run_dir / "m.jsonl"), mesh_params(controller),
                             reference(overrides, STEPS), CONTROLLER_FP32)
    assert _valid_steps(run_dir) == [2, 4, 6]  # the damaged step 4 was replaced by a good one


@pytest.mark.timeout(600)
def test_disk_full_during_a_save_stops_cleanly_and_a_rerun_resumes(stopped_run, pool8, store_address,
                                                                   tmp_path, monkeypatch):
    run_dir = _copy_run(stopped_run((4, 1, 1)), tmp_path / "run")
    before = {s: _digest(run_dir / "ckpt" / step_dir_name(s)) for s in (2, 4)}
    real_prepare = checkpointing.prepare_attempt

    def prepare_on_a_full_disk(step_path, attempt, storage=None):
        # Rank 1's shard of step 6 lands on /dev/full: its write fails with ENOSPC in the actor,
        # exactly as on a full disk, while every rank stays alive.
        path = real_prepare(step_path, attempt, storage)
        if step_path.rstrip("/").endswith(step_dir_name(6)):
            os.symlink("/dev/full", os.path.join(path, "__1_0.distcp"))
        return path

    monkeypatch.setattr(checkpointing, "prepare_attempt", prepare_on_a_full_disk)
    with pytest.raises(TrainingFailed) as failed:
        _resume(run_dir, (2, 1, 1), pool8, store_address)
    message = str(failed.value)
    assert "checkpoint.dir" in message and "step 6" in message and "No space left on device" in message
    assert "\n" not in message and "newest: step 4" in message
    failure, = events(run_dir / "m.jsonl", "checkpoint_failed")
    assert failure["step"] == 6 and "No space left" in failure["reason"]
    # Nothing half-written became a checkpoint, and the older ones are byte-for-byte untouched.
    assert _valid_steps(run_dir) == [2, 4]
    assert {s: _digest(run_dir / "ckpt" / step_dir_name(s)) for s in (2, 4)} == before
    # The disk has room again: a rerun resumes from step 4 and the run still equals one process.
    monkeypatch.setattr(checkpointing, "prepare_attempt", real_prepare)
    controller, summary, overrides = _resume(run_dir, (2, 1, 1), pool8, store_address)
    assert [e["resumed_from_step"] for e in events(run_dir / "m.jsonl", "start")] == [0, 4, 4]
    assert_matches_reference(last_losses(run_dir / "m.jsonl"), mesh_params(controller),
                             reference(overrides, STEPS), CONTROLLER_FP32)
    assert _valid_steps(run_dir) == [2, 4, 6]


def _cli_train(*overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray, not ours
    args = [sys.executable, "-m", "orchestrator", "train", "--no-progress"]
    for o in overrides:
        args += ["--set", o]
    return subprocess.run(args, capture_output=True, text=True, timeout=170, cwd=ROOT, env=env)


def _assert_one_line_exit(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert proc.returncode == code, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "elastimesh: error:" in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("change,needles", [
    (["model.d_model=32", "model.n_layers=2"], ["model.d_model", "model.n_layers", "checkpoint.dir"]),
    # slow: the same refusal path as other-model, for another key (tests/unit/test_launch_checkpoint_dir.py
    # has both, without the CLI)
    pytest.param([f"train.global_batch_size={BATCH // 2}"], ["train.global_batch_size=8", "checkpoint.dir"],
                 marks=pytest.mark.slow),
], ids=["other-model", "other-global-batch"])
def test_cli_refuses_a_checkpoint_it_cannot_continue(change, needles, stopped_run, tmp_path):
    run_dir = _copy_run(stopped_run((4, 1, 1)), tmp_path / "run")
    before = _digest(run_dir / "ckpt" / step_dir_name(4))
    proc = _cli_train(*BASE, "mesh.dp=1", "mesh.tp=1", f"checkpoint.dir={run_dir / 'ckpt'}", *change)
    line = _assert_one_line_exit(proc, 2, *needles)
    assert "model.vocab_size" not in line  # only the keys that differ
    assert _digest(run_dir / "ckpt" / step_dir_name(4)) == before


@pytest.mark.timeout(200)
def test_cli_unwritable_checkpoint_dir_is_bad_input(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    proc = _cli_train("mesh.dp=1", "mesh.tp=1", "train.steps=2", f"checkpoint.dir={blocker / 'ckpt'}")
    _assert_one_line_exit(proc, 2, "checkpoint.dir", "not writable")
