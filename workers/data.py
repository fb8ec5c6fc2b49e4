"""Token data for elastimesh: the built-in corpus, Parquet token shards, and the global sample order.

This module is pure numpy + pyarrow (no torch, no ray) because both sides use it: the driver validates
``data.path`` before starting any actor and implements ``elastimesh data prepare``; each actor opens the
same source and materialises only the microbatches it is told to.

Data model
----------
A source is one flat stream of int32 token ids. ``data.path = "builtin"`` is the shipped synthetic
English corpus (``corpus/builtin.txt``, byte tokens, vocab 256). Otherwise ``data.path`` is a directory of
``*.parquet`` files, read in sorted file-name order (names starting with ``.`` or ``_`` are skipped, as
Spark/Arrow writers use them for temporaries), each with one column ``tokens: list<int32>`` holding one
document (or a piece of one) per row. Rows are concatenated in order with no separator: a document ends
where its text ends, so put a newline or an end-of-text token in the data if the model should see
boundaries. An optional ``elastimesh-data.json`` sidecar (written last by :func:`prepare`) gives the
tokenizer's vocab size and the token count, which is checked so a half-copied directory is refused.

Sample order (docs/design.md, "Global batch semantics")
-------------------------------------------------------
Sample ``i`` is the non-overlapping window ``tokens[i*L : i*L + L + 1]`` (inputs ``[:-1]``, targets
``[1:]``). Epoch ``e`` visits samples in ``default_rng([seed, e]).permutation(n)``; the epochs are chained
into one infinite sequence and optimizer step ``k`` (from 1) takes positions ``[(k-1)*G, k*G)``. The
step's ids are cut into DP replicas by contiguous slices and each slice into microbatches, so the union
over any mesh is the same set of samples: a resize mid-run changes who computes what, never what.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

BUILTIN = "builtin"
BUILTIN_FILE = Path(__file__).with_name("corpus") / "builtin.txt"
SIDECAR = "elastimesh-data.json"
FORMAT_VERSION = 1
BYTE_VOCAB = 256
MAX_ROW_TOKENS = 65536  # keeps a row (and a Parquet page) small for huge single-document inputs
_FIX_PATH = 'set data.path to "builtin" or to a directory made by `elastimesh data prepare TEXT... --out DIR`'


class DataError(ValueError):
    """A bad data source or data-related config value; ``key`` names the config key at fault.

    The message is one actionable line (what is wrong, and the fix) so the CLI can print it as-is and
    exit 2. It crosses process boundaries (Ray actor -> driver), hence the explicit ``__reduce__``:
    the default would drop ``key``.
    """

    key = "data.path"

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        if key is not None:
            self.key = key

    def __reduce__(self):
        return (type(self), (str(self), self.key))


@dataclass(frozen=True, eq=False)  # eq=False: identity hash; comparing token arrays is never wanted
class TokenSource:
    tokens: np.ndarray  # int32, 1-D, read-only (shared by every caller through the cache)
    vocab_size: int  # the tokenizer's vocab (256 for bytes), not the model's
    name: str  # "builtin" or the absolute directory path; safe to hand to actors on other cwds

    def num_samples(self, seq_len: int) -> int:
        # Each sample needs seq_len + 1 tokens; windows overlap by one token (the last target).
        return max(0, (len(self.tokens) - 1) // seq_len)

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        if not 0 <= index < self.num_samples(seq_len):
            raise IndexError(f"sample {index} out of range [0, {self.num_samples(seq_len)})")
        start = index * seq_len
        return self.tokens[start : start + seq_len + 1]


def open_source(path: str) -> TokenSource:
    """Open ``"builtin"`` or a shard directory; cached per process, so actors load it once per life."""
    if path == BUILTIN:
        return _open_cached(BUILTIN)
    return _open_cached(os.path.abspath(os.path.expanduser(str(path))))


@functools.lru_cache(maxsize=8)
def _open_cached(path: str) -> TokenSource:
    if path == BUILTIN:
        raw = np.frombuffer(BUILTIN_FILE.read_bytes(), dtype=np.uint8)
        return TokenSource(_readonly(raw.astype(np.int32)), BYTE_VOCAB, BUILTIN)
    if not os.path.exists(path):
        raise DataError(f"data.path = {path!r} does not exist; {_FIX_PATH}")
    if not os.path.isdir(path):
        raise DataError(f"data.path = {path!r} is a file, not a directory of Parquet shards; {_FIX_PATH}")
    files = sorted(f for f in os.listdir(path) if f.endswith(".parquet") and not f.startswith((".", "_")))
    if not files:
        raise DataError(f"data.path = {path!r} contains no *.parquet files; {_FIX_PATH}")
    sidecar = _read_sidecar(path)
    missing = [f for f in sidecar.get("files", []) if f not in files]
    if missing:
        raise DataError(f"data.path = {path!r} is missing shard {missing[0]!r} listed in {SIDECAR}; "
                        "copy the whole directory again or re-run `elastimesh data prepare`")
    parts = [_read_shard(os.path.join(path, f)) for f in files]
    tokens = np.concatenate(parts)
    expected = sidecar.get("num_tokens")
    if expected is not None and int(expected) != len(tokens):
        raise DataError(f"data.path = {path!r}: {SIDECAR} says {expected} tokens but the shards hold "
                        f"{len(tokens)}; copy the whole directory again or re-run `elastimesh data prepare`")
    vocab = sidecar.get("vocab_size")
    if vocab is None:  # third-party shards without a sidecar: the largest id is all we know
        vocab = int(tokens.max()) + 1 if len(tokens) else 0
    return TokenSource(_readonly(tokens), int(vocab), path)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _read_sidecar(path: str) -> dict:
    f = os.path.join(path, SIDECAR)
    if not os.path.exists(f):
        return {}
    try:
        meta = json.loads(Path(f).read_text())
        fmt = meta["format"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"data.path = {path!r}: unreadable {SIDECAR} ({e}); delete it or re-run "
                        "`elastimesh data prepare`") from None
    if fmt != FORMAT_VERSION:
        raise DataError(f"data.path = {path!r}: {SIDECAR} has format {fmt!r}, this elastimesh reads "
                        f"format {FORMAT_VERSION}; re-run `elastimesh data prepare` with this version")
    return meta


def _read_shard(f: str) -> np.ndarray:
    where = f"data.path shard {f!r}"
    try:
        schema = pq.read_schema(f)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{where} is not a readable Parquet file ({_one_line(e)}); delete or "
                        "regenerate it with `elastimesh data prepare`") from None
    if "tokens" not in schema.names:
        raise DataError(f"{where} has no 'tokens' column (columns: {schema.names}); shards need one "
                        "column `tokens: list<int32>`, e.g. from `elastimesh data prepare`")
    t = schema.field("tokens").type
    if not ((pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)):
        raise DataError(f"{where}: column 'tokens' has type {t}, expected list<int32>; rewrite the "
                        "shard with `elastimesh data prepare`")
    try:
        col = pq.read_table(f, columns=["tokens"]).column("tokens")
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{where} is corrupt ({_one_line(e)}); delete or regenerate it") from None
    # flatten() honours list offsets and skips null rows; null *values* inside a row are an error.
    values = [c.flatten() for c in col.chunks]
    if any(v.null_count for v in values):
        raise DataError(f"{where} has null token ids; rewrite it without nulls")
    arr = np.concatenate([v.to_numpy(zero_copy_only=False) for v in values]) if values else np.zeros(0)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise DataError(f"{where} has token ids outside [0, 2^31); fix the tokenizer output")
    return arr.astype(np.int32, copy=False)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]


def validate_source(path: str, seq_len: int, vocab_size: int, global_batch_size: int) -> TokenSource:
    """Open ``path`` and check it can feed this model and batch; raises :class:`DataError` otherwise."""
    if seq_len < 1:
        raise DataError(f"model.seq_len = {seq_len} must be >= 1", key="model.seq_len")
    if global_batch_size < 1:
        raise DataError(f"train.global_batch_size = {global_batch_size} must be >= 1",
                        key="train.global_batch_size")
    src = open_source(path)
    if len(src.tokens) == 0:
        raise DataError(f"data.path = {src.name!r} holds zero tokens; prepare it from non-empty text "
                        "files or use data.path = \"builtin\"")
    n = src.num_samples(seq_len)
    if n < global_batch_size:
        raise DataError(f"data.path = {src.name!r} has {len(src.tokens)} tokens = {n} samples of "
                        f"model.seq_len {seq_len}, fewer than one global batch ({global_batch_size}); "
                        "add data, or lower train.global_batch_size or model.seq_len")
    top = int(src.tokens.max())
    if top >= vocab_size:
        raise DataError(f"model.vocab_size = {vocab_size} but data.path = {src.name!r} contains token id "
                        f"{top} (tokenizer vocab {src.vocab_size}); set model.vocab_size >= "
                        f"{max(top + 1, src.vocab_size)}", key="model.vocab_size")
    return src


def sample_order(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """The visiting order of epoch ``epoch``: a function of (seed, epoch) only, never of the mesh."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


