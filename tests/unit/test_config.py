"""Config loading, overrides and validation: every error names its key and the fix."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from meshspeak.schema import ConfigError
from meshspeak.sections import (
    ALL_KEYS,
    SECTIONS,
    JobConfig,
    config_to_dict,
    dp_bounds,
    microbatches_per_replica,
    replace_mesh,
)
from orchestrator.config.fingerprint import model_diff, model_fingerprint
from orchestrator.config.load import load_config
from orchestrator.config.validate import check_mesh
from testbed.config_errors import error_for


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def dump_toml(d: dict[str, dict[str, object]]) -> str:
    lines = []
    for section, table in d.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


# --- defaults, schema, round trip ----------------------------------------------------------


def test_defaults_are_the_tiny_job() -> None:
    cfg = load_config(None)
    assert cfg == JobConfig()
    assert (cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.tp, cfg.mesh.world) == (2, 1, 2, 4)
    assert cfg.model.ffn_dim == 256 and cfg.model.head_dim == 16
    assert microbatches_per_replica(cfg.train, cfg.mesh.dp) == 2
    assert dp_bounds(cfg.mesh, cfg.elastic) == (1, 2)
    assert cfg.resources.use_gpu == "auto"


def test_all_keys_and_aliases() -> None:
    # + train.lr_decay, loss_scale_*, metrics.mlflow_*, wandb_* (#28); train.quant_block, optimizer,
    # onebit_warmup_steps, elastic.rebalance (#27); elastic.hang_probe_factor (#25); data.mix, eval.mix (#39);
    # checkpoint.lease_s, train.loss_scale_min, checkpoint.memory_keep (#36); checkpoint.when_busy (#37)
    assert len(ALL_KEYS) == len(set(ALL_KEYS)) == 92
    assert "checkpoint.async" in ALL_KEYS and "checkpoint.async_write" not in ALL_KEYS
    assert list(SECTIONS) == [f.name for f in dataclasses.fields(JobConfig)]
    assert {k.split(".")[0] for k in ALL_KEYS} == set(SECTIONS)
    checkpoint_keys = list(config_to_dict(JobConfig())["checkpoint"])
    assert checkpoint_keys == ["dir", "every", "async", "when_busy", "keep", "resume", "init_from", "memory_every",
                               "memory_keep", "lease_s"]


def test_every_section_is_frozen_and_pickles() -> None:
    cfg = load_config(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.mesh.dp = 3  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_toml_round_trip(tmp_path: Path) -> None:
    text = """
