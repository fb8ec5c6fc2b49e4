"""data.mix through the real Controller: two sources 0.7/0.3, a rank killed (a shrink: dp=2 -> 1),
then a grow back to dp=2 (a replacement actor). Losses, final parameters and the eval.mix loss after
the last step equal the same mixture on one process; every step record's per-source counters hold
each source within one sample of its weight per step, and the epochs follow each source's passes
(each source is far smaller than the run, so it wraps often).

The default suite runs 12 steps (about 3 minutes on 2 busy cores: kill at 4, grow at 8); the
acceptance's 200 steps (kill at 70, grow at 140) are marked slow.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshdata import BUILTIN_FILE
from meshspeak.rank_calls import RankCalls
from orchestrator.config.load import load_config
from testbed.ray_cluster import make_group
from testbed.ray_harness import events, last_losses, make_controller, mesh_params, step_records
from testbed.reference import CONTROLLER_FP32, TEST_LR, assert_matches_reference, reference

pytestmark = pytest.mark.ray

SEQ, G = 32, 8
WEIGHTS = (0.7, 0.3)
SIZES = (40, 13)  # samples of SEQ per source: 12 steps read web 1.7 times and code 2.2 times


def _shards(directory, tokens: np.ndarray) -> str:
    """A third-party shard directory (no sidecar): rows of 100 byte tokens."""
    directory.mkdir()
    rows = [tokens[i : i + 100].tolist() for i in range(0, len(tokens), 100)]
    pq.write_table(pa.table({"tokens": pa.array(rows, type=pa.list_(pa.int32()))}), directory / "part-0.parquet",
                   row_group_size=4)
    return str(directory)


def _mixture(key: str, web: str, code: str) -> str:
    return f'{key}=[{{path = "{web}", weight = {WEIGHTS[0]}}}, {{path = "{code}", weight = {WEIGHTS[1]}}}]'


def _mixture_overrides(tmp_path) -> list[str]:
    """data.mix over two small sources, and eval.mix over the text that follows each of them."""
    corpus = np.frombuffer(BUILTIN_FILE.read_bytes(), np.uint8).astype(np.int32)
    code_text = np.frombuffer(pq.__file__.encode() * 200, np.uint8).astype(np.int32)
    web, code = (SIZES[0] * SEQ + 1, SIZES[1] * SEQ + 1)
    train = _mixture("data.mix", _shards(tmp_path / "web", corpus[:web]), _shards(tmp_path / "code", code_text[:code]))
    held_out = _mixture("eval.mix", _shards(tmp_path / "web_eval", corpus[web : 2 * web]),
                        _shards(tmp_path / "code_eval", code_text[code : 2 * code]))
    return [train, held_out, "eval.batches=2"]


def _run_shrink_and_grow(tmp_path, store_address, steps: int, dp: int, kill_at: int, grow_at: int) -> None:
    overrides = [TEST_LR, f"model.seq_len={SEQ}", f"train.global_batch_size={G}", "train.micro_batch_size=2",
                 f"train.steps={steps}", f"mesh.dp={dp}", "mesh.pp=1", "mesh.tp=1", "checkpoint.every=2",
                 "elastic.collective_timeout_s=60", "elastic.grow_check_s=1e6", *_mixture_overrides(tmp_path)]
    run = overrides + [f"checkpoint.dir={tmp_path / 'ckpt'}", f"metrics.path={tmp_path / 'm.jsonl'}"]
    cfg = load_config(None, run)
    group = make_group(dp)
    try:
        controller = make_controller(cfg, group, store_address)
        controller.advance()  # generation 1
        group.call([controller.generation.members[1]], RankCalls.arm_fault, (kill_at, "kill", 0.0), timeout_s=10)
        controller.resize_requests = {grow_at: dp}  # a replacement actor is started
        summary = controller.run()
        assert summary.final_step == steps and summary.restarts == 1
        assert [e["dp"] for e in events(tmp_path / "m.jsonl", "rebuild")] == [dp // 2, dp]
        assert_matches_reference(last_losses(tmp_path / "m.jsonl"), mesh_params(controller),
                                 reference(overrides, steps), CONTROLLER_FP32)
    finally:
        group.shutdown()
    _check_counters(step_records(tmp_path / "m.jsonl"), steps)
    _check_eval(cfg, events(tmp_path / "m.jsonl", "eval"), steps)


def _check_eval(cfg, records: list[dict], steps: int) -> None:
    """The held-out mixture's loss after the last step equals one process's eval of the same weights."""
    from workers.reference import ReferenceTrainer

    assert [r["step"] for r in records] == [steps] and records[0]["tokens"] == 2 * G * SEQ
    trainer = ReferenceTrainer(cfg.model, cfg.train, cfg.data.mix)
    trainer.run(1, steps)
    np.testing.assert_allclose(records[0]["loss"], trainer.eval_loss(cfg.eval.mix, 2), rtol=1e-5)


def _check_counters(records: dict[int, dict], steps: int) -> None:
    assert sorted(records) == list(range(1, steps + 1))
    samples = np.asarray([[s["samples"] for s in records[k]["sources"]] for k in range(1, steps + 1)])
    per_step = np.diff(np.vstack([np.zeros((1, 2), np.int64), samples]), axis=0)
    share = np.asarray(WEIGHTS) * G
    assert np.all(per_step.sum(axis=1) == G)
    assert np.all(np.abs(per_step - share) < 1), "a step's share is off by a sample or more"
    assert np.all(np.abs(samples - share * np.arange(1, steps + 1)[:, None]) <= 0.5 + 1e-9)
    last = records[steps]["sources"]
    assert [s["epoch"] for s in last] == [(s["samples"] - 1) // n for s, n in zip(last, SIZES)]
    assert min(s["epoch"] for s in last) >= 1, "each source must have wrapped into its next pass"
    assert [s["tokens"] for s in last] == [s["samples"] * SEQ for s in last]


@pytest.mark.timeout(600)
def test_mixture_with_a_shrink_and_a_grow_equals_one_process(ray_local, store_address, tmp_path):
    _run_shrink_and_grow(tmp_path, store_address, steps=12, dp=2, kill_at=4, grow_at=8)


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_mixture_200_steps_with_a_shrink_and_a_grow_equals_one_process(ray_local, store_address, tmp_path):
    _run_shrink_and_grow(tmp_path, store_address, steps=200, dp=2, kill_at=70, grow_at=140)
