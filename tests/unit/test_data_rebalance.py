"""The data contract with ``elastic.rebalance``: however the driver splits a step's microbatches over
the replicas, and however the split and dp change from step to step, the replicas' microbatches
concatenated in dp order are the step's global batch in its order, and over an epoch every window of
a lazily read corpus is trained exactly once (the ranks' own reads, as workers/runtime.py does them)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from meshdata import global_sample_ids, microbatch_tokens, open_source, prepare, replica_microbatches
from meshspeak.rebalance import replica_span


def _random_split(rng: random.Random, total: int, dp: int) -> tuple[int, ...]:
    cuts = sorted(rng.sample(range(1, total), dp - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_any_split_concatenates_to_the_global_batch(dp):
    rng = random.Random(dp)
    n, g, mbs, seed = 1000, 48, 2, 11
    for step in range(1, 40):  # crosses the epoch boundary mid-batch
        split = _random_split(rng, g // mbs, dp)
        parts = []
        for r in range(dp):
            mine = replica_microbatches(step, g, mbs, r, dp, seed, n, counts=split)
            first, count = replica_span(split, r)
            assert len(mine) == count and all(m.shape == (mbs,) for m in mine)
            np.testing.assert_array_equal(np.concatenate(mine),
                                          global_sample_ids(step, g, seed, n)[first * mbs:(first + count) * mbs])
            parts.extend(mine)
        np.testing.assert_array_equal(np.concatenate(parts), global_sample_ids(step, g, seed, n))


def test_even_counts_are_the_even_split():
    for r in range(4):
        even = replica_microbatches(3, 48, 2, r, 4, 5, 1000)
        same = replica_microbatches(3, 48, 2, r, 4, 5, 1000, counts=(6, 6, 6, 6))
        assert all(np.array_equal(a, b) for a, b in zip(even, same, strict=True))


@pytest.mark.parametrize("counts", [(6, 6, 6), (12, 11, 1, 0), (13, 11, 1, 0), (12, 12, 0, 1), (24,)])
def test_bad_counts_raise(counts):
    with pytest.raises(ValueError, match="split"):
        replica_microbatches(1, 48, 2, 0, 4, 0, 1000, counts=counts)


def test_every_window_once_per_epoch_with_rebalanced_splits_across_shrink_and_grow(tmp_path):
    """Steps at dp=4, then dp=2 (a shrink), then dp=4 (a grow), each step with its own uneven split:
    over one epoch every window is trained exactly once, with the right tokens."""
    text = tmp_path / "a.txt"
    text.write_bytes(np.random.default_rng(0).integers(0, 128, 20_000, dtype=np.uint8).tobytes())
    prepare([str(text)], str(tmp_path / "o"), shard_tokens=6_000)
    src = open_source(str(tmp_path / "o"))
    seq, g, mbs, seed = 16, 16, 2, 3
    n = src.num_samples(seq)
    steps = -(-n // g)
    rng = random.Random(4)
    seen = []
    for step in range(1, steps + 1):
        dp = 2 if 3 <= step <= 5 else 4
        split = _random_split(rng, g // mbs, dp)
        for rank in range(dp):
            for ids in replica_microbatches(step, g, mbs, rank, dp, seed, n, counts=split):
                x, y = microbatch_tokens(src, ids, seq)
                seen.extend(zip(ids.tolist(), map(bytes, x.astype(np.uint8)), map(bytes, y.astype(np.uint8))))
    epoch = seen[:n]
    assert sorted(i for i, _, _ in epoch) == list(range(n))
    flat = src.read_all().astype(np.uint8).tobytes()
    for i, x, y in epoch:
        assert x == flat[i * seq : i * seq + seq] and y == flat[i * seq + 1 : i * seq + seq + 1]
