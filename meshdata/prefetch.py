"""Reading the next step's windows ahead, off the training thread (pure numpy + one thread).

``ReadAhead`` wraps a step's reader (a ``TokenSource``, a chat source or a ``Mixture``: whatever
``meshdata.source.microbatch_tokens`` reads) and reads like it, except that the microbatches named
by ``prefetch`` — the next step's, announced once this step's were read — are read on a background
thread meanwhile, so object storage is no longer on every step's critical path (#36 item 13).

One slot: a ``prefetch`` replaces whatever was read ahead before. A read is served from the slot only
when it asks for exactly the sample ids (and window length) read ahead, each once; anything else is
read on the caller's thread, as without the wrapper. The windows are a function of the ids alone, so
a batch read ahead for a step that is then re-planned (another mesh, another split), rolled back or
never trained is simply never asked for: it is dropped with the slot, never trained, and the data
position stays exactly what the driver says. A failure reading ahead is not raised from the
background: the caller's thread reads again and meets it there, as it would have.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from meshdata.source import sample_windows

_WINDOWS, _PAIRS = "windows", "microbatch"  # sample_windows' call, and chat/mixture masked pairs


@dataclass
class _Slot:
    keys: dict[tuple, int]  # (kind, seq_len, ids' bytes) -> position in the future's list, until served
    future: Future


class ReadAhead:
    def __init__(self, reader) -> None:
        self.reader = reader
        self._lock = threading.Lock()
        self._slot: _Slot | None = None
        self._pool: ThreadPoolExecutor | None = None  # made at the first prefetch
        self.served = 0  # microbatches served from a read ahead
        self.discarded = 0  # microbatches read ahead and never asked for (a re-plan, a rollback, the end)

    def __getattr__(self, name: str):
        # Everything else (has_loss_mask, eos_id, num_samples...) is the reader's.
        return getattr(self.reader, name)

    # -- what meshdata.source.microbatch_tokens calls ---------------------------------------------
    def windows(self, ids: np.ndarray, seq_len: int) -> np.ndarray:
        return self._serve(_WINDOWS, ids, seq_len)

    def microbatch(self, ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        return self._serve(_PAIRS, ids, seq_len)

    # -- reading ahead ----------------------------------------------------------------------------
    def prefetch(self, microbatch_ids: Sequence[np.ndarray], seq_len: int) -> None:
        """Start reading ``microbatch_ids`` (the next step's, in order) on the background thread;
        what was read ahead before and not served is dropped."""
        kind = _PAIRS if getattr(self.reader, "has_loss_mask", False) else _WINDOWS
        batches = [np.asarray(ids, np.int64).reshape(-1) for ids in microbatch_ids]
        keys = {_key(kind, ids, seq_len): i for i, ids in enumerate(batches)}
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-ahead")
        future = self._pool.submit(lambda: [self._read(kind, ids, seq_len) for ids in batches])
        with self._lock:
            old, self._slot = self._slot, _Slot(keys, future)
        if old is not None:
            self.discarded += len(old.keys)

    def close(self) -> None:
        """Drop the slot and stop the thread (a read under way finishes on its own, unread)."""
        with self._lock:
            old, self._slot = self._slot, None
        if old is not None:
            self.discarded += len(old.keys)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _serve(self, kind: str, ids: np.ndarray, seq_len: int):
        ids = np.asarray(ids, np.int64).reshape(-1)
        key = _key(kind, ids, seq_len)
        with self._lock:
            slot = self._slot
            at = slot.keys.pop(key, None) if slot is not None else None
        if at is not None:
            try:
                read = slot.future.result()[at]
            except Exception:  # read again below, on this thread, where the error belongs
                read = None
            if read is not None:
                self.served += 1
                return read
        return self._read(kind, ids, seq_len)

    def _read(self, kind: str, ids: np.ndarray, seq_len: int):
        if kind == _PAIRS:
            return self.reader.microbatch(ids, seq_len)
        return sample_windows(self.reader, ids, seq_len)


def _key(kind: str, ids: np.ndarray, seq_len: int) -> tuple:
    return kind, int(seq_len), ids.tobytes()
