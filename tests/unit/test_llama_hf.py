"""The llama family against transformers (the oracle): logits and step-1 loss on tiny perturbed models.

Each variant is built offline with transformers, its weights perturbed (``testbed/hf_models.py``),
saved with ``save_pretrained``; elastimesh shapes the model from ``config.json`` (``model.from_hf``),
loads the safetensors through DCP's ``HuggingFaceStorageReader`` (``checkpoint.init_from``'s path) and
must give the same logits (fp32, <= 1e-5) — while a wrong mapping is >= 1e-3 off. Qwen3 (q/k norms,
explicit head_dim) and sliding windows (Mistral on every layer, Qwen2/Qwen3 on the layers
``max_window_layers`` or ``layer_types`` name) included: a window one token wider is >= 1e-3 off, which
pins transformers' semantics (a query sees itself and the W - 1 tokens before it).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402

from meshmodels.build import build_local_stage  # noqa: E402
from meshmodels.family import resolve_model  # noqa: E402
from meshmodels.hf_io import load_hf  # noqa: E402
from orchestrator.config.load import load_config  # noqa: E402
from testbed.hf_models import save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's one-process notices

VARIANTS = {
    "gqa-untied": {},
    "tied": {"tie": True},
    "llama3-rope": {"llama3": True},
    "qkv-bias": {"bias": True},
    "legacy-rope-fields": {"llama3": True, "legacy_rope": True},
    "head-dim-32": {"head_dim": 32},
    "qwen2": {"arch": "qwen2", "tie": True},
    "qwen3": {"arch": "qwen3"},
    "qwen3-tied-head-dim-32": {"arch": "qwen3", "tie": True, "head_dim": 32},
    "qwen3-attention-bias": {"arch": "qwen3", "bias": True},
    "mistral-window-5": {"arch": "mistral", "window": 5},
    "qwen2-window-5-from-layer-1": {"arch": "qwen2", "window": 5, "window_from": 1, "layers": 3},
    "qwen3-window-7-layer-types": {"arch": "qwen3", "window": 7, "layer_types": ["sliding_attention", "full_attention"]},
}
WINDOWED = [v for v in VARIANTS if "window-" in v]


def ours(directory: str, seq_len: int = 32):
    cfg = load_config(None, [f"model.from_hf={directory}", f"model.seq_len={seq_len}", "mesh.dp=1", "mesh.tp=1"])
    resolved = resolve_model(cfg.model)
    model = build_local_stage(resolved.family, resolved.shape, range(resolved.shape.n_layers),
                              device=torch.device("cpu"), seed=0, init=False)
    load_hf([model], resolved.family, directory)
    return model.eval(), resolved


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
def test_logits_equal_transformers(tmp_path, variant):
    hf = save_tiny_llama(str(tmp_path), **VARIANTS[variant])
    model, resolved = ours(str(tmp_path))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = model(ids)
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff <= 1e-5, f"{variant}: max |logit difference| {diff}"
    assert expected.abs().max().item() > 1.0  # the perturbed model is far from uniform


def logits_diff(model, hf, seq_len: int = 32) -> float:
    ids = torch.randint(0, 256, (2, seq_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return (model(ids) - hf(input_ids=ids).logits).abs().max().item()


@pytest.mark.parametrize("variant", WINDOWED, ids=WINDOWED)
def test_a_window_one_token_off_is_visibly_wrong(tmp_path, variant):
    hf = save_tiny_llama(str(tmp_path), **VARIANTS[variant])
    model, resolved = ours(str(tmp_path))
    assert resolved.shape.sliding_layers and resolved.shape.sliding_window < 32
    for shift in (1, -1):
        for index in resolved.shape.sliding_layers:
            model.layers[str(index)].attention.window = resolved.shape.sliding_window + shift
            model.layers[str(index)].attention._mask = None
        assert logits_diff(model, hf) >= 1e-3, shift


def test_sequences_no_longer_than_the_window_equal_full_attention(tmp_path):
    """Window 7: at 7 tokens the sliding layer's output is bit-identical to full attention's; at 8 it is
    not — and at both lengths the logits are transformers' (whose window is applied the same way)."""
    hf = save_tiny_llama(str(tmp_path), **VARIANTS["qwen3-window-7-layer-types"])
    model, _ = ours(str(tmp_path))
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        sliding = {n: model(ids[:, :n]) for n in (7, 8)}
        model.layers["0"].attention.window = 0
        full = {n: model(ids[:, :n]) for n in (7, 8)}
        expected = {n: hf(input_ids=ids[:, :n]).logits for n in (7, 8)}
    assert torch.equal(sliding[7], full[7])
    assert (sliding[8] - full[8]).abs().max().item() >= 1e-3
    for n in (7, 8):
        assert (sliding[n] - expected[n]).abs().max().item() <= 1e-5, n


