"""Bad input through the real CLI: exit 2, one line on stderr naming the key and the fix, no traceback."""

from __future__ import annotations

import pytest

from testbed.command_line import assert_bad_input, run_cli

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "overrides,needles",
    [
        (["mesh.dp=4", "mesh.tp=4", "train.global_batch_size=16", "train.micro_batch_size=1"],
         ["mesh.dp*pp*tp=16", "lower mesh.dp"]),  # more than the cluster holds
        (["mesh.tp=3", "model.n_heads=4"], ["model.n_heads", "mesh.tp"]),
        (["mesh.tp=2", "model.vocab_size=257"], ["model.vocab_size"]),
        (["train.global_batch_size=10", "train.micro_batch_size=4"], ["train.global_batch_size"]),
        (["model.n_layer=3"], ["model.n_layer", "model.n_layers"]),  # unknown key: closest suggested
        (["train.lr=fast"], ["train.lr", "expected a number"]),
        (["mesh.dp=0"], ["mesh.dp"]),
        (["model.d_model=-64"], ["model.d_model"]),
        (["data.path=/nonexistent/shards"], ["data.path"]),
        (["mesh.dp"], ["expected SECTION.KEY=VALUE"]),  # --set without '='
        (["mesh.pp=8"], ["mesh.pp", "model.n_layers"]),
        (["pipeline.schedule=zigzag"], ["pipeline.schedule"]),
        (["mesh.pp=2", "mesh.dp=2", "train.global_batch_size=2", "train.micro_batch_size=1"],
         ["needs at least mesh.pp=2 microbatches"]),  # 1F1B with fewer microbatches than stages
        (["mesh.pp=2", "mesh.dp=1", "pipeline.layers=[1,2]"], ["pipeline.layers", "model.n_layers"]),
        (["pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2"], ["mesh.pp >= 2"]),
        (["mesh.pp=2", "mesh.dp=1", "pipeline.schedule=zbv"], ["pipeline.virtual_stages=2"]),
        (["mesh.pp=2", "mesh.dp=1", "pipeline.schedule=zb-h1", "train.activation_checkpointing=true"],
         ["train.activation_checkpointing"]),
        (["elastic.min_dp=3"], ["elastic.min_dp"]),
        (["elastic.max_dp=1"], ["elastic.max_dp"]),
        (["elastic.step_timeout_s=0"], ["elastic.step_timeout_s"]),
        (["elastic.collective_timeout_s=-1"], ["elastic.collective_timeout_s"]),
        (["elastic.rebuild_timeout_s=0"], ["elastic.rebuild_timeout_s"]),
        (["elastic.grow_check_s=-1"], ["elastic.grow_check_s"]),
        (["elastic.spares=-1"], ["elastic.spares"]),
        (["elastic.straggler_factor=1.0"], ["elastic.straggler_factor"]),
        (["elastic.straggler_steps=0"], ["elastic.straggler_steps"]),
        (["train.max_bad_steps=0"], ["train.max_bad_steps"]),
        (["elastic.rebalance=true", "mesh.dp=1"], ["elastic.rebalance", "needs mesh.dp >= 2"]),
    ],
)
def test_train_rejects_bad_input(overrides, needles):
    args = ["train"]
    for o in overrides:
        args += ["--set", o]
    assert_bad_input(run_cli(*args), *needles)


def test_empty_and_corrupt_data_dirs(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_bad_input(run_cli("train", "--set", f"data.path={empty}"), "data.path")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "shard-00000.parquet").write_bytes(b"not parquet at all")
    assert_bad_input(run_cli("train", "--set", f"data.path={corrupt}"), "data.path")


def test_missing_and_invalid_config_files(tmp_path):
    assert_bad_input(run_cli("train", str(tmp_path / "nope.toml")), "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[mesh\ndp = 2\n")
    assert_bad_input(run_cli("plan", str(bad)), "bad.toml")
    wrong_type = tmp_path / "wrong.toml"
    wrong_type.write_text('[model]\nn_layers = "four"\n')
    assert_bad_input(run_cli("plan", str(wrong_type)), "model.n_layers")


def test_plan_prints_mesh_coords_and_memory():
    proc = run_cli("plan", "--set", "mesh.pp=2", "--set", "mesh.dp=1", "--json")
    assert proc.returncode == 0, proc.stderr
    import json

    info = json.loads(proc.stdout)
    assert info["mesh"] == {"dp": 1, "pp": 2, "tp": 2}
    assert len(info["ranks"]) == 4 and len(info["stages"]) == 2
    for mem in info["memory_per_rank"].values():
        assert mem["params"] > 0 and mem["optimizer"] == 2 * mem["params"] and mem["activations"] > 0


@pytest.mark.parametrize("key", ["metrics.path", "metrics.timeline", "metrics.tensorboard_dir"])
def test_unwritable_metrics_outputs_fail_before_ray_starts(tmp_path, key):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    proc = run_cli("train", "--set", f"{key}={blocker}/out/m")
    assert_bad_input(proc, f"{key}=", str(blocker), f"set {key} to")
    assert "Ray" not in proc.stderr  # refused before any Ray (let alone an actor) started


def test_metrics_path_in_proc_or_on_a_directory(tmp_path):
    assert_bad_input(run_cli("train", "--set", "metrics.path=/proc/nope/m.jsonl"), "metrics.path", "/proc/nope")
    assert_bad_input(run_cli("train", "--set", f"metrics.path={tmp_path}"), "metrics.path", "is a directory")


def test_ckpt_list_and_inspect_of_a_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    assert_bad_input(run_cli("ckpt", "list", str(missing)), str(missing), "checkpoint.dir")
    assert_bad_input(run_cli("ckpt", "inspect", str(missing / "step-00000010")), "step-00000010", "ckpt list")
    a_file = tmp_path / "a-file"
    a_file.write_text("x\n")
    assert_bad_input(run_cli("ckpt", "list", str(a_file)), "not a directory", str(a_file))
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_cli("ckpt", "list", str(empty))  # an existing directory without checkpoints is fine
    assert proc.returncode == 0 and proc.stdout.startswith("STEP"), proc.stderr