[mesh]
dp = 1
pp = 2
tp = 1
zero = 2
[model]
n_layers = 6
vocab_size = 512
rope_theta = 500000
[train]
global_batch_size = 8
micro_batch_size = 1
lr = 1e-3
dtype = "bfloat16"
activation_checkpointing = true
[pipeline]
schedule = "interleaved_1f1b"
virtual_stages = 2
layers = [1, 2, 1, 2]
[data]
path = "/data/shards"
"""
    cfg = load_config(write(tmp_path, text))
    assert cfg.mesh.zero == 2 and cfg.model.n_layers == 6 and cfg.model.vocab_size == 512
    assert cfg.model.rope_theta == 500000.0 and isinstance(cfg.model.rope_theta, float)
    assert cfg.pipeline.layers == (1, 2, 1, 2)
    assert cfg.train.activation_checkpointing and cfg.train.dtype == "bfloat16"
    d = config_to_dict(cfg)
    assert d["pipeline"]["layers"] == [1, 2, 1, 2]
    again = load_config(write(tmp_path, dump_toml(d)))
    assert again == cfg
    assert model_fingerprint(again) == model_fingerprint(cfg)


def test_default_dict_round_trip_drops_none(tmp_path: Path) -> None:
    d = config_to_dict(JobConfig())
    assert "layers" not in d["pipeline"]  # TOML has no null
    assert load_config(write(tmp_path, dump_toml(d))) == JobConfig()


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == JobConfig()


# --- overrides -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "section", "attr", "expected"),
    [
        ("mesh.dp=1", "mesh", "dp", 1),
        ("train.lr=1e-3", "train", "lr", 1e-3),
        ("train.lr=1", "train", "lr", 1.0),
        ("data.path=/x", "data", "path", "/x"),
        ('data.path="/quoted path"', "data", "path", "/quoted path"),
        ("data.path=2024", "data", "path", "2024"),
        ("train.dtype=bfloat16", "train", "dtype", "bfloat16"),
        ("train.activation_checkpointing=true", "train", "activation_checkpointing", True),
        ("checkpoint.async=false", "checkpoint", "async_write", False),
        ("resources.use_gpu=false", "resources", "use_gpu", False),
        ("resources.use_gpu=auto", "resources", "use_gpu", "auto"),
        ("pipeline.layers=[4]", "pipeline", "layers", (4,)),
        ("pipeline.layers=[]", "pipeline", "layers", None),
        (" elastic.step_timeout_s = 30 ", "elastic", "step_timeout_s", 30.0),
    ],
)
def test_override_types(override: str, section: str, attr: str, expected: object) -> None:
    value = getattr(getattr(load_config(None, [override]), section), attr)
    assert value == expected and type(value) is type(expected)


def test_override_beats_file_and_last_wins(tmp_path: Path) -> None:
    path = write(tmp_path, "[train]\nsteps = 5\nseed = 7\n")
    cfg = load_config(path, ["train.steps=9", "train.steps=11"])
    assert (cfg.train.steps, cfg.train.seed) == (11, 7)


def test_pipeline_layers_override() -> None:
    cfg = load_config(None, ["mesh.pp=2", "mesh.dp=1", "pipeline.layers=[1,3]"])
    assert cfg.pipeline.layers == (1, 3)


def test_set_without_equals() -> None:
    err = error_for("mesh.dp")
    assert err.key == "mesh.dp"
    assert "--set 'mesh.dp': expected SECTION.KEY=VALUE" in str(err)


def test_set_without_section_suggests_one() -> None:
    err = error_for("dp=3")
    assert err.key == "dp" and "SECTION.KEY=VALUE" in str(err) and "'mesh.dp=3'" in str(err)


# --- files, sections, keys -----------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.toml")
    err = error_for(path=path)
    assert err.key == path and "no such config file" in str(err) and "omit it" in str(err)


def test_directory_is_unreadable(tmp_path: Path) -> None:
    err = error_for(path=str(tmp_path))
    assert err.key == str(tmp_path) and "cannot read config file" in str(err)


def test_invalid_toml_names_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[mesh]\ndp = 2\ntp = \n")
    err = error_for(path=path)
    assert str(err).startswith(f"{path}: invalid TOML at line 3: ")


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_bytes(b"[data]\npath = '\xff'\n")
    assert "not UTF-8" in str(error_for(path=str(path)))


def test_unknown_section(tmp_path: Path) -> None:
    err = error_for(path=write(tmp_path, "[modle]\nn_layers = 2\n"))
    assert err.key == "modle" and "unknown section '[modle]': did you mean '[model]'?" in str(err)
    err = error_for("modle.n_layers=2")
    assert "did you mean '[model]'?" in str(err)


def test_section_must_be_a_table(tmp_path: Path) -> None:
    err = error_for(path=write(tmp_path, "mesh = 2\n"))
    assert err.key == "mesh" and "must be a table" in str(err)


def test_unknown_key_suggests_closest(tmp_path: Path) -> None:
    err = error_for("model.n_layer=2")
    assert err.key == "model.n_layer"
    assert "unknown key 'model.n_layer': did you mean 'model.n_layers'?" in str(err)
    err = error_for(path=write(tmp_path, "[train]\nlearning_rate = 1\n"))
    assert err.key == "train.learning_rate" and "unknown key 'train.learning_rate'" in str(err)
    # A real key under the wrong section points at its home.
    assert "did you mean 'mesh.pp'?" in str(error_for("train.pp=2"))
    assert "keys are path" in str(error_for("data.zzzzzz=1"))


def test_async_field_name_is_not_a_toml_key() -> None:
    assert "did you mean 'checkpoint.async'?" in str(error_for("checkpoint.async_write=false"))


# --- types ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("train.lr=abc", "train.lr", "train.lr: expected a number, got 'abc' (str)"),
        ("train.lr=true", "train.lr", "expected a number, got True (bool)"),
        ("mesh.dp=two", "mesh.dp", "mesh.dp: expected an integer, got 'two' (str)"),
        ("mesh.dp=true", "mesh.dp", "mesh.dp: expected an integer, got True (bool)"),
        ("mesh.dp=[1,2]", "mesh.dp", "mesh.dp: expected an integer, got [1, 2] (list)"),
        ("mesh.dp=2.0", "mesh.dp", "expected an integer, got 2.0 (float)"),
        ("train.activation_checkpointing=1", "train.activation_checkpointing", "true or false"),
        ("resources.use_gpu=1", "resources.use_gpu", 'expected true, false or "auto"'),
        ("pipeline.layers=1,3", "pipeline.layers", "expected a list of integers, got '1,3' (str)"),
        ("pipeline.layers=[1,true]", "pipeline.layers", "expected a list of integers"),
        ("elastic.step_timeout_s=inf", "elastic.step_timeout_s", "expected a finite number"),
        ("train.lr=nan", "train.lr", "expected a finite number"),
    ],
)
def test_wrong_types(override: str, key: str, expected: str) -> None:
    err = error_for(override)
    assert err.key == key and expected in str(err)


def test_wrong_type_in_file_names_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[mesh]\ntp = "2"\n')
    err = error_for(path=path)
    assert err.key == "mesh.tp" and "mesh.tp: expected an integer, got '2' (str)" in str(err)


# --- reusable pieces -----------------------------------------------------------------------


def test_check_mesh_for_candidate_meshes() -> None:
    cfg = load_config(None)
    check_mesh(cfg, 1, 1, 2)
    check_mesh(cfg, 4, 1, 1)
    with pytest.raises(ConfigError) as info:
        check_mesh(cfg, 3, 1, 2)  # 8 samples over 3 replicas x 2
    assert info.value.key == "train.global_batch_size"
    with pytest.raises(ConfigError) as info:
        check_mesh(cfg, 0, 1, 2)
    assert info.value.key == "mesh.dp"
    with pytest.raises(ConfigError) as info:
        check_mesh(cfg, 1, 1, 8)
    assert info.value.key == "model.n_heads"


def test_replace_mesh() -> None:
    cfg = load_config(None)
    smaller = replace_mesh(cfg, dp=1)
    assert smaller.mesh.dp == 1 and smaller.mesh.tp == 2 and cfg.mesh.dp == 2
    assert smaller.model is cfg.model
    assert model_fingerprint(smaller) == model_fingerprint(cfg)


def test_fingerprint_and_diff() -> None:
    a = load_config(None)
    b = load_config(None, ["model.n_layers=2", "train.lr=1e-2"])
    c = load_config(None, ["data.path=/shards"])
    assert len(model_fingerprint(a)) == 64
    # Only the model matters: training knobs do not, nor data.path (the data is checked by content).
    same_model = load_config(None, ["train.lr=1e-2", "mesh.dp=1"])
    assert model_fingerprint(same_model) == model_fingerprint(a) == model_fingerprint(c)
    assert model_fingerprint(b) != model_fingerprint(a)
    da, db = config_to_dict(a), config_to_dict(b)
    assert model_diff(da, db) == ["model.n_layers"]
    assert model_diff(da, da) == []
    assert model_diff(da, config_to_dict(c)) == []
    partial_model = {k: v for k, v in da["model"].items() if k != "seq_len"}
    partial = {"model": partial_model, "data": da["data"]}
    assert model_diff(da, partial) == ["model.seq_len"]


def test_config_error_pickles() -> None:
    err = ConfigError("model.n_heads", "model.n_heads=6 is not divisible by mesh.tp=4: fix it")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ConfigError and isinstance(back, ValueError)
    assert (back.key, str(back), back.message) == (err.key, str(err), err.message)