def test_a_wrong_mapping_is_visibly_wrong(tmp_path):
    """The perturbation makes mapping mistakes show: swapping two layers' gate/up moves logits >= 1e-3."""
    save_tiny_llama(str(tmp_path))
    model, _ = ours(str(tmp_path))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        good = model(ids)
        ff = model.layers["0"].feed_forward
        w1 = ff.w1.weight.clone()
        ff.w1.weight.copy_(ff.w3.weight)
        ff.w3.weight.copy_(w1)
        assert (model(ids) - good).abs().max().item() >= 1e-3


def test_shape_and_counts_from_config_json(tmp_path):
    hf = save_tiny_llama(str(tmp_path), tie=True, llama3=True, bias=True)
    _, resolved = ours(str(tmp_path))
    s = resolved.shape
    assert (s.n_layers, s.d_model, s.n_heads, s.n_kv_heads, s.head_dim, s.ffn_dim) == (2, 64, 4, 2, 16, 96)
    assert s.tie_embeddings and s.qkv_bias and s.o_bias and s.rope_llama3 == (8.0, 1.0, 4.0, 16.0)
    assert resolved.family.param_counts(s)["total"] == sum(p.numel() for p in hf.parameters())
    assert set(resolved.family.hf_tensors(s)) == set(hf.state_dict()) - {"lm_head.weight"}


def test_step1_loss_equals_transformers_loss(tmp_path):
    """The reference trainer started from the HF weights: its step-1 loss is transformers' loss on that batch."""
    import meshdata as data_lib
    from workers.reference import ReferenceTrainer

    hf = save_tiny_llama(str(tmp_path), tie=True)
    cfg = load_config(None, [f"model.from_hf={tmp_path}", "model.seq_len=32", "mesh.dp=1", "mesh.tp=1",
                             "train.global_batch_size=4", "train.micro_batch_size=2"])
    trainer = ReferenceTrainer(cfg.model, cfg.train, init_from=str(tmp_path))
    ids = data_lib.global_sample_ids(1, 4, cfg.train.seed, trainer.num_samples)
    x, y = data_lib.microbatch_tokens(trainer.source, ids, 32)
    with torch.no_grad():
        expected = hf(input_ids=torch.from_numpy(x), labels=torch.from_numpy(y),
                      shift_labels=torch.from_numpy(y)).loss.item()
    got = trainer.step(1)
    assert abs(got - expected) <= 1e-5 * abs(expected), (got, expected)


ROUND_TRIPS = ["legacy-rope-fields", "qwen3-tied-head-dim-32", "mistral-window-5", "qwen2-window-5-from-layer-1",
               "qwen3-window-7-layer-types"]


