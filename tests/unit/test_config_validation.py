"""Config validation: sizes, enums, divisibility, pipeline and elastic rules; each error names its key."""

from __future__ import annotations

import pytest

from meshspeak.sections import dp_bounds, microbatches_per_replica
from orchestrator.config.load import load_config
from testbed.config_errors import error_for

# --- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "mesh.dp", "mesh.pp", "mesh.tp", "model.n_layers", "model.d_model", "model.n_heads",
        "model.vocab_size", "model.seq_len", "train.steps", "train.global_batch_size",
        "train.micro_batch_size", "pipeline.virtual_stages", "checkpoint.keep",
    ],
)  # fmt: skip
@pytest.mark.parametrize("value", [0, -1])
def test_sizes_must_be_positive(key: str, value: int) -> None:
    err = error_for(f"{key}={value}")
    assert err.key == key and f"{key} must be >= 1" in str(err)


@pytest.mark.parametrize(
    "key",
    [
        "train.warmup_steps", "checkpoint.every", "elastic.max_restarts", "train.weight_decay",
        "train.grad_clip", "model.ffn_hidden", "elastic.max_dp", "mesh.fsdp_unit_mb",
    ],
)  # fmt: skip
def test_counts_must_be_non_negative(key: str) -> None:
    load_config(None, [f"{key}=0"])
    err = error_for(f"{key}=-1")
    assert err.key == key and f"{key} must be >= 0" in str(err)


@pytest.mark.parametrize(
    "key",
    [
        "train.lr", "elastic.collective_timeout_s", "elastic.step_timeout_s",
        "elastic.rebuild_timeout_s", "elastic.grow_check_s", "resources.placement_timeout_s",
        "resources.cpus_per_worker", "model.norm_eps",
    ],
)  # fmt: skip
@pytest.mark.parametrize("value", ["0", "-1.5"])
def test_must_be_positive(key: str, value: str) -> None:
    err = error_for(f"{key}={value}")
    assert err.key == key and f"{key} must be > 0" in str(err)


@pytest.mark.parametrize(
    ("overrides", "key", "fragments"),
    [
        (["mesh.zero=4"], "mesh.zero", ["mesh.zero=4 is not allowed", "0, 1, 2, 3"]),
        (["mesh.dp=4", "mesh.dp_replicate=3"], "mesh.dp_replicate", ["must divide mesh.dp=4"]),
        (["mesh.zero=0", "mesh.dp_replicate=2"], "mesh.dp_replicate", ["needs mesh.zero >= 1"]),
        (['train.grad_reduce="float16"'], "train.grad_reduce", ["float32", "bfloat16"]),
        (["train.dtype=float8"], "train.dtype", ['"float32", "bfloat16", "float16"']),
        (["mesh.cpu_offload=true", "mesh.zero=2"], "mesh.cpu_offload", ["needs mesh.zero=3"]),
        (["pipeline.schedule=zb"], "pipeline.schedule", ['"1f1b", "gpipe", "interleaved_1f1b"']),
        (["resources.use_gpu=yes"], "resources.use_gpu", ['true, false, "auto"']),
        (['resources.use_gpu="true"'], "resources.use_gpu", ['"true" is not allowed']),
        (["train.beta2=1"], "train.beta2", ["[0, 1)"]),
        (["train.min_lr_ratio=2"], "train.min_lr_ratio", ["[0, 1]"]),
        # Gradient compression and 1-bit Adam (workers/compression.py): every combination that cannot run.
        (['train.grad_compression="powersgd"', "mesh.zero=2"], "train.grad_compression", ["needs mesh.zero=0"]),
        (['train.grad_compression="int2"'], "train.grad_compression", ['"int8", "int4"']),
        (['train.grad_compression="int4"', "mesh.dp=4", "mesh.dp_replicate=2"], "train.grad_compression",
         ["mesh.dp_replicate=2", "mesh.dp_replicate=1"]),
        (['train.grad_compression="int4"', "train.quant_block=65"], "train.quant_block", ["odd", "66"]),
        (["train.quant_block=1"], "train.quant_block", [">= 2"]),
        (['train.grad_compression="int4"', "train.powersgd_rank=4"], "train.powersgd_rank",
         ["PowerSGD's", "int4 and PowerSGD do not combine"]),
        (['train.grad_compression="int8"', "train.powersgd_plain_steps=10"], "train.powersgd_plain_steps",
         ['train.grad_compression="powersgd"']),
        (['train.optimizer="lamb"'], "train.optimizer", ['"adamw", "onebit_adam"']),
        (['train.optimizer="onebit_adam"', "train.onebit_warmup_steps=5"], "train.optimizer",
         ["needs mesh.zero=0", "got mesh.zero=3"]),
        (['train.optimizer="onebit_adam"', "mesh.zero=0", "train.onebit_warmup_steps=5",
          'train.grad_compression="int8"'], "train.grad_compression", ['grad_compression="none"']),
        (['train.optimizer="onebit_adam"', "mesh.zero=0", "train.onebit_warmup_steps=0"],
         "train.onebit_warmup_steps", [">= 1"]),
        (['train.optimizer="onebit_adam"', "mesh.zero=0"], "train.onebit_warmup_steps",
         ["onebit_warmup_steps=100 >= train.steps=20", "never compress"]),
    ],
)
def test_enums_and_ranges(overrides: list[str], key: str, fragments: list[str]) -> None:
    err = error_for(*overrides)
    assert err.key == key
    for fragment in fragments:
        assert fragment in str(err)


