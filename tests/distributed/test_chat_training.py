"""Training on chat shards (``data prepare --chat``) equals one process that applies the mask.

64 conversations rendered with a ChatML template whose assistant turns sit in ``{% generation %}``
blocks. The oracle for step 1 is computed here from transformers' own ``apply_chat_template``
tokens and ``assistant_masks``, one conversation at a time and unpadded: the summed cross-entropy of
the targets that predict an assistant token, over their count in the global batch. The gloo meshes
— dp x pp, tp, and dp with uneven microbatch splits (``elastic.rebalance``, what a resize to
unequal ranks trains with) — give that step-1 loss and then match the single-process
``ReferenceTrainer`` step for step, parameters included, within 1e-5.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshdata import global_sample_ids, open_source, prepare
from testbed.reference import assert_matches_reference, reference
from testbed.tiny_tokenizer import conversations, make_chat_tokenizer
from testbed.world import run_mesh, shutdown_pool

STEPS = 3
ROWS = conversations(64, seed=1)
BASE = ("model.d_model=32", "model.n_heads=4", "model.seq_len=320", "model.n_layers=4", "model.vocab_size=512",
        "train.global_batch_size=8", "train.micro_batch_size=2")


@pytest.fixture(scope="module", autouse=True)
def _worker_pool():
    yield
    shutdown_pool()


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("chat")
    make_chat_tokenizer(root / "tok")
    (root / "rows.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS))
    prepare([str(root / "rows.jsonl")], str(root / "out"), tokenizer=str(root / "tok"), chat=True, seq_len=320,
            shard_tokens=4000)
    return str(root / "tok"), str(root / "out")


def oracle_step1_loss(tok_dir: str, overrides, masked: bool = True) -> float:
    """Step 1's loss from transformers' tokens and masks, unpadded, on the reference's initial model
    (``masked=False``: every target of each conversation counts)."""
    import torch
    from transformers import AutoTokenizer

    from orchestrator.config.load import load_config
    from workers.reference import ReferenceTrainer

    cfg = load_config(None, [*overrides, "mesh.dp=1", "mesh.pp=1", "mesh.tp=1"])
    trainer = ReferenceTrainer(cfg.model, cfg.train, cfg.data.path)  # the (seed, name) init every rank builds
    hf = AutoTokenizer.from_pretrained(tok_dir)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in global_sample_ids(1, cfg.train.global_batch_size, cfg.train.seed, len(ROWS)).tolist():
            out = hf.apply_chat_template(ROWS[i]["messages"], tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
            tokens = torch.tensor(out["input_ids"])
            counted = torch.tensor(out["assistant_masks"])[1:] == 1 if masked else torch.ones(len(tokens) - 1, dtype=bool)
            targets = torch.where(counted, tokens[1:], torch.full_like(tokens[1:], -100))
            total += float(trainer.family.loss_sum(trainer.model(tokens[:-1][None]), targets[None]))
            count += int(counted.sum())
    return total / count


@pytest.mark.timeout(420)
@pytest.mark.parametrize("shape", [(2, 2, 1), (1, 1, 2)], ids=["dp2-pp2-tp1", "dp1-pp1-tp2"])
def test_chat_training_matches_the_masked_reference(chat_data, shape):
    tok_dir, shards = chat_data
    overrides = (*BASE, f"data.path={shards}")
    assert open_source(shards).num_samples(320) == len(ROWS)
    run = run_mesh(*shape, overrides, STEPS)
    ref = reference(overrides, STEPS)
    np.testing.assert_allclose(run.losses[0], oracle_step1_loss(tok_dir, overrides), rtol=1e-5)
    assert_matches_reference(run.losses, run.params, ref)
    assert abs(oracle_step1_loss(tok_dir, overrides, masked=False) - run.losses[0]) > 1e-3  # the mask matters


@pytest.mark.timeout(420)
def test_chat_training_with_uneven_splits_matches_reference(chat_data):
    """Replicas of 3 and 1 microbatches count different numbers of assistant targets; the one
    all-reduce of the count (workers/batching.py) still gives the single-process step."""
    _, shards = chat_data
    overrides = (*BASE, f"data.path={shards}", "elastic.rebalance=true")
    run = run_mesh(2, 1, 1, overrides, STEPS, splits=[(3, 1), (1, 3), (2, 2)])
    assert_matches_reference(run.losses, run.params, reference(overrides, STEPS))
