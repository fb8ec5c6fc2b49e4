"""Training on tokenized shards with document-boundary masking, and held-out eval, equal one process.

Shards are made by ``data prepare`` with a BPE trained offline (short documents, so most windows
hold several EOS and masking changes the loss); the mesh's per-step global losses and final
parameters match the single-process ``ReferenceTrainer`` within 1e-5, and so does the eval loss
(forward-only pipeline over a fixed set of held-out windows) computed on the trained mesh.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from meshdata import open_source, prepare
from meshdata.masks import mask_eos_for
from testbed.reference import assert_matches_reference, reference
from testbed.tiny_tokenizer import make_tokenizer
from testbed.world import run_mesh, shutdown_pool

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


def eval_after_training(path: str, batches: int, runtime):
    """An ``instrument`` hook: after the last step, every rank runs the held-out batches."""
    from meshspeak.schedule import make_schedule
    from meshspeak.sections import microbatches_per_replica

    shape = runtime.groups.shape
    actions = make_schedule("1f1b", shape.pp, microbatches_per_replica(runtime.spec.train, shape.dp), 1)
    mine = actions[runtime.groups.coords.pp]
    return lambda: [runtime.eval_step(path, b, mine, runtime.spec.mask_eos_id) for b in range(batches)]


def mesh_eval_loss(extras: dict) -> float:
    """What orchestrator/control/evaluation.py computes from the ranks' answers."""
    batches = len(next(iter(extras.values())))
    total = count = 0.0
    for b in range(batches):
        answers = [per_rank[b] for per_rank in extras.values()]
        total += sum(a["loss"] for a in answers if a["loss"] is not None) * answers[0]["count"]
        count += answers[0]["count"]
    return total / count


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", [(2, 2, 1), (1, 1, 2)], ids=["dp2-pp2-tp1", "dp1-pp1-tp2"])
def test_masked_training_on_prepared_shards_matches_reference(shards, shape):
    from orchestrator.config.load import load_config
    from workers.reference import ReferenceTrainer

    overrides = (*BASE, f"data.path={shards}")  # mask_document_boundaries = "auto": on, EOS known
    src = open_source(shards)
    assert src.eos_id is not None and len(src.index.files) > 1
    run = run_mesh(*shape, overrides, STEPS, instrument=functools.partial(eval_after_training, shards, 2))
    ref = reference(overrides, STEPS)
    assert_matches_reference(run.losses, run.params, ref)
    unmasked = reference((*overrides, "data.mask_document_boundaries=false"), STEPS)
    assert abs(unmasked.losses[0] - ref.losses[0]) > 1e-3  # the mask is really in effect

    cfg = load_config(None, [*overrides, "mesh.dp=1", "mesh.tp=1"])
    trainer = ReferenceTrainer(cfg.model, cfg.train, shards, mask_eos_id=mask_eos_for(cfg.data))
    trainer.run(1, STEPS)
    want = trainer.eval_loss(shards, 2, mask_eos_for(cfg.data))
    np.testing.assert_allclose(mesh_eval_loss(run.extras), want, rtol=1e-5)


@pytest.mark.timeout(300)
def test_masked_training_with_uneven_splits_matches_reference(shards):
    """``elastic.rebalance`` with document masks: replicas of 3 and 1 microbatches (then 1 and 3, ...)
    count different numbers of targets, and one all-reduce over dp still gives every replica the
    global count (workers/batching.py): the same losses and parameters as one process."""
    overrides = (*BASE, f"data.path={shards}", "elastic.rebalance=true")
    splits = [(3, 1), (1, 3), (2, 2), (3, 1)]
    run = run_mesh(2, 1, 1, overrides, STEPS, splits=splits)
    assert_matches_reference(run.losses, run.params, reference(overrides, STEPS))
