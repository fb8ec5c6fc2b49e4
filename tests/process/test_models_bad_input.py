"""Bad model input through the real CLI: exit 2, one line naming the field / tensor / file and the fix.

Config-level problems (architecture, a sliding window on an architecture without one, rope type, a
Qwen3 field we cannot train, missing config.json, a [model] size key beside model.from_hf, tp not
dividing the KV heads) fail while loading the config; weight
problems (missing tensor, shape mismatch, stray safetensors) fail in the driver's check of
``checkpoint.init_from`` before Ray starts. None of them may leave a traceback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from testbed.command_line import assert_bad_input, run_cli

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from testbed.hf_models import save_tiny_llama

    directory = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(str(directory))
    return directory


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    from testbed.hf_models import save_tiny_llama

    directory = tmp_path_factory.mktemp("tiny-qwen3")
    save_tiny_llama(str(directory), arch="qwen3")
    return directory


def copy_with_config(tiny: Path, dest: Path, **changes) -> Path:
    shutil.copytree(tiny, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(changes)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def train(*overrides: str):
    args = ["train"]
    for o in overrides:
        args += ["--set", o]
    return run_cli(*args)


@pytest.mark.parametrize(
    ("changes", "needles"),
    [
        ({"architectures": ["MixtralForCausalLM"]}, ["architectures", "MixtralForCausalLM", "model.from_hf"]),
        ({"sliding_window": 4096}, ["sliding_window", "4096"]),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
         ["rope_parameters", "yarn"]),
        ({"num_local_experts": 8}, ["num_local_experts", "mixture of experts"]),
    ],
    ids=["architecture", "sliding-window", "rope-yarn", "moe"],
)
def test_unsupported_config_json(tiny, tmp_path, changes, needles):
    bad = copy_with_config(tiny, tmp_path / "bad", **changes)
    assert_bad_input(train(f"model.from_hf={bad}"), *needles)


@pytest.mark.parametrize(
    ("changes", "needles"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                              "original_max_position_embeddings": 32768}}, ["rope_parameters", "yarn"]),
        ({"layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": False},
         ["layer_types", "no window", "use_sliding_window"]),
    ],
    ids=["rope-yarn", "sliding-layers-without-window"],
)
def test_qwen3_field_we_cannot_train(tiny_qwen3, tmp_path, changes, needles):
    bad = copy_with_config(tiny_qwen3, tmp_path / "bad", **changes)
    assert_bad_input(train(f"model.from_hf={bad}"), "model.from_hf", *needles)


def test_missing_config_json(tmp_path):
    assert_bad_input(train(f"model.from_hf={tmp_path}"), "model.from_hf", "config.json not found")


def test_size_key_beside_from_hf(tiny):
    assert_bad_input(train(f"model.from_hf={tiny}", "model.n_layers=8"), "model.n_layers", "model.from_hf")


def test_tp_must_divide_the_kv_heads(tiny):
    assert_bad_input(train(f"model.from_hf={tiny}", "mesh.dp=1", "mesh.tp=4", "model.seq_len=32"),
                     "mesh.tp=4", "num_key_value_heads = 2")


def test_missing_tensor(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = copy_with_config(tiny, tmp_path / "bad")
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    assert_bad_input(train(f"model.from_hf={bad}", f"checkpoint.init_from={bad}"),
                     "checkpoint.init_from", "model.layers.1.mlp.up_proj.weight", "missing")


def test_shape_mismatch(tiny, tmp_path):
    from testbed.hf_models import save_tiny_llama

    other = tmp_path / "wider"
    save_tiny_llama(str(other), inter=128)
    assert_bad_input(train(f"model.from_hf={tiny}", f"checkpoint.init_from={other}"),
                     "checkpoint.init_from", "model.layers.0.mlp.gate_proj.weight", "[128, 64]", "[96, 64]")


def test_stray_safetensors_file(tiny, tmp_path):
    from testbed.hf_models import save_tiny_llama

    sharded = tmp_path / "sharded"
    save_tiny_llama(str(sharded), max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    first = sorted(sharded.glob("*.safetensors"))[0]
    shutil.copy(first, sharded / "model-old-copy.safetensors")
    assert_bad_input(train(f"model.from_hf={sharded}", f"checkpoint.init_from={sharded}"),
                     "stray file", "model-old-copy.safetensors")
    # Without an index, a second file is refused too, naming both.
    single = copy_with_config(tiny, tmp_path / "single")
    shutil.copy(single / "model.safetensors", single / "copy.safetensors")
    assert_bad_input(train(f"model.from_hf={single}", f"checkpoint.init_from={single}"),
                     "copy.safetensors", "model.safetensors.index.json")


def test_init_from_needs_a_family_with_an_hf_map(tiny):
    assert_bad_input(train(f"checkpoint.init_from={tiny}"), "checkpoint.init_from", "no Hugging Face name map")


def test_bad_family_through_the_cli_exits_2():
    assert_bad_input(run_cli("plan", "--set", "model.family=no_such_package.fam:Family"),
                     "model.family", "cannot import")