def test_n_heads_not_divisible_by_tp() -> None:
    err = error_for("model.n_heads=6", "model.d_model=96", "mesh.tp=4", "mesh.dp=1")
    assert err.key == "model.n_heads"
    assert str(err) == (
        "model.n_heads=6 is not divisible by mesh.tp=4: choose n_heads as a multiple of tp "
        "(e.g. 8) or a tp that divides 6"
    )


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model.vocab_size=257"], "model.vocab_size"),
        (["model.seq_len=63"], "model.seq_len"),
        (["model.ffn_hidden=255"], "model.ffn_hidden"),
    ],
)
def test_tp_divisibility(overrides: list[str], key: str) -> None:
    err = error_for(*overrides)
    assert err.key == key and "not divisible by mesh.tp=2" in str(err) and "multiple of" in str(err)


def test_d_model_heads() -> None:
    err = error_for("model.d_model=66")
    assert err.key == "model.d_model" and "not divisible by model.n_heads=4" in str(err)
    err = error_for("model.d_model=12")  # head_dim 3
    assert err.key == "model.d_model" and "even head_dim" in str(err)


def test_builtin_data_needs_byte_vocab() -> None:
    err = error_for("model.vocab_size=128")
    assert err.key == "model.vocab_size" and "model.vocab_size >= 256" in str(err)
    assert load_config(None, ["model.vocab_size=128", "data.path=/shards"]).model.vocab_size == 128


def test_pp_exceeds_layers() -> None:
    err = error_for("mesh.pp=8", "mesh.dp=1", "mesh.tp=1", "train.global_batch_size=16")
    assert err.key == "mesh.pp"
    expected = "mesh.pp=8 exceeds model.n_layers=4: every pipeline stage needs at least one layer"
    assert expected in str(err)
    err = error_for(
        "mesh.pp=4", "mesh.dp=1", "mesh.tp=1", "train.global_batch_size=16",
        "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2",
    )  # fmt: skip
    assert err.key == "mesh.pp" and "pipeline.virtual_stages=2 = 8 stages exceeds" in str(err)


def test_batch_not_divisible() -> None:
    err = error_for("train.global_batch_size=10")
    assert err.key == "train.global_batch_size"
    assert "not divisible by mesh.dp x train.micro_batch_size = 2 x 2 = 4" in str(err)
    assert "(e.g. 12)" in str(err)


def test_too_few_microbatches_for_1f1b() -> None:
    err = error_for("mesh.pp=4", "mesh.tp=1")  # 8 / (2*2) = 2 microbatches < 4 stages
    assert err.key == "train.global_batch_size"
    assert "at least mesh.pp=4 microbatches per replica, got 2" in str(err)
    assert "raise train.global_batch_size to 16 or lower train.micro_batch_size" in str(err)
    # GPipe has no such requirement: only a larger bubble.
    assert load_config(None, ["mesh.pp=4", "mesh.tp=1", "pipeline.schedule=gpipe"]).mesh.pp == 4


def test_interleaved_rules() -> None:
    base = ["mesh.pp=2", "mesh.dp=1", "mesh.tp=1", "model.n_layers=8"]
    err = error_for(*base, "pipeline.schedule=interleaved_1f1b")
    assert err.key == "pipeline.virtual_stages" and "virtual_stages >= 2" in str(err)
    err = error_for(*base, "pipeline.virtual_stages=2")
    assert err.key == "pipeline.virtual_stages" and "interleaved_1f1b" in str(err)
    err = error_for(
        *base, "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2",
        "train.global_batch_size=6",
    )  # fmt: skip  # 3 microbatches, pp=2
    assert err.key == "train.global_batch_size" and "multiple of mesh.pp=2" in str(err)
    ok = load_config(
        None, [*base, "pipeline.schedule=interleaved_1f1b", "pipeline.virtual_stages=2"]
    )
    assert microbatches_per_replica(ok.train, ok.mesh.dp) == 4