@functools.lru_cache(maxsize=4)
def _order_cached(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    # Every step of an epoch needs the same permutation; recomputing it costs O(n) per step.
    return _readonly(sample_order(seed, epoch, num_samples))


def global_sample_ids(step: int, global_batch_size: int, seed: int, num_samples: int) -> np.ndarray:
    """Sample ids of optimizer step ``step`` (from 1): positions [(step-1)*G, step*G) of the epoch chain."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if global_batch_size < 1 or num_samples < 1:
        raise ValueError(f"need global_batch_size >= 1 and num_samples >= 1, got "
                         f"{global_batch_size}, {num_samples}")
    start, end = (step - 1) * global_batch_size, step * global_batch_size
    pieces = []
    pos = start
    while pos < end:  # a batch may straddle one (or, if G > n, several) epoch boundaries
        epoch, off = divmod(pos, num_samples)
        take = min(end - pos, num_samples - off)
        pieces.append(_order_cached(seed, epoch, num_samples)[off : off + take])
        pos += take
    return np.concatenate(pieces)


def replica_microbatches(step: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp: int,
                         seed: int, num_samples: int) -> list[np.ndarray]:
    """Replica ``dp_rank``'s microbatches of step ``step``: a contiguous G/dp slice, in order."""
    if dp < 1 or micro_batch_size < 1 or global_batch_size % (dp * micro_batch_size):
        raise ValueError(f"train.global_batch_size ({global_batch_size}) must be a multiple of "
                         f"mesh.dp ({dp}) x train.micro_batch_size ({micro_batch_size})")
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank {dp_rank} out of range [0, {dp})")
    per = global_batch_size // dp
    ids = global_sample_ids(step, global_batch_size, seed, num_samples)[dp_rank * per : (dp_rank + 1) * per]
    return [ids[i : i + micro_batch_size].copy() for i in range(0, per, micro_batch_size)]


def microbatch_tokens(source: TokenSource, ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), both int64 ``[len(ids), seq_len]`` (int64 is what embedding/CE want)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    n = source.num_samples(seq_len)
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        raise IndexError(f"sample ids must lie in [0, {n}), got [{ids.min()}, {ids.max()}]")
    windows = source.tokens[ids[:, None] * seq_len + np.arange(seq_len + 1)].astype(np.int64)
    return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])


