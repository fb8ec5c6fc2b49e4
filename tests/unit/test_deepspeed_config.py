"""DeepSpeed configs read as elastimesh keys (orchestrator/config/deepspeed.py through load_config).

Three configs (testbed/deepspeed_configs.py): a seed-style one and two verbatim from DeepSpeed's
documentation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshspeak.schema import ConfigError
from meshspeak.sections import config_to_dict
from orchestrator.config.load import load_config
from testbed.deepspeed_configs import CIFAR10, GETTING_STARTED, SEED


def load(tmp_path: Path, doc, *overrides: str, toml: str | None = None):
    path = tmp_path / "ds.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    config = None
    if toml is not None:
        config = tmp_path / "job.toml"
        config.write_text(toml)
    warnings: list[str] = []
    cfg = load_config(config, list(overrides), deepspeed=str(path), warn=warnings.append)
    return cfg, warnings


def test_seed_style_config(tmp_path: Path) -> None:
    cfg, warnings = load(tmp_path, SEED, "mesh.tp=1")
    t = cfg.train
    assert (cfg.mesh.zero, cfg.mesh.pp, cfg.mesh.dp) == (3, 2, 2)
    assert (t.micro_batch_size, t.global_batch_size) == (16, 16 * 8 * 2)  # DeepSpeed: micro x accum x dp
    assert (t.grad_clip, t.dtype, t.activation_checkpointing) == (1.0, "bfloat16", True)
    assert (t.lr, t.beta1, t.beta2, t.weight_decay) == (3e-4, 0.9, 0.95, 0.1)
    assert (t.steps, t.warmup_steps, t.lr_decay, t.min_lr_ratio) == (1000, 100, "cosine", 0.1)
    named = sorted(w.split(": ")[1].split(" ")[0] for w in warnings)
    assert named == ["zero_optimization.contiguous_gradients", "zero_optimization.overlap_comm",
                     "zero_optimization.stage3_prefetch_bucket_size"], warnings
    assert all("\n" not in w and "has no counterpart" in w for w in warnings)


def test_getting_started_config_from_deepspeeds_docs(tmp_path: Path) -> None:
    cfg, warnings = load(tmp_path, GETTING_STARTED, "mesh.tp=1")
    t = cfg.train
    # train_batch_size 8 and accumulation 1 over dp=2: micro = 8 // 2 // 1 (DeepSpeed's rule).
    assert (t.global_batch_size, t.micro_batch_size) == (8, 4)
    assert cfg.mesh.zero == 1  # "zero_optimization": true is DeepSpeed's legacy stage 1
    assert (t.dtype, t.lr, t.loss_scale_initial, t.loss_scale_window) == ("float16", 0.00015, 2.0**16, 1000)
    assert warnings == []


def test_cifar10_config_from_deepspeeds_docs(tmp_path: Path) -> None:
    cfg, warnings = load(tmp_path, CIFAR10, "mesh.tp=1")
    t = cfg.train
    assert (t.global_batch_size, t.micro_batch_size) == (4, 2)
    assert (t.lr, t.beta1, t.beta2, t.weight_decay) == (0.001, 0.8, 0.999, 3e-7)
    assert (t.warmup_steps, t.min_lr_ratio) == (1000, 1.0)  # WarmupLR: constant after warm-up
    assert cfg.metrics.log_every == 2000
    assert [w.split(": ")[1].split(" ")[0] for w in warnings] == ["scheduler.params.warmup_type=log",
                                                                 "wall_clock_breakdown"], warnings


def test_batch_triangle_and_auto(tmp_path: Path) -> None:
    cfg, _ = load(tmp_path, {"train_batch_size": 32, "gradient_accumulation_steps": 2}, "mesh.tp=1")
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (32, 8)  # 32 // 2 // 2
    cfg, _ = load(tmp_path, {"train_micro_batch_size_per_gpu": 2}, "mesh.dp=4", "mesh.tp=1")
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (8, 2)  # accumulation 1
    # "auto" (as the Hugging Face integration writes it): the field is ours, here the TOML's.
    auto = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
    cfg, warnings = load(tmp_path, auto, toml="[train]\nglobal_batch_size = 16\nmicro_batch_size = 4\nlr = 0.002\n")
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.lr) == (16, 4, 0.002)
    assert warnings == []
    # In a pydantic section "auto" is DeepSpeed's default: stage 0.
    cfg, _ = load(tmp_path, {"train_batch_size": 8, "zero_optimization": {"stage": "auto"}})
    assert cfg.mesh.zero == 0


def test_schedulers_and_offload(tmp_path: Path) -> None:
    decay = {"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 50, "warmup_max_lr": 0.002, "warmup_num_steps": 5, "warmup_type": "linear"}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    cfg, warnings = load(tmp_path, decay)
    t = cfg.train
    assert (t.steps, t.lr, t.warmup_steps, t.lr_decay, t.min_lr_ratio) == (50, 0.002, 5, "linear", 0.0)
    assert cfg.mesh.cpu_offload and warnings == []
    from meshspeak.lr_schedule import lr_at

    assert lr_at(5, t) == pytest.approx(0.002) and lr_at(50, t) == pytest.approx(0.0)
    assert lr_at(27, t) == pytest.approx(0.002 * (1 - 22 / 45))  # linear between them


def test_contradictions_and_wrong_types_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"optimizer.params.lr gives train.lr=0.0003 but the TOML or --set says "
                                          r"train.lr=0.001"):
        load(tmp_path, SEED, "mesh.tp=1", "train.lr=1e-3")
    with pytest.raises(ConfigError, match="mesh.pp"):
        load(tmp_path, SEED, toml="[mesh]\npp = 4\ntp = 1\n")
    cases = [({"train_batch_size": "32"}, "train_batch_size: expected an integer"),
             ({"gradient_clipping": [1]}, "gradient_clipping: expected a number"),
             ({"train_batch_size": 8, "bf16": {"enabled": "yes"}}, "bf16.enabled: expected true or false"),
             ({"train_batch_size": 8, "zero_optimization": {"stage": 5}}, "zero_optimization.stage=5"),
             ({"train_batch_size": 8, "optimizer": {"type": "Lamb"}}, "optimizer.type='Lamb'"),
             ({"train_batch_size": 8, "scheduler": {"type": "OneCycle"}}, "scheduler.type='OneCycle'"),
             ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
              "train_batch_size=10 != train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=2")]
    for doc, needle in cases:
        with pytest.raises(ConfigError) as err:
            load(tmp_path, doc)
        assert needle in err.value.message and "\n" not in err.value.message, err.value.message
    (tmp_path / "dup.json").write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ConfigError, match="duplicate key 'train_batch_size'"):
        load_config(None, [], deepspeed=str(tmp_path / "dup.json"))


def test_printed_toml_loads_to_the_same_config(tmp_path: Path) -> None:
    from meshspeak.schema import dump_toml

    cfg, _ = load(tmp_path, SEED, "mesh.tp=1")
    (tmp_path / "same.toml").write_text(dump_toml(config_to_dict(cfg)))
    assert load_config(tmp_path / "same.toml") == cfg


@pytest.mark.parametrize("command", ["train", "plan", "config"])
@pytest.mark.parametrize("doc,needle", [
    ('{"train_batch_size": "32"}', "ds.json: train_batch_size: expected an integer"),
    ('{"train_batch_size": 8, "fp16": {"enabled": "yes"}}', "ds.json: fp16.enabled: expected true or false"),
    ('{"train_batch_size": 8,', "ds.json: invalid DeepSpeed JSON"),
    (None, "no such DeepSpeed config file"),
])
def test_cli_deepspeed_bad_input_is_one_line_exit_2(command, doc, needle, capsys, tmp_path, monkeypatch):
    from orchestrator import cli

    monkeypatch.chdir(tmp_path)
    if doc is not None:
        (tmp_path / "ds.json").write_text(doc)
    metrics = tmp_path / "m.jsonl"
    assert cli.main([command, "--deepspeed", "ds.json", "--set", f"metrics.path={metrics}"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("elastimesh: error:") and needle in lines[0], lines
    assert not metrics.exists()  # refused before anything started
