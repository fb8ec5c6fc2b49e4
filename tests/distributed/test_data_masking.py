"""Training on tokenized shards with document-boundary masking equals one process on any mesh.

Shards are made by ``data prepare`` with a BPE trained offline (short documents, so most windows
hold several EOS and masking changes the loss); the mesh's per-step global losses and final
parameters match the single-process ``ReferenceTrainer`` within 1e-5.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.distributed.test_mesh_equivalence import assert_matches_reference
from tests.helpers.world import reference, run_mesh, shutdown_pool
from tests.unit.test_data_prepare import make_tokenizer
from workers.data import open_source, prepare

STEPS = 4
BASE = ("model.d_model=32", "model.n_heads=4", "model.seq_len=32", "model.n_layers=4", "model.vocab_size=512",
        "train.global_batch_size=8", "train.micro_batch_size=2")


@pytest.fixture(scope="module", autouse=True)
def _worker_pool():
    yield
    shutdown_pool()


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("masking")
    make_tokenizer(root / "tok")
    rng = np.random.default_rng(0)
    words = "the baker sold bread to sailors at dawn while crows watched a fox".split()
    docs = [" ".join(rng.choice(words, rng.integers(2, 12))) for _ in range(600)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([str(root / "docs.jsonl")], str(root / "out"), tokenizer=str(root / "tok"), shard_tokens=3000)
    return str(root / "out")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", [(2, 2, 1), (1, 1, 2)], ids=["dp2-pp2-tp1", "dp1-pp1-tp2"])
def test_masked_training_on_prepared_shards_matches_reference(shards, shape):
    overrides = (*BASE, f"data.path={shards}")  # mask_document_boundaries = "auto": on, EOS known
    src = open_source(shards)
    assert src.eos_id is not None and len(src.index.files) > 1
    run = run_mesh(*shape, overrides, STEPS)
    ref = reference(overrides, STEPS)
    assert_matches_reference(run, ref)
    unmasked = reference((*overrides, "data.mask_document_boundaries=false"), STEPS)
    assert abs(unmasked.losses[0] - ref.losses[0]) > 1e-3  # the mask is really in effect
