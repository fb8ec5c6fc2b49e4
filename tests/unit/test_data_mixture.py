"""data.mix without processes: each step holds every source in proportion (within one sample of its
weight), each source's samples come once per pass (no repeats, no gaps), and the order is a function
of the step alone, so any mesh and any change of dp mid-run read the same samples."""

from __future__ import annotations

import numpy as np
import pytest

from meshdata import DataError, Mixture, TokenSource, microbatch_tokens, open_mixture, replica_slice
from meshdata.mixture import source_counters, validate_mixture
from meshdata.order import MixSchedule, global_sample_ids, mix_parts

SEQ = 4
G = 8
STEPS = 200


def _source(n_samples: int, base: int, name: str) -> TokenSource:
    # Token t of a source is base + t, so every window names its source and position.
    return TokenSource.from_array(np.arange(base, base + n_samples * SEQ + 1), 10**6, name)


def _two_sources() -> Mixture:
    return Mixture([_source(37, 0, "web"), _source(23, 500_000, "code")], (0.7, 0.3), SEQ)


def _per_source_sequences(mix: Mixture, steps: int, dp_at=lambda step: 1) -> list[list[int]]:
    """The local ids each source gave, in order, as the replicas of a mesh whose dp changes read them."""
    seen: list[list[int]] = [[] for _ in mix.sources]
    for step in range(1, steps + 1):
        ids = mix.step_ids(step, G, seed=7)
        dp = dp_at(step)
        parts = [np.concatenate(replica_slice(ids, 2, r, dp)) for r in range(dp)]
        read = np.concatenate(parts)
        np.testing.assert_array_equal(read, ids)  # the replicas together read the step, once
        for j in range(len(mix.sources)):
            mine = read[mix.source_of(read) == j]
            seen[j].extend((mine - mix.offsets[j]).tolist())
    return seen


def _assert_once_per_pass(sequence: list[int], size: int) -> None:
    full = len(sequence) // size
    assert full >= 1, "the test must run past one pass"
    for p in range(full):
        assert sorted(sequence[p * size : (p + 1) * size]) == list(range(size)), f"pass {p}"
    rest = sequence[full * size :]
    assert len(set(rest)) == len(rest), "a repeat inside the pass in progress"


def test_two_sources_every_step_in_proportion_and_each_source_once_per_pass():
    mix = _two_sources()
    counts = np.stack([np.bincount(mix.source_of(mix.step_ids(k, G, 7)), minlength=2) for k in range(1, STEPS + 1)])
    want = np.asarray([0.7, 0.3]) * G
    assert np.all(np.abs(counts - want) < 1), "a step's share is off by a sample or more"
    totals = np.cumsum(counts, axis=0)
    steps = np.arange(1, STEPS + 1)[:, None]
    assert np.all(np.abs(totals - want * steps) <= 0.5 + 1e-9), "the running share drifted"
    seen = _per_source_sequences(mix, STEPS)
    for sequence, size in zip(seen, mix.sizes):
        _assert_once_per_pass(sequence, int(size))
    assert [len(s) for s in seen] == totals[-1].tolist()


def test_the_order_does_not_depend_on_the_mesh_or_a_change_of_dp_mid_run():
    mix = _two_sources()
    alone = _per_source_sequences(mix, STEPS)
    resized = _per_source_sequences(mix, STEPS, dp_at=lambda step: 4 if step <= 60 else 2 if step <= 130 else 1)
    assert resized == alone
    # A fresh process (a resume, a new rank) asked for step 150 first computes the same ids.
    fresh = Mixture(mix.sources, mix.weights, SEQ)
    MixSchedule.MARK_EVERY, keep = 16, MixSchedule.MARK_EVERY
    try:
        from meshdata.order import mix_schedule

        mix_schedule.cache_clear()
        np.testing.assert_array_equal(fresh.step_ids(150, G, 7), mix.step_ids(150, G, 7))
        np.testing.assert_array_equal(fresh.step_ids(3, G, 7), mix.step_ids(3, G, 7))  # and back
    finally:
        MixSchedule.MARK_EVERY = keep
        mix_schedule.cache_clear()


