"""TokenSource: one flat, lazily read stream of int32 token ids, and the checks a run makes on it.

``open_source(path)`` indexes ``"builtin"``, a local shard directory or a URI (``meshdata.index``)
and reads nothing else; ``read(start, stop)`` then fetches only the row groups that overlap
``[start, stop)``, keeping a few recently used ones (``cache_bytes``) so that neighbouring windows do
not fetch a row group twice. A rank actor therefore holds the index (a few numbers per row group)
plus at most the cache, whatever the corpus size (bench/data_memory.py measures it).

Sample ``i`` of sequence length ``L`` is the window ``tokens[i*L : i*L + L + 1]`` over the rows
concatenated in file order (inputs ``[:-1]``, targets ``[1:]``): a public contract (README, "Data").
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from meshdata.chat_source import ConversationSource
from meshdata.conversations import CONVERSATIONS
from meshdata.errors import DataError
from meshdata.index import DataIndex, build_index, content_identity, read_row_group
from meshdata.storage import REMOTE_TIMEOUT_S, Location, bounded
from meshspeak.locations import local_path

BUILTIN = "builtin"
BUILTIN_FILE = Path(__file__).resolve().parent / "corpus" / "builtin.txt"
BYTE_VOCAB = 256
CACHE_BYTES = 4 * 2**20  # decoded row groups kept per source (16 of 64k tokens): sequential reads hit
OPEN_FILES = 32  # parsed footers (local) / open handles (remote) kept per source


class TokenSource:
    """A token stream. Build with :func:`open_source` or :meth:`from_array` (tests, the built-in corpus)."""

    def __init__(self, index: DataIndex, *, vocab_size: int, location: Location | None = None,
                 memory: np.ndarray | None = None, eos_id: int | None = None, bos_id: int | None = None,
                 cache_bytes: int = CACHE_BYTES) -> None:
        self.index = index
        self.name = index.name  # "builtin", an absolute path or a URI: valid on every node
        self.vocab_size = int(vocab_size)  # the tokenizer's vocab, not the model's
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.num_tokens = index.num_tokens
        self._bounds = np.concatenate([[0], np.cumsum(index.rg_tokens)]).astype(np.int64)
        self._location = location
        self._memory = memory
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._files: OrderedDict[int, object] = OrderedDict()
        self._lock = threading.Lock()  # the step thread and an eval call may read at once

    @classmethod
    def from_array(cls, tokens: np.ndarray, vocab_size: int, name: str, *, eos_id: int | None = None,
                   identity: str | None = None) -> TokenSource:
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        tokens.flags.writeable = False
        ident = identity or hashlib.sha256(tokens.tobytes()).hexdigest()
        index = DataIndex(name, (), np.zeros(1, np.int32), np.zeros(1, np.int32),
                          np.asarray([len(tokens)], np.int64), identity=ident)
        return cls(index, vocab_size=vocab_size, memory=tokens, eos_id=eos_id)

    @property
    def identity(self) -> str:
        """Content identity (what a checkpoint remembers): same data anywhere -> same string."""
        if not self.index.identity:
            self.index = dataclasses.replace(self.index, identity=content_identity(self._location, self.index))
        return self.index.identity

    # -- windows ----------------------------------------------------------------------------------
    def num_samples(self, seq_len: int) -> int:
        # Each sample needs seq_len + 1 tokens; windows overlap by one token (the last target).
        return max(0, (self.num_tokens - 1) // seq_len)

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        if not 0 <= index < self.num_samples(seq_len):
            raise IndexError(f"sample {index} out of range [0, {self.num_samples(seq_len)})")
        return self.read(index * seq_len, index * seq_len + seq_len + 1)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream (int32; a read-only view or a fresh array)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        if self._memory is not None:
            return self._memory[start:stop]
        parts = []
        pos = start
        k = int(np.searchsorted(self._bounds, start, side="right")) - 1
        while pos < stop:
            lo, hi = int(self._bounds[k]), int(self._bounds[k + 1])
            if hi > pos:
                chunk = self._row_group(k)
                parts.append(chunk[pos - lo : min(stop, hi) - lo])
                pos = min(stop, hi)
            k += 1
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def windows_at(self, starts: np.ndarray, width: int) -> np.ndarray:
        """int32 ``[len(starts), width]``: the tokens ``[start, start + width)`` for each start (in
        range), gathered with one numpy index per row group instead of a ``read`` per window (a
        Python loop on the training thread, #36 item 13); a window across a row-group boundary is
        read as ``read`` reads it."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        offsets = np.arange(width, dtype=np.int64)
        if self._memory is not None:
            return self._memory[starts[:, None] + offsets]
        out = np.empty((starts.size, width), np.int32)
        groups = np.searchsorted(self._bounds, starts, side="right") - 1
        inside = starts + width <= self._bounds[groups + 1]
        for k in np.unique(groups[inside]):
            rows = np.flatnonzero(inside & (groups == k))
            out[rows] = self._row_group(int(k))[(starts[rows] - self._bounds[k])[:, None] + offsets]
        for row in np.flatnonzero(~inside):
            out[row] = self.read(int(starts[row]), int(starts[row]) + width)
        return out

    def read_all(self) -> np.ndarray:
        """The whole stream in memory: for tests and small corpora only."""
        return self.read(0, self.num_tokens)

    # -- row groups -------------------------------------------------------------------------------
    def _row_group(self, k: int) -> np.ndarray:
        with self._lock:
            hit = self._cache.get(k)
            if hit is not None:
                self._cache.move_to_end(k)
                return hit
            file_no, rg = int(self.index.rg_file[k]), int(self.index.rg_index[k])
            name = self.index.files[file_no]
            where = f"data.path shard {self._location.uri(name)!r}"
            values = read_row_group(self._parquet(file_no), rg, where)
            want = int(self.index.rg_tokens[k])
            if len(values) != want:
                raise DataError(f"{where} row group {rg} holds {len(values)} tokens but the index says {want}; "
                                "copy the whole directory again or re-run `elastimesh data prepare`")
            values.flags.writeable = False
            self._cache[k] = values
            total = sum(v.nbytes for v in self._cache.values())
            while total > self._cache_bytes and len(self._cache) > 1:
                total -= self._cache.popitem(last=False)[1].nbytes
            return values

    def _parquet(self, file_no: int):
        """A reader for one row-group read. Footers are parsed once per file (kept for OPEN_FILES
        files). Local files get a fresh memory map per read, dropped right after it: a map kept open
        would keep every page it ever touched resident, so a long run over few big shards would
        grow to the size of the corpus. Remote files keep their (unmapped) handle."""
        entry = self._files.get(file_no)
        if entry is None:
            pf = self._location.open_parquet(self.index.files[file_no])
            entry = pf.metadata if self._location.is_local else pf
            self._files[file_no] = entry
            while len(self._files) > OPEN_FILES:
                self._files.popitem(last=False)
        else:
            self._files.move_to_end(file_no)
        if self._location.is_local:
            return self._location.open_parquet(self.index.files[file_no], metadata=entry)
        return entry


def open_source(path: str) -> TokenSource:
    """Open ``"builtin"``, a shard directory or a URI; cached per process, so actors open it once per life."""
    if path == BUILTIN:
        return _open_cached(BUILTIN)
    lp = local_path(str(path))
    if lp is not None:
        return _open_cached(os.path.abspath(os.path.expanduser(lp)))
    return _open_cached(str(path).rstrip("/"))


@functools.lru_cache(maxsize=8)
def _open_cached(path: str) -> TokenSource:
    return _open(path, check_files=False)


def _open(path: str, *, check_files: bool) -> TokenSource:
    if path == BUILTIN:
        raw = np.frombuffer(BUILTIN_FILE.read_bytes(), dtype=np.uint8).astype(np.int32)
        return TokenSource.from_array(raw, BYTE_VOCAB, BUILTIN)
    loc = Location(path)
    index = build_index(loc, check_files=check_files) if loc.is_local else bounded(
        lambda: build_index(loc, check_files=check_files), REMOTE_TIMEOUT_S, f"data.path = {path!r}")
    meta = index.meta
    tok = meta.get("tokenizer")
    tok = tok if isinstance(tok, dict) else {}
    vocab = meta.get("vocab_size", tok.get("vocab_size"))
    if vocab is None:  # third-party shards without a sidecar: the largest id is all we know
        top = index.max_token_id
        vocab = (top + 1) if top is not None and top >= 0 else 0
    if meta.get("samples") == CONVERSATIONS:  # data prepare --chat: a sample is a conversation
        return ConversationSource(index, loc, vocab_size=int(vocab), eos_id=tok.get("eos_id"),
                                  bos_id=tok.get("bos_id"))
    return TokenSource(index, vocab_size=int(vocab), location=loc, eos_id=tok.get("eos_id"),
                       bos_id=tok.get("bos_id"))


def clear_cache() -> None:
    """Forget opened sources (after ``data prepare`` rewrote a directory in this process)."""
    _open_cached.cache_clear()


def validate_source(path: str, seq_len: int, vocab_size: int, global_batch_size: int) -> TokenSource:
    """Open ``path`` (every shard's footer checked) and check it can feed this model and batch.

    Raises :class:`DataError` otherwise. Reads no tokens: counts and the largest id come from the
    sidecar or the footers.
    """
    if seq_len < 1:
        raise DataError(f"model.seq_len = {seq_len} must be >= 1", key="model.seq_len")
    if global_batch_size < 1:
        raise DataError(f"train.global_batch_size = {global_batch_size} must be >= 1",
                        key="train.global_batch_size")
    src = open_source(path)
    if src.name != BUILTIN:
        src = _open(src.name, check_files=True)  # the driver pays for the footers once per run
    if getattr(src, "has_loss_mask", False):
        src.check_fits(seq_len, global_batch_size)
    if src.num_tokens == 0:
        raise DataError(f"data.path = {src.name!r} holds zero tokens; prepare it from non-empty text "
                        "files or use data.path = \"builtin\"")
    n = src.num_samples(seq_len)
    if n < global_batch_size:
        raise DataError(f"data.path = {src.name!r} has {src.num_tokens} tokens = {n} samples of "
                        f"model.seq_len {seq_len}, fewer than one global batch ({global_batch_size}); "
                        "add data, or lower train.global_batch_size or model.seq_len")
    if src.vocab_size > vocab_size:
        what = ("contains token ids up to " + str(src.vocab_size - 1) if not src.index.meta
                else f"was tokenized with a vocab of {src.vocab_size}")
        raise DataError(f"model.vocab_size = {vocab_size} but data.path = {src.name!r} {what}; set "
                        f"model.vocab_size >= {src.vocab_size}", key="model.vocab_size")
    return src


def microbatch_tokens(source: TokenSource, ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), both int64 ``[len(ids), seq_len]`` (int64 is what embedding/CE want).
    Chat shards' targets come masked (meshdata.chat_source)."""
    if getattr(source, "has_loss_mask", False):
        return source.microbatch(ids, seq_len)
    windows = sample_windows(source, ids, seq_len).astype(np.int64)
    return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])


def sample_windows(source: TokenSource, ids: np.ndarray, seq_len: int) -> np.ndarray:
    """int32 ``[len(ids), seq_len + 1]``: sample ``i``'s window for each id (``source`` may be a
    ``meshdata.mixture.Mixture``: its ids then name (source, sample) pairs)."""
    if not isinstance(source, TokenSource):
        return source.windows(ids, seq_len)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    n = source.num_samples(seq_len)
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        raise IndexError(f"sample ids must lie in [0, {n}), got [{ids.min()}, {ids.max()}]")
    return source.windows_at(ids * seq_len, seq_len + 1)
