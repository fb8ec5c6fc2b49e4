"""Hugging Face weights in, a mesh's checkpoint, Hugging Face weights out (transformers as the oracle).

- Round trip: a tied tiny Llama is loaded with ``checkpoint.init_from`` into a (2,2,2) mesh (the tied
  embedding on two pipeline stages), trained one step at lr 1e-30 (below fp32 resolution: the weights
  do not move), checkpointed, exported: every tensor is bit-identical to the source file, and the
  export holds one embedding tensor and no ``lm_head.weight``.
- After training: an untied GQA + bias model trains 3 steps at (3,1,1) (uneven FSDP shards), is
  checkpointed, exported and loaded with ``from_pretrained`` (no missing or unexpected keys): its loss
  on step 4's training windows equals elastimesh's step-4 loss (<= 1e-5 relative).
- ``export`` of a directory that is not a committed checkpoint is refused (exit 2, one line).

The shared rank pool is left running for the next module (it stops at exit or when a later module
stops it), so the distributed suite starts the 8 ranks once less.
"""

from __future__ import annotations

import os

import pytest

from testbed.command_line import assert_bad_input, run_cli
from testbed.family_cases import HF_BATCH, SaveAfter, commit_run
from testbed.world import mesh_config, run_mesh

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.timeout(300)
def test_init_from_then_export_is_bit_identical(tmp_path):
    from safetensors.torch import load_file

    from meshmodels.export import export_checkpoint
    from testbed.hf_models import save_tiny_llama

    src = str(tmp_path / "src")
    save_tiny_llama(src, tie=True, bias=True, layers=2)
    overrides = (f"model.from_hf={src}", f"checkpoint.init_from={src}", "train.lr=1e-30", *HF_BATCH)
    root = str(tmp_path / "ckpt")
    run = run_mesh(2, 2, 2, overrides, 1, instrument=SaveAfter(root, 1), collect_params=False)
    step_dir = commit_run(root, run, overrides, 1)
    # Both pipeline ends saved their copy of the tied embedding under one name: stored once.
    from checkpoints.reader import read_metadata

    stored = read_metadata(step_dir).state_dict_metadata
    for key in ("model.tok_embeddings.weight", "optim.state.tok_embeddings.weight.exp_avg"):
        assert sum(c.sizes[0] * c.sizes[1] for c in stored[key].chunks) == 256 * 64, key
    info = export_checkpoint(step_dir, str(tmp_path / "out"))
    assert info["files"] == ["model.safetensors"]
    source, exported = load_file(f"{src}/model.safetensors"), load_file(str(tmp_path / "out/model.safetensors"))
    assert set(exported) == set(source) and "lm_head.weight" not in exported
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch_equal(exported[name], tensor), name


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


@pytest.mark.timeout(300)
def test_trained_export_loads_in_transformers_with_the_same_loss(tmp_path):
    from transformers import AutoModelForCausalLM

    from meshmodels.export import export_checkpoint
    from testbed.hf_models import hf_step_loss, save_tiny_llama

    src = str(tmp_path / "src")
    save_tiny_llama(src, bias=True, layers=2)
    overrides = (f"model.from_hf={src}", f"checkpoint.init_from={src}", *HF_BATCH)
    root = str(tmp_path / "ckpt")
    run = run_mesh(3, 1, 1, overrides, 4, instrument=SaveAfter(root, 3), collect_params=False)
    step_dir = commit_run(root, run, overrides, 3)
    out = str(tmp_path / "out")
    export_checkpoint(step_dir, out, max_shard_bytes=100_000)  # several files + index
    assert os.path.exists(f"{out}/model.safetensors.index.json")
    model, loading = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    expected = hf_step_loss(model, mesh_config(3, 1, 1, overrides), 4)
    got = run.losses[3]  # elastimesh's step-4 loss, on the weights after step 3
    assert abs(got - expected) <= 1e-5 * abs(expected), (got, expected)


def test_export_refuses_what_is_not_a_committed_checkpoint(tmp_path):
    (tmp_path / "step-00000003").mkdir()
    assert_bad_input(run_cli("export", str(tmp_path / "step-00000003"), "--out", str(tmp_path / "out")),
                     "not a committed checkpoint")
    assert_bad_input(run_cli("export", str(tmp_path), "--out", str(tmp_path / "out")), "not a committed checkpoint")
    assert not (tmp_path / "out").exists()


class LoadFirst:
    """An ``instrument``: load the checkpoint at ``path`` before the first step (a resume)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, runtime):
        runtime.load_checkpoint(self.path)
        return None


@pytest.mark.timeout(300)
def test_a_run_started_from_hf_weights_resumes_resharded(tmp_path):
    """Tied embedding on two stages at (2,2,2), saved at step 2, resumed at (3,1,1) where it is one
    parameter: steps 3-4 and the final weights equal one process's uninterrupted run."""
    from testbed.hf_models import save_tiny_llama
    from testbed.reference import assert_matches_reference, reference

    src = str(tmp_path / "src")
    save_tiny_llama(src, tie=True, bias=True, layers=2)
    overrides = (f"model.from_hf={src}", f"checkpoint.init_from={src}", *HF_BATCH)
    root = str(tmp_path / "ckpt")
    first = run_mesh(2, 2, 2, overrides, 2, instrument=SaveAfter(root, 2), collect_params=False)
    step_dir = commit_run(root, first, overrides, 2)
    resumed = run_mesh(3, 1, 1, overrides, 2, first_step=3, instrument=LoadFirst(step_dir))
    assert_matches_reference(first.losses + resumed.losses, resumed.params, reference(overrides, 4))