def test_windows_come_from_their_own_source_and_counters_follow_the_passes():
    mix = _two_sources()
    ids = mix.step_ids(5, G, 7)
    x, y = microbatch_tokens(mix, ids, SEQ)
    for row, i in enumerate(ids):
        j = int(mix.source_of([i])[0])
        local = int(i - mix.offsets[j])
        want = mix.sources[j].sample(local, SEQ)
        np.testing.assert_array_equal(x[row], want[:-1])
        np.testing.assert_array_equal(y[row], want[1:])
    counters = source_counters(mix, STEPS, G)
    assert [c["samples"] for c in counters] == [1120, 480]  # 0.7 and 0.3 of 200 x 8
    assert [c["tokens"] for c in counters] == [1120 * SEQ, 480 * SEQ]
    assert [c["epoch"] for c in counters] == [1119 // 37, 479 // 23]


def test_a_single_source_keeps_the_order_of_data_path():
    src = _source(50, 0, "one")
    one = Mixture([src], (1.0,), SEQ)
    for step in (1, 7, 13):
        np.testing.assert_array_equal(one.step_ids(step, G, 3), global_sample_ids(step, G, 3, 50))
    np.testing.assert_array_equal(one.eval_ids(2, G), np.arange(16, 24))


def test_eval_batches_read_each_source_in_file_order():
    mix = _two_sources()
    ids = np.concatenate([mix.eval_ids(b, G) for b in range(3)])
    for j in range(2):
        local = ids[mix.source_of(ids) == j] - mix.offsets[j]
        np.testing.assert_array_equal(local, np.arange(len(local)))


@pytest.mark.parametrize("seed", range(6))
def test_any_weights_keep_every_step_within_one_sample(seed):
    rng = np.random.default_rng(seed)
    weights = rng.uniform(0.05, 3.0, size=int(rng.integers(2, 7)))
    g = int(rng.integers(1, 40))
    schedule = MixSchedule(mix_parts(weights.tolist()), g)
    share = weights / weights.sum() * g
    for k in range(1, 400):
        counts = schedule.counts(k)
        assert counts.sum() == g and np.all(counts >= 0)
        assert np.all(np.abs(counts - share) < 1)
        assert np.all(np.abs(schedule.seen(k) - share * k) < 1.1)


def test_mixture_sources_are_checked_before_a_run(tmp_path):
    spec = (("builtin", 0.5), (str(tmp_path / "missing"), 0.5))
    with pytest.raises(DataError, match=r"data\.mix\[1\]\.path = .*does not exist") as info:
        validate_mixture(spec, 64, 256, 8, key="data.mix", masks="auto")
    assert info.value.key == "data.mix"
    # builtin holds a few hundred windows of 64: a source too small for its share of one batch is refused
    small = open_mixture("builtin", 4096).sizes[0]
    with pytest.raises(DataError, match=r"data\.mix\[0\]\.path = 'builtin' has .* fewer than its share"):
        validate_mixture((("builtin", 1.0),), 4096, 256, int(small) + 1, key="data.mix", masks="auto")


def test_a_mixture_round_trips_through_toml_and_refuses_a_second_data_path(tmp_path):
    from orchestrator.config.load import config_toml, load_config
    from testbed.config_errors import error_for

    mix = 'data.mix=[{path = "s3://web/", weight = 0.7}, {path = "code/", weight = 0.3}]'
    cfg = load_config(None, [mix])
    assert cfg.data.mix == (("s3://web/", 0.7), ("code/", 0.3))
    (tmp_path / "job.toml").write_text(config_toml(cfg))
    assert load_config(tmp_path / "job.toml") == cfg
    assert error_for(mix, "data.path=/data/shards").key == "data.mix"
    assert error_for('eval.mix=[{path = "a", weight = 1}]', "eval.path=b").key == "eval.mix"
    assert "weight must be > 0" in str(error_for('data.mix=[{path = "a", weight = 0.0}]'))
    assert "listed twice" in str(error_for('data.mix=[{path = "a", weight = 1}, {path = "a", weight = 2}]'))


def test_the_report_shows_the_newest_steps_sources():
    from orchestrator.report.sources import last_sources, source_rows

    def record(step, samples):
        return {"step": step, "loss": 1.0, "sources": [
            {"path": "web", "weight": 0.7, "samples": samples[0], "tokens": samples[0] * 4, "epoch": 0},
            {"path": "code", "weight": 0.3, "samples": samples[1], "tokens": samples[1] * 4, "epoch": 1}]}

    records = [record(1, (6, 2)), record(2, (11, 5)), {"event": "failure", "step": 2}, record(2, (11, 5))]
    assert [s["samples"] for s in last_sources(records)] == [11, 5]
    assert source_rows(last_sources(records))[1] == ("code", "0.3", "31.2%", "5", "20", "1")
    assert last_sources([{"step": 1, "loss": 1.0}]) == []


@pytest.mark.parametrize("seed", range(8))
def test_two_sources_in_closed_form_equal_the_greedy_replay(seed):
    rng = np.random.default_rng(100 + seed)
    weights, g = rng.uniform(0.01, 1.0, size=2).tolist(), int(rng.integers(1, 50))
    schedule = MixSchedule(mix_parts(weights), g)
    extras = (0, 0)
    for k in range(1, 500):
        extras = schedule._advance(extras, k)  # the rule as more than two sources replay it
        assert schedule._extras(k) == extras


def test_a_mixture_identity_names_its_sources_and_weights():
    web, code = _source(37, 0, "web"), _source(23, 500_000, "code")
    same = Mixture([web, code], (0.7, 0.3), SEQ).identity
    assert Mixture([web, code], (7, 3), SEQ).identity == same  # the same ratio is the same order
    assert Mixture([web, code], (0.6, 0.4), SEQ).identity != same  # other weights: other steps
    assert Mixture([code, web], (0.3, 0.7), SEQ).identity != same
    assert Mixture([web], (1.0,), SEQ).identity == web.identity  # data.path's identity, as before


def test_chat_shards_inside_a_mixture_keep_their_loss_mask(tmp_path):
    """A mixture reads each source as the source itself would: a chat source's targets come masked
    (meshdata.chat_source), a plain source's come whole, rows in the mixture's order."""
    import json

    from meshdata import open_source, prepare
    from meshdata.masks import boundary_eos, counts_every_target
    from testbed.tiny_tokenizer import conversations, make_chat_tokenizer

    make_chat_tokenizer(tmp_path / "tok")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in conversations(12)))
    prepare([str(tmp_path / "chat.jsonl")], str(tmp_path / "chat"), tokenizer=str(tmp_path / "tok"), chat=True,
            parallel=False)
    chat = open_source(str(tmp_path / "chat"))
    seq_len = int(chat.longest) + 3
    plain = TokenSource.from_array(np.arange(20 * seq_len + 1) % 50, 50, "plain")
    mix = Mixture([chat, plain], (0.5, 0.5), seq_len)
    assert mix.has_loss_mask and not counts_every_target(mix, None) and boundary_eos("auto", mix) is None
    ids = mix.step_ids(2, 8, seed=1)
    x, y = microbatch_tokens(mix, ids, seq_len)
    for row, i in enumerate(ids):
        j = int(mix.source_of([i])[0])
        want_x, want_y = microbatch_tokens(mix.sources[j], np.asarray([i - mix.offsets[j]]), seq_len)
        np.testing.assert_array_equal(x[row], want_x[0])
        np.testing.assert_array_equal(y[row], want_y[0])
    assert sorted(set(mix.source_of(ids).tolist())) == [0, 1]
    from_chat = mix.source_of(ids) == 0
    assert (y[from_chat] == -100).any() and not (y[~from_chat] == -100).any()  # masked where chat masks