def test_zero_bubble_rules(tmp_path) -> None:
    base = ["mesh.pp=2", "mesh.dp=1", "mesh.tp=1", "model.n_layers=4", "train.global_batch_size=8",
            "train.micro_batch_size=1"]  # fmt: skip
    err = error_for(*base, "pipeline.schedule=zbv")  # not set for the user: it sizes pipeline.layers
    assert err.key == "pipeline.virtual_stages" and "set pipeline.virtual_stages=2" in str(err)
    err = error_for(*base, "pipeline.schedule=zb-h1", "pipeline.virtual_stages=2")
    assert err.key == "pipeline.virtual_stages"
    err = error_for(*base, "pipeline.schedule=zb-h1", "mesh.pp=1")
    assert err.key == "pipeline.schedule" and "needs mesh.pp >= 2" in str(err)
    err = error_for(*base, "pipeline.schedule=zb-h1", "train.global_batch_size=1")
    assert err.key == "train.global_batch_size" and "at least mesh.pp=2 microbatches" in str(err)
    for name, v in (("zb-h1", 1), ("zbv", 2)):
        sched = (f"pipeline.schedule={name}", f"pipeline.virtual_stages={v}")
        err = error_for(*base, *sched, "train.activation_checkpointing=true")
        assert err.key == "train.activation_checkpointing" and "recompute" in str(err)
        err = error_for(*base, *sched, "train.compile=true")
        assert err.key == "train.compile"
        assert load_config(None, [*base, *sched]).pipeline.schedule == name
    # Tied embeddings (a Llama config.json with tie_word_embeddings): fine on zb-h1, not in zbv's V.
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, '
        '"num_hidden_layers": 4, "intermediate_size": 128, "vocab_size": 256, "rms_norm_eps": 1e-5, '
        '"tie_word_embeddings": true}')
    tied = [f"model.from_hf={tmp_path}", "model.seq_len=32", *[o for o in base if "n_layers" not in o]]
    assert load_config(None, [*tied, "pipeline.schedule=zb-h1"]).pipeline.schedule == "zb-h1"
    err = error_for(*tied, "pipeline.schedule=zbv", "pipeline.virtual_stages=2")
    assert err.key == "pipeline.schedule" and "tok_embeddings.weight" in str(err) and "zb-h1" in str(err)


def test_pipeline_layers_rules() -> None:
    base = ["mesh.pp=2", "mesh.dp=1"]
    err = error_for(*base, "pipeline.layers=[4]")
    assert err.key == "pipeline.layers" and "has 1 entries but" in str(err)
    err = error_for(*base, "pipeline.layers=[2,3]")
    assert err.key == "pipeline.layers" and "sums to 5 but model.n_layers=4" in str(err)
    err = error_for(*base, "pipeline.layers=[0,4]")
    assert err.key == "pipeline.layers" and "pipeline.layers[0]=0" in str(err)


def test_rebalance_needs_two_replicas() -> None:
    err = error_for("elastic.rebalance=true", "mesh.dp=1")
    assert err.key == "elastic.rebalance" and "needs mesh.dp >= 2" in str(err) and "got mesh.dp=1" in str(err)
    assert load_config(None, ["elastic.rebalance=true", "mesh.dp=2"]).elastic.rebalance


def test_elastic_bounds() -> None:
    err = error_for("elastic.min_dp=3")
    assert err.key == "elastic.min_dp"
    assert str(err).startswith("elastic.min_dp=3 > mesh.dp=2: lower elastic.min_dp to at most 2")
    err = error_for("elastic.min_dp=0")
    assert err.key == "elastic.min_dp"
    err = error_for("elastic.max_dp=1")
    assert err.key == "elastic.max_dp" and "raise elastic.max_dp to at least 2" in str(err)
    cfg = load_config(None, ["elastic.max_dp=4"])
    assert dp_bounds(cfg.mesh, cfg.elastic) == (1, 4)


def test_step_timeout_message() -> None:
    err = error_for("elastic.step_timeout_s=0")
    assert str(err).startswith("elastic.step_timeout_s must be > 0")


@pytest.mark.parametrize("overrides", [
    ['train.grad_compression="int8"', "mesh.zero=3"],
    ['train.grad_compression="int4"', "mesh.zero=0", "mesh.tp=1"],
    ['train.grad_compression="int8"', "mesh.zero=1", "train.quant_block=65"],
    ['train.grad_compression="none"', "train.powersgd_rank=4"],  # a PowerSGD knob with no compression: unused
    ['train.optimizer="onebit_adam"', "mesh.zero=0", "train.onebit_warmup_steps=4"],
])
def test_compression_combinations_that_run(overrides: list[str]) -> None:
    load_config(None, overrides)
