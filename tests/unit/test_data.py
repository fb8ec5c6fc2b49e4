"""Unit tests for meshdata/: sources, validation errors, and the mesh-independent sample order."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshdata import (
    BUILTIN,
    DataError,
    TokenSource,
    global_sample_ids,
    microbatch_tokens,
    open_source,
    prepare,
    replica_microbatches,
    sample_order,
    validate_source,
)


def _write_shard(path, rows, type_=pa.list_(pa.int32()), column="tokens"):
    pq.write_table(pa.table({column: pa.array(rows, type=type_)}), str(path))


def _assert_error(exc: DataError, key: str = "data.path"):
    msg = str(exc)
    assert exc.key == key
    assert key in msg
    assert "\n" not in msg
    # every message carries a remedy, phrased as an instruction
    assert any(w in msg for w in ("set ", "prepare", "choose", "lower", "add ", "delete", "copy", "rewrite"))


# --- built-in corpus ---------------------------------------------------------------------------------------

def test_builtin_opens_with_enough_samples():
    src = open_source(BUILTIN)
    assert src.name == BUILTIN and src.vocab_size == 256
    tokens = src.read_all()
    assert tokens.dtype == np.int32 and tokens.ndim == 1
    assert src.num_samples(64) >= 4000
    assert 0 <= tokens.min() and tokens.max() < 128  # ASCII text
    assert open_source(BUILTIN) is src  # cached per process
    assert not tokens.flags.writeable
    assert validate_source(BUILTIN, 64, 256, 32) is src


def test_sample_and_microbatch_tokens_shift_by_one():
    src = TokenSource.from_array(np.arange(100, dtype=np.int32), 256, "t")
    assert src.num_samples(10) == 9  # (100 - 1) // 10
    np.testing.assert_array_equal(src.sample(2, 10), np.arange(20, 31))
    x, y = microbatch_tokens(src, np.array([2, 0]), 10)
    assert x.dtype == np.int64 and y.dtype == np.int64 and x.shape == (2, 10)
    np.testing.assert_array_equal(x[0], np.arange(20, 30))
    np.testing.assert_array_equal(y[0], np.arange(21, 31))
    np.testing.assert_array_equal(x[1], np.arange(0, 10))
    with pytest.raises(IndexError):
        microbatch_tokens(src, np.array([9]), 10)
    with pytest.raises(IndexError):
        src.sample(9, 10)


# --- sample order ------------------------------------------------------------------------------------------

def test_sample_order_depends_only_on_seed_and_epoch():
    a = sample_order(7, 0, 1000)
    np.testing.assert_array_equal(a, sample_order(7, 0, 1000))
    np.testing.assert_array_equal(np.sort(a), np.arange(1000))
    assert not np.array_equal(a, sample_order(7, 1, 1000))
    assert not np.array_equal(a, sample_order(8, 0, 1000))
    np.testing.assert_array_equal(a, np.random.default_rng([7, 0]).permutation(1000))


def test_steps_cover_each_epoch_exactly_once():
    n, g = 96, 16  # 6 steps per epoch
    ids = np.concatenate([global_sample_ids(k, g, 3, n) for k in range(1, 13)])
    np.testing.assert_array_equal(ids[:n], sample_order(3, 0, n))
    np.testing.assert_array_equal(ids[n:], sample_order(3, 1, n))


def test_epoch_straddle():
    n, g = 10, 4  # step 3 takes positions 8..11: two from epoch 0, two from epoch 1
    ids = global_sample_ids(3, g, 5, n)
    np.testing.assert_array_equal(ids, np.concatenate([sample_order(5, 0, n)[8:], sample_order(5, 1, n)[:2]]))
    # a batch larger than the dataset spans several epochs
    big = global_sample_ids(1, 25, 5, n)
    np.testing.assert_array_equal(big, np.concatenate([sample_order(5, e, n) for e in range(3)])[:25])
    with pytest.raises(ValueError):
        global_sample_ids(0, g, 5, n)


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 6])
def test_replica_split_concatenates_to_global_batch(dp):
    n, g, mbs, seed = 1000, 48, 2, 11
    used = []
    for step in range(1, 40):  # 39 * 48 = 1872 positions: crosses the epoch boundary mid-batch
        parts = []
        for r in range(dp):
            mbs_list = replica_microbatches(step, g, mbs, r, dp, seed, n)
            assert len(mbs_list) == g // dp // mbs
            assert all(m.shape == (mbs,) for m in mbs_list)
            parts.extend(mbs_list)
        got = np.concatenate(parts)
        np.testing.assert_array_equal(got, global_sample_ids(step, g, seed, n))
        used.append(got)
    flat = np.concatenate(used)
    np.testing.assert_array_equal(np.sort(flat[:n]), np.arange(n))  # epoch 0: each sample exactly once


def test_replica_split_requires_divisibility():
    with pytest.raises(ValueError, match="multiple"):
        replica_microbatches(1, 10, 2, 0, 3, 0, 100)
    with pytest.raises(ValueError):
        replica_microbatches(1, 12, 2, 3, 3, 0, 100)


# --- prepare / open round trip -----------------------------------------------------------------------------

def test_prepare_round_trip(tmp_path):
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    c = tmp_path / "empty.txt"
    a.write_bytes("héllo wörld\r\nline two\n".encode() * 5000)  # > 65536 bytes: split into rows
    b.write_bytes(b"second document\n")
    c.write_bytes(b"")
    out = tmp_path / "shards"
    meta = prepare([str(a), str(c), str(b)], str(out), shard_tokens=50_000)
    expected = a.read_bytes() + b.read_bytes()
    assert meta["format"] == 2 and meta["tokenizer"]["kind"] == "bytes" and meta["vocab_size"] == 256
    assert meta["tokenizer"]["eos_id"] is None and meta["documents"] == 2
    assert meta["num_tokens"] == len(expected)
    assert len(meta["files"]) >= 2 and meta["files"][0] == "shard-00000.parquet"
    assert json.loads((out / "elastimesh-data.json").read_text()) == meta
    for f in meta["files"]:
        t = pq.read_table(str(out / f))
        assert t.schema.field("tokens").type == pa.list_(pa.int32())
        assert max(len(r) for r in t.column("tokens").to_pylist()) <= 65536
    src = open_source(str(out))
    assert src.read_all().tobytes() == np.frombuffer(expected, np.uint8).astype(np.int32).tobytes()
    assert bytes(src.read_all().astype(np.uint8)) == expected
    assert src.name == str(out) and src.vocab_size == 256
    checked = validate_source(str(out), 16, 256, 8)
    assert checked.identity == src.identity and checked.num_tokens == len(expected)


def test_prepare_reencodes_to_utf8(tmp_path):
    f = tmp_path / "latin.txt"
    f.write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match="--encoding"):
        prepare([str(f)], str(tmp_path / "o1"))
    prepare([str(f)], str(tmp_path / "o2"), encoding="latin-1")
    assert bytes(open_source(str(tmp_path / "o2")).read_all().astype(np.uint8)) == "café".encode()


def test_prepare_refusals(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("some text\n")
    with pytest.raises(DataError, match="missing.txt"):
        prepare([str(tmp_path / "missing.txt")], str(tmp_path / "o"))
    out = tmp_path / "o"
    prepare([str(f)], str(out))
    with pytest.raises(DataError, match="choose an empty --out") as ei:
        prepare([str(f)], str(out))
    assert "is not empty" in str(ei.value)
    other = tmp_path / "other"
    other.mkdir()
    _write_shard(other / "x.parquet", [[1, 2]])
    with pytest.raises(DataError, match="choose an empty --out"):
        prepare([str(f)], str(other))


# --- validation errors -------------------------------------------------------------------------------------

def test_error_missing_path(tmp_path):
    with pytest.raises(DataError) as ei:
        validate_source(str(tmp_path / "nope"), 16, 256, 4)
    _assert_error(ei.value)
    assert "does not exist" in str(ei.value)


def test_error_file_instead_of_dir(tmp_path):
    f = tmp_path / "f.parquet"
    _write_shard(f, [[1, 2, 3]])
    with pytest.raises(DataError, match="not a directory") as ei:
        validate_source(str(f), 16, 256, 4)
    _assert_error(ei.value)


def test_error_empty_dir(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="no \\*.parquet") as ei:
        validate_source(str(tmp_path), 16, 256, 4)
    _assert_error(ei.value)


def test_error_corrupt_parquet_names_file(tmp_path):
    _write_shard(tmp_path / "a.parquet", [list(range(100))])
    (tmp_path / "b.parquet").write_bytes(b"this is not parquet at all" * 10)
    with pytest.raises(DataError, match="b.parquet") as ei:
        validate_source(str(tmp_path), 16, 256, 4)
    _assert_error(ei.value)


def test_error_missing_column(tmp_path):
    _write_shard(tmp_path / "a.parquet", [[1, 2, 3]], column="ids")
    with pytest.raises(DataError, match="'tokens' column") as ei:
        validate_source(str(tmp_path), 16, 256, 4)
    _assert_error(ei.value)


def test_error_zero_tokens(tmp_path):
    _write_shard(tmp_path / "a.parquet", [[]])
    with pytest.raises(DataError, match="zero tokens") as ei:
        validate_source(str(tmp_path), 16, 256, 4)
    _assert_error(ei.value)


def test_error_token_beyond_vocab(tmp_path):
    _write_shard(tmp_path / "a.parquet", [list(range(200)), [300] * 100])
    src = open_source(str(tmp_path))
    assert src.vocab_size == 301  # no sidecar: inferred from the largest id
    with pytest.raises(DataError) as ei:
        validate_source(str(tmp_path), 16, 256, 4)
    _assert_error(ei.value, key="model.vocab_size")
    assert "301" in str(ei.value)
    assert validate_source(str(tmp_path), 16, 512, 4).vocab_size == 301


def test_error_too_few_samples(tmp_path):
    _write_shard(tmp_path / "a.parquet", [list(range(100))])  # 99 // 16 = 6 samples
    with pytest.raises(DataError, match="6 samples") as ei:
        validate_source(str(tmp_path), 16, 256, 8)
    _assert_error(ei.value)
    assert validate_source(str(tmp_path), 16, 256, 6).num_samples(16) == 6


def test_error_sidecar_mismatch(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("abc" * 100)
    out = tmp_path / "o"
    prepare([str(f)], str(out))
    meta = json.loads((out / "elastimesh-data.json").read_text())
    meta["num_tokens"] += 1
    (out / "elastimesh-data.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="says") as ei:
        open_source(str(out))
    _assert_error(ei.value)


def test_data_error_pickles():
    e = DataError("model.vocab_size = 1 too small; set model.vocab_size >= 256", key="model.vocab_size")
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is DataError and str(e2) == str(e) and e2.key == "model.vocab_size"
    assert isinstance(e2, ValueError)
    assert pickle.loads(pickle.dumps(DataError("x"))).key == "data.path"