def test_the_driver_resolves_a_mixtures_paths_before_the_ranks_see_them(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from orchestrator.config.load import load_config
    from orchestrator.data_inputs import check_job_data

    (tmp_path / "code").mkdir()
    rows = pa.array([list(range(100))] * 4, type=pa.list_(pa.int32()))
    pq.write_table(pa.table({"tokens": rows}), tmp_path / "code" / "a.parquet")
    monkeypatch.chdir(tmp_path)  # "code" is relative to where the driver runs
    mix = '[{path = "builtin", weight = 3}, {path = "code", weight = 1}]'
    cfg = load_config(None, [f"data.mix={mix}", f"eval.mix={mix}", "eval.batches=2", "model.seq_len=16"])
    data = check_job_data(cfg, 256)
    want = (("builtin", 3.0), (str(tmp_path / "code"), 1.0))
    assert data.cfg.data.mix == want and data.cfg.eval.mix == want and data.eval_spec == want
    assert data.train.name == f"mix(builtin: 3, {tmp_path / 'code'}: 1)" and data.eval_mask_eos_id is None
    assert [(c["samples"], c["tokens"]) for c in data.counters(2)] == [(12, 12 * 16), (4, 4 * 16)]  # 3 : 1 of 8
    with pytest.raises(DataError, match=r"eval\.mix\[1\]\.path = .* fewer than its share of 40 eval batches"):
        check_job_data(load_config(None, [f"eval.mix={mix}", "eval.batches=40", "model.seq_len=16"]), 256)
