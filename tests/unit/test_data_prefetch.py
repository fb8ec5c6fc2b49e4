"""#36 item 13: the next step's windows are read ahead off the training thread, and gathered with numpy.

Equality against the plain reader across what the driver does to the data position: steps in order,
a rollback (an earlier step asked again), a re-plan (another dp, another split) and a resume in a new
generation (a new reader) — a batch read ahead for a step that is not trained next is never served."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshdata import Mixture, TokenSource, microbatch_tokens, open_source, replica_slice
from meshdata.order import global_sample_ids
from meshdata.prefetch import ReadAhead

SEQ, G, MBS = 7, 8, 2


def _shards(path, seed=0):
    """Three files of rows of 0-40 tokens (some empty or null), row groups of 3 rows: windows cross
    row groups and files."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    for f in range(3):
        rows = [rng.integers(0, 500, rng.integers(0, 40)).tolist() for _ in range(25)]
        rows[4], rows[9] = [], None
        pq.write_table(pa.table({"tokens": pa.array(rows, type=pa.list_(pa.int32()))}),
                       str(path / f"part-{f}.parquet"), row_group_size=3)
    return open_source(str(path))


def _one_by_one(source: TokenSource, ids, seq_len) -> np.ndarray:
    """The oracle: each window read by itself (what sample_windows did before)."""
    return np.stack([source.read(int(i) * seq_len, int(i) * seq_len + seq_len + 1) for i in ids])


def test_gathered_windows_equal_windows_read_one_by_one(tmp_path):
    lazy = _shards(tmp_path / "d")
    memory = TokenSource.from_array(lazy.read_all(), 500, "mem")
    rng = np.random.default_rng(1)
    for source in (lazy, memory):
        n = source.num_samples(SEQ)
        ids = np.concatenate([rng.permutation(n), rng.integers(0, n, 40), [n - 1, 0, 0]])
        got = microbatch_tokens(source, ids, SEQ)
        want = _one_by_one(source, ids, SEQ).astype(np.int64)
        np.testing.assert_array_equal(got[0], want[:, :-1])
        np.testing.assert_array_equal(got[1], want[:, 1:])
        assert microbatch_tokens(source, np.zeros(0, np.int64), SEQ)[0].shape == (0, SEQ)
    with pytest.raises(IndexError):
        microbatch_tokens(lazy, np.asarray([lazy.num_samples(SEQ)]), SEQ)


def _step(reader, step, dp_rank, dp, seed=5, split=None):
    ids = replica_slice(global_sample_ids(step, G, seed, reader.num_samples(SEQ)), MBS, dp_rank, dp, counts=split)
    return ids, [microbatch_tokens(reader, mb, SEQ) for mb in ids]


def _next_ids(reader, step, dp_rank, dp, split=None):
    return replica_slice(global_sample_ids(step, G, 5, reader.num_samples(SEQ)), MBS, dp_rank, dp, counts=split)


def _same(a, b):
    assert len(a) == len(b)
    for (x1, y1), (x2, y2) in zip(a, b):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)


@pytest.mark.parametrize("kind", ["lazy", "mixture"])
def test_read_ahead_serves_the_next_step_and_never_a_replanned_or_rolled_back_one(tmp_path, kind):
    lazy = _shards(tmp_path / "d")
    plain = lazy if kind == "lazy" else Mixture(
        (lazy, TokenSource.from_array(np.arange(900, dtype=np.int32) % 500, 500, "b")), (0.5, 0.5), SEQ)
    ahead = ReadAhead(plain)
    trained = []
    for step in range(1, 6):  # generation 1: dp=2, rank 1; each step announces the next
        trained.append(_step(ahead, step, 1, 2)[1])
        ahead.prefetch(_next_ids(plain, step + 1, 1, 2), SEQ)
    assert ahead.served == 4 * (G // 2 // MBS)  # steps 2-5 came from the read ahead
    for step, got in enumerate(trained, start=1):
        _same(got, _step(plain, step, 1, 2)[1])
    # A rollback to step 3: step 6 was read ahead, step 3 is asked; read anew, equal; 6 dropped.
    served = ahead.served
    _same(_step(ahead, 3, 1, 2)[1], _step(plain, 3, 1, 2)[1])
    assert ahead.served == served
    # A re-plan: step 6 was read ahead again for dp=2 rank 1 (samples 4-7 of the step); in the new
    # mesh this actor is dp=4 rank 0 (samples 0-1). (Had it become rank 3, samples 6-7, that
    # microbatch would be served: the same ids are the same windows.)
    ahead.prefetch(_next_ids(plain, 6, 1, 2), SEQ)
    _same(_step(ahead, 6, 0, 4)[1], _step(plain, 6, 0, 4)[1])
    assert ahead.served == served
    # A rebalanced split (3 microbatches to replica 0, 1 to replica 1) of step 7 read ahead, asked as is.
    ahead.prefetch(_next_ids(plain, 7, 0, 2, split=(3, 1)), SEQ)
    _same(_step(ahead, 7, 0, 2, split=(3, 1))[1], _step(plain, 7, 0, 2, split=(3, 1))[1])
    assert ahead.served == served + 3
    ahead.prefetch(_next_ids(plain, 8, 0, 2), SEQ)
    ahead.close()  # the run ends: step 8's read ahead is dropped, never served
    assert ahead.discarded == 2 + 2 + 2  # step 6 (rollback), step 6 (re-plan), step 8 (the end)
    # A resume in a new generation: a fresh reader from step 4 on equals the plain one.
    again = ReadAhead(plain)
    for step in range(4, 7):
        _same(_step(again, step, 0, 1)[1], _step(plain, step, 0, 1)[1])
        again.prefetch(_next_ids(plain, step + 1, 0, 1), SEQ)
    again.close()


class _Recording:
    """A reader that notes which thread reads each microbatch (and can fail once, reading ahead)."""

    has_loss_mask = True  # exercises the masked-pairs path (chat shards, masked mixtures)

    def __init__(self, fail_ahead: bool = False):
        self.threads: list[str] = []
        self.fail_ahead = fail_ahead

    def microbatch(self, ids, seq_len):
        name = threading.current_thread().name
        self.threads.append(name)
        if self.fail_ahead and name.startswith("read-ahead"):
            raise OSError("storage hiccup")
        x = np.repeat(np.asarray(ids, np.int64)[:, None], seq_len, axis=1)
        return x, x + 1


def test_reads_ahead_happen_on_the_background_thread_and_a_failure_there_is_read_again():
    reader = _Recording()
    ahead = ReadAhead(reader)
    ahead.prefetch([np.asarray([1, 2]), np.asarray([3, 4])], SEQ)
    x, y = microbatch_tokens(ahead, np.asarray([3, 4]), SEQ)
    np.testing.assert_array_equal(x[:, 0], [3, 4])
    x, _ = microbatch_tokens(ahead, np.asarray([1, 2]), SEQ)
    np.testing.assert_array_equal(x[:, 0], [1, 2])
    assert ahead.served == 2 and all(t.startswith("read-ahead") for t in reader.threads)
    ahead.close()
    failing = _Recording(fail_ahead=True)
    ahead = ReadAhead(failing)
    ahead.prefetch([np.asarray([7])], SEQ)
    x, _ = microbatch_tokens(ahead, np.asarray([7]), SEQ)  # read again here, where it works
    assert x[0, 0] == 7 and ahead.served == 0 and failing.threads[-1] == threading.current_thread().name
    ahead.close()
