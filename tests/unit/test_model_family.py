"""The model-family seam: loading (built-in and ``package.module:Name``), its errors, parameter counts."""

from __future__ import annotations

import pytest

from meshmodels.family import load_family, resolve_model
from meshspeak.schema import ConfigError
from orchestrator.config.load import load_config
from orchestrator.plan.mesh_plan import param_counts


def test_builtin_families_load_and_gpt_is_the_default():
    assert resolve_model(load_config(None, []).model).ref == "gpt"
    assert load_family("gpt").name == "gpt" and load_family("llama").name == "llama"


@pytest.mark.parametrize(
    ("ref", "needle"),
    [
        ("nope", "is not a family"),
        ("no_such_package.fam:Family", "cannot import 'no_such_package.fam'"),
        ("json:NoSuchName", "has no 'NoSuchName'"),
        ("json:JSONDecoder", "does not satisfy the ModelFamily protocol: missing name, shape"),
    ],
)
def test_bad_family_is_one_config_error(ref, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f'model.family="{ref}"'])
    assert info.value.key == "model.family" and needle in str(info.value), str(info.value)


def test_user_family_from_examples_plans():
    cfg = load_config(None, ['model.family="examples.posnorm_family:PosNormFamily"'])
    resolved = resolve_model(cfg.model)
    assert resolved.family.name == "posnorm"
    d, v, s = 64, 256, 64
    assert param_counts(cfg.model)["embed"] == v * d + s * d  # token + position tables


@pytest.mark.parametrize("overrides", [[], ["model.n_layers=3", "model.d_model=32", "model.ffn_hidden=96"]])
def test_gpt_counts_match_a_meta_build(overrides):
    import torch

    cfg = load_config(None, overrides)
    resolved = resolve_model(cfg.model)
    with torch.device("meta"):
        model = resolved.family.build_stage(resolved.shape, range(resolved.shape.n_layers))
    assert sum(p.numel() for p in model.parameters()) == param_counts(cfg.model)["total"]
    assert param_counts(cfg.model)["layer"] == sum(p.numel() for p in model.layers["0"].parameters())
