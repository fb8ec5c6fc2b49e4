"""[eval] through the real Controller: held-out loss and perplexity after steps 2 (dp=2) and 4 (after a
resize to dp=1) equal the single-process reference's eval of the same weights (tests/distributed/
test_data_training.py covers pp and tp)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meshspeak.rank_calls import RankCalls
from orchestrator.config.load import load_config
from testbed.ray_cluster import make_group
from testbed.ray_harness import events, make_controller
from testbed.reference import TEST_LR

pytestmark = pytest.mark.ray

STEPS = 4
OVERRIDES = [TEST_LR, "model.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
             f"train.steps={STEPS}", "mesh.dp=2", "mesh.pp=1", "mesh.tp=1", "eval.path=builtin", "eval.every=2",
             "eval.batches=3", "elastic.grow_check_s=1e6"]


@pytest.mark.timeout(300)
def test_eval_records_equal_reference_on_any_mesh(ray_local, store_address, tmp_path):
    from workers.reference import ReferenceTrainer

    overrides = OVERRIDES + [f"metrics.path={tmp_path / 'm.jsonl'}", f"metrics.tensorboard_dir={tmp_path / 'tb'}"]
    cfg = load_config(None, overrides)
    group = make_group(2)
    try:
        controller = make_controller(cfg, group, store_address)
        controller.resize_requests = {3: 1}
        assert controller.run().final_step == STEPS
        controller.metrics.close()  # flushes TensorBoard
    finally:
        group.shutdown()
    records = events(tmp_path / "m.jsonl", "eval")
    assert [r["step"] for r in records] == [2, 4]
    assert all(r["tokens"] == 3 * 8 * 32 and r["batches"] == 3 for r in records)
    assert all(math.isclose(r["perplexity"], math.exp(r["loss"])) for r in records)

    ref_cfg = load_config(None, [o for o in overrides if not o.startswith("mesh.")])
    trainer = ReferenceTrainer(ref_cfg.model, ref_cfg.train)
    want = []
    for first in (1, 3):
        trainer.run(first, first + 1)
        want.append(trainer.eval_loss("builtin", 3))
    np.testing.assert_allclose([r["loss"] for r in records], want, rtol=1e-5)
    assert b"eval/perplexity" in b"".join(p.read_bytes() for p in (tmp_path / "tb").iterdir())



@pytest.mark.timeout(600)
# slow (~18 s): eval beside snapshots on real ranks is test_eval_records_equal_reference_on_any_mesh's (snapshots
# every step, eval every 2 steps); this one evaluates after every step
@pytest.mark.slow
def test_eval_beside_snapshots_every_step_equals_eval_without_them(ray_local, store_address, tmp_path):
    """checkpoint.memory_every=1 and eval.every=1: after each step the controller submits the
    snapshot (training work, not awaited) and then the eval. FSDP2's state-dict hook reshards the
    modules a snapshot reads, so an eval forward running beside it on another thread computes with
    (or hands the snapshot) the wrong parameters: eval must queue behind the snapshot on the rank's
    training thread. The race is made certain after step 2 (test hooks): the snapshot waits 1.5 s
    before reading the state, the eval sleeps 4 s inside its first block's forward (parameters
    unsharded). The eval losses equal the single-process reference's, and nothing fails."""
    from workers.reference import ReferenceTrainer

    steps, batches = 3, 2
    overrides = [o for o in OVERRIDES if not o.startswith(("train.steps", "eval.every", "eval.batches"))]
    overrides += [f"train.steps={steps}", "eval.every=1", f"eval.batches={batches}", "checkpoint.memory_every=1",
                  f"checkpoint.dir={tmp_path / 'ckpt'}", f"metrics.path={tmp_path / 'm.jsonl'}"]
    cfg = load_config(None, overrides)
    group = make_group(2)

    def widen_the_race(controller, step):
        if step == 2:
            for actor in controller.generation.members.values():
                controller.group.call([actor], RankCalls.arm_fault, (2, "sleep", 1.5, "snapshot"), timeout_s=30)
                controller.group.call([actor], RankCalls.arm_fault, (2, "sleep", 4.0, "eval"), timeout_s=30)

    try:
        controller = make_controller(cfg, group, store_address)
        controller.add_step_hook(widen_the_race)
        summary = controller.run()
    finally:
        group.shutdown()
    assert events(tmp_path / "m.jsonl", "failure") == []
    assert summary.final_step == steps and summary.restarts == 0
    assert 2 in [r["step"] for r in events(tmp_path / "m.jsonl", "snapshot")]  # taken beside the eval
    records = events(tmp_path / "m.jsonl", "eval")
    assert [r["step"] for r in records] == list(range(1, steps + 1))

    ref_cfg = load_config(None, [o for o in overrides if not o.startswith(("mesh.", "checkpoint."))])
    trainer = ReferenceTrainer(ref_cfg.model, ref_cfg.train)
    want = []
    for step in range(1, steps + 1):
        trainer.run(step, step)
        want.append(trainer.eval_loss("builtin", batches))
    np.testing.assert_allclose([r["loss"] for r in records], want, rtol=1e-5)