def prepare(texts: Sequence[str], out_dir: str, shard_tokens: int = 1_000_000,
            encoding: str = "utf-8") -> dict:
    """``elastimesh data prepare TEXT... --out DIR``: byte-tokenize text files into Parquet shards.

    Each file is one document (its text re-encoded as UTF-8, one token per byte), split into rows of at
    most 65536 tokens; rows are packed into ``shard-00000.parquet``, ... of about ``shard_tokens`` tokens
    (rows never span shards). The sidecar is written last, atomically, so its presence marks a finished
    directory. Returns the sidecar dict.
    """
    key = "data.prepare"
    if not texts:
        raise DataError("data prepare needs at least one TEXT file", key=key)
    for t in texts:
        if not os.path.isfile(t):
            raise DataError(f"data prepare: input {t!r} is not an existing file; pass text files that "
                            "exist", key=key)
    if all(os.path.getsize(t) == 0 for t in texts):
        raise DataError("data prepare: every input file is empty; pass files with text", key=key)
    if shard_tokens < 1:
        raise DataError(f"data prepare: shard_tokens = {shard_tokens} must be >= 1", key=key)
    out = Path(os.path.expanduser(out_dir))
    if out.exists() and not out.is_dir():
        raise DataError(f"data prepare: --out {str(out)!r} is a file; choose an empty --out directory",
                        key=key)
    if out.is_dir() and any(p.suffix == ".parquet" or p.name == SIDECAR for p in out.iterdir()):
        raise DataError(f"data prepare: --out {str(out)!r} already contains shards; choose an empty --out "
                        "directory (or delete the old shards)", key=key)
    out.mkdir(parents=True, exist_ok=True)

    files: list[str] = []
    rows: list[np.ndarray] = []
    pending = total = 0

    def flush() -> None:
        nonlocal rows, pending
        if not rows:
            return
        name = f"shard-{len(files):05d}.parquet"
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int32, count=len(rows))
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        lists = pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(rows), type=pa.int32()))
        pq.write_table(pa.table({"tokens": lists}), str(out / name))
        files.append(name)
        rows, pending = [], 0

    for t in texts:
        try:
            data = Path(t).read_bytes().decode(encoding).encode("utf-8")  # bytes, not text mode: keep \r\n
        except (UnicodeDecodeError, LookupError) as e:
            raise DataError(f"data prepare: cannot decode {t!r} as {encoding} ({_one_line(e)}); pass the "
                            "file's real encoding with --encoding", key=key) from None
        doc = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
        for i in range(0, len(doc), MAX_ROW_TOKENS):
            rows.append(doc[i : i + MAX_ROW_TOKENS])
            pending += len(rows[-1])
            total += len(rows[-1])
            if pending >= shard_tokens:
                flush()
    flush()

    meta = {"format": FORMAT_VERSION, "tokenizer": "bytes", "vocab_size": BYTE_VOCAB, "num_tokens": total,
            "files": files}
    tmp = out / (SIDECAR + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, out / SIDECAR)
    # A stale cached open of this directory (e.g. a failed one) must not hide the new shards.
    _open_cached.cache_clear()
    return meta
