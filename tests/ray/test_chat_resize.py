"""Chat shards through the real Controller across a resize: dp=2 for steps 1-2, dp=1 from step 3. The
per-step losses and final parameters equal the single-process reference that applies the loss mask,
and so do the held-out losses on chat shards after steps 2 and 4 (eval counts the same masked
targets). tests/distributed/test_chat_training.py checks the reference against transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from meshdata import prepare
from orchestrator.config.load import load_config
from testbed.ray_cluster import make_group
from testbed.ray_harness import events, last_losses, make_controller, mesh_params
from testbed.reference import CONTROLLER_FP32, TEST_LR, assert_matches_reference, reference
from testbed.tiny_tokenizer import conversations, make_chat_tokenizer

pytestmark = pytest.mark.ray

STEPS = 4
OVERRIDES = [TEST_LR, "model.d_model=32", "model.n_heads=4", "model.n_layers=2", "model.seq_len=320",
             "model.vocab_size=512", "train.global_batch_size=8", "train.micro_batch_size=2", f"train.steps={STEPS}",
             "mesh.dp=2", "mesh.pp=1", "mesh.tp=1", "eval.every=2", "eval.batches=1", "elastic.grow_check_s=1e6"]


@pytest.mark.timeout(420)
# slow (~30 s with its actors' start): the chat data's masks equal the reference on fixed meshes in the
# default run (tests/distributed), and shrinks keep the data position (test_data_mixture, test_elastic)
@pytest.mark.slow
def test_chat_training_across_a_shrink_equals_the_masked_reference(ray_local, store_address, tmp_path):
    from workers.reference import ReferenceTrainer

    make_chat_tokenizer(tmp_path / "tok")
    for name, seed in (("train", 4), ("held_out", 5)):
        rows = tmp_path / f"{name}.jsonl"
        rows.write_text("".join(json.dumps(r) + "\n" for r in conversations(40, seed=seed)))
        prepare([str(rows)], str(tmp_path / name), tokenizer=str(tmp_path / "tok"), chat=True, seq_len=320)
    overrides = OVERRIDES + [f"data.path={tmp_path / 'train'}", f"eval.path={tmp_path / 'held_out'}",
                             f"metrics.path={tmp_path / 'm.jsonl'}"]
    cfg = load_config(None, overrides)
    group = make_group(2)
    try:
        controller = make_controller(cfg, group, store_address, data_path=str(tmp_path / "train"))
        controller.resize_requests = {3: 1}
        assert controller.run().final_step == STEPS
        params = mesh_params(controller)
    finally:
        group.shutdown()
    assert [e["dp"] for e in events(tmp_path / "m.jsonl", "rebuild")] == [1]
    assert_matches_reference(last_losses(tmp_path / "m.jsonl"), params, reference(overrides, STEPS), CONTROLLER_FP32)

    ref_cfg = load_config(None, [o for o in overrides if not o.startswith("mesh.")])
    trainer = ReferenceTrainer(ref_cfg.model, ref_cfg.train, str(tmp_path / "train"))
    want = []
    for first in (1, 3):
        trainer.run(first, first + 1)
        want.append(trainer.eval_loss(str(tmp_path / "held_out"), 1))
    records = events(tmp_path / "m.jsonl", "eval")
    assert [r["step"] for r in records] == [2, 4]
    np.testing.assert_allclose([r["loss"] for r in records], want, rtol=1e-5)