@pytest.mark.parametrize("variant", ROUND_TRIPS, ids=ROUND_TRIPS)
def test_export_config_round_trips(tmp_path, variant):
    """The config an export writes gives the same shape back, and transformers reads from it the
    attention layout (head_dim, rope, which layers slide and how far) of the source model."""
    from transformers import AutoConfig

    hf = save_tiny_llama(str(tmp_path), **VARIANTS[variant])
    _, resolved = ours(str(tmp_path))
    config = resolved.family.hf_config(resolved.shape)
    again = resolved.family.shape_from_hf(config, load_config(None, ["model.seq_len=32"]).model, "x")
    assert {k: v for k, v in vars(again).items() if k != "source_config"} == \
        {k: v for k, v in vars(resolved.shape).items() if k != "source_config"}
    out = tmp_path / "cfg"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    loaded = AutoConfig.from_pretrained(str(out))
    for key in ("architectures", "num_key_value_heads", "rope_parameters", "tie_word_embeddings", "sliding_window",
                "use_sliding_window", "layer_types", "attention_bias"):
        assert getattr(loaded, key, None) == getattr(hf.config, key, None), key
    # Qwen2's config class has no head_dim; its attention reads one when present, else hidden / heads.
    head_dim = [getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads for c in (loaded, hf.config)]
    assert head_dim[0] == head_dim[1]


@pytest.mark.parametrize("variant", ["qwen3-tied-head-dim-32", "qwen3-attention-bias", "qwen2-window-5-from-layer-1"])
def test_tensors_and_counts_match_transformers(tmp_path, variant):
    hf = save_tiny_llama(str(tmp_path), **VARIANTS[variant])
    _, resolved = ours(str(tmp_path))
    theirs = {name: tuple(t.shape) for name, t in hf.state_dict().items()}
    if resolved.shape.tie_embeddings:
        del theirs["lm_head.weight"]
    assert resolved.family.hf_tensors(resolved.shape) == theirs
    assert resolved.family.param_counts(resolved.shape)["total"] == sum(p.numel() for p in hf.parameters())


def test_plan_shows_the_real_parameter_count(tmp_path):
    from orchestrator.plan.mesh_plan import describe, make_plan

    hf = save_tiny_llama(str(tmp_path), tie=True, layers=4)
    cfg = load_config(None, [f"model.from_hf={tmp_path}", "model.seq_len=32", "mesh.pp=2", "mesh.dp=1",
                             "mesh.tp=2"])
    info = describe(cfg, make_plan(cfg))
    assert info["total_params"] == sum(p.numel() for p in hf.parameters())
    assert info["model_family"] == "llama" and info["model_source"] == str(tmp_path)
    # Both ends of the pipeline hold the tied embedding: the stages count one copy each.
    embed = 256 * 64
    assert sum(s["params"] for s in info["stages"]) == info["total_params"] + embed


def test_init_slice_is_the_slice_of_the_full_init():
    from meshmodels.llama import INIT_ROWS, LlamaFamily

    family = LlamaFamily()
    shape = family.shape(load_config(None, ["model.family=llama", "model.vocab_size=700"]).model)
    size = (700, 64)
    full = family.init_tensor(shape, "tok_embeddings.weight", size, 0)
    for rows, cols in [((0, 700), (0, 64)), ((250, 520), (0, 32)), ((INIT_ROWS, INIT_ROWS + 1), (32, 64)),
                       ((699, 700), (0, 64)), ((5, 5), (0, 64))]:
        slices = (slice(*rows), slice(*cols))
        assert torch.equal(family.init_slice(shape, "tok_embeddings.weight", size, 0, slices), full[slices])


# The fields of Qwen3-0.6B's published config.json (transformers 4.x style: legacy rope_theta, no layer_types).
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip


def test_a_real_size_qwen3_config_matches_transformers_meta_model(tmp_path):
    """Qwen3-0.6B's config.json, built by transformers on the meta device: the same tensors and count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    config = AutoConfig.from_pretrained(str(tmp_path))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    resolved = resolve_model(load_config(None, [f"model.from_hf={tmp_path}"]).model)
    s = resolved.shape
    assert (s.rope_theta, s.head_dim, s.tie_embeddings, s.qk_norm, s.sliding_layers) == (1e6, 128, True, True, ())
    theirs = {name: tuple(t.shape) for name, t in hf.state_dict().items() if name != "lm_head.weight"}
    assert resolved.family.hf_tensors(s) == theirs
    assert resolved.family.param_counts(s)["total"] == sum(p.numel() for p in hf.parameters())
