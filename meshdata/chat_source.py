"""ConversationSource: shards of ``data prepare --chat``, where a sample is one conversation.

Sample ``i`` is row ``i`` (in file order) padded to the window: inputs ``tokens[:-1]``, targets
``tokens[1:]``, a target counted only where the row's ``loss_mask`` is 1 (the assistant's tokens and
its end-of-turn token), the rest of the window padding whose targets never count (IGNORE). One
conversation per sample, never packed with another: the model's attention is causal, so a
conversation at the start of its window sees only itself (padding comes after it), and the
positions start at 0 as in ``apply_chat_template``'s single conversation. Packing several into one
window would need an attention mask that stops at conversation boundaries inside the model, which
the model families do not take; padding costs compute on the padded positions instead.

The global sample order, the DP/microbatch cut and the loss normalisation (sum over counted targets
divided by their global count, workers/batching.py) are those of every source, so any mesh, and
any resize, computes the same step as one process. A conversation longer than ``seq_len + 1``
tokens is refused before the run starts (``check_fits``), never truncated (meshdata.conversations).

Reads are lazy like ``TokenSource``'s: the sidecar's row-group row and token counts locate a row;
only its row group is read, a few recent ones kept (``cache_bytes``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from meshdata.errors import DataError, one_line
from meshdata.index import SIDECAR, DataIndex
from meshdata.storage import Location

CACHE_BYTES = 4 * 2**20
# Cross-entropy's ignore_index, the same as meshdata.masks.IGNORE (a test keeps them equal): masks
# opens sources (mask_eos_for), so importing it here would make an import cycle.
IGNORE = -100
_FIX_COPY = "copy the whole directory again or re-run `elastimesh data prepare --chat`"


class ConversationSource:
    """Chat shards (sidecar ``"samples": "conversations"``): a sample is a conversation with its loss mask."""

    has_loss_mask = True  # targets come masked from the data (workers/batching.py counts them globally)

    def __init__(self, index: DataIndex, location: Location, *, vocab_size: int, eos_id: int | None,
                 bos_id: int | None, cache_bytes: int = CACHE_BYTES) -> None:
        self.index = index
        self.name = index.name
        self.vocab_size = int(vocab_size)
        self.eos_id = eos_id  # the tokenizer's, for the record: rows hold no added EOS
        self.bos_id = bos_id
        self.num_tokens = index.num_tokens
        self.pad_id = int(eos_id or 0)  # any id: padding is never attended to by a real token, never counted
        self.identity = index.identity  # the sidecar's hash (chat shards always have one)
        self._location = location
        shards = index.meta.get("shards") or {}
        rows = []
        for name in index.files:
            counts = (shards.get(name) or {}).get("row_group_rows")
            if counts is None:
                raise DataError(f"data.path = {self.name!r}: {SIDECAR} has no row_group_rows for shard {name!r}; "
                                + _FIX_COPY)
            rows.extend(int(c) for c in counts)
        if len(rows) != len(index.rg_tokens):
            raise DataError(f"data.path = {self.name!r}: {SIDECAR} row-group counts do not match the shards; {_FIX_COPY}")
        self._row_bounds = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self.num_conversations = int(self._row_bounds[-1])
        self.longest = int((index.meta.get("chat") or {}).get("longest", 0))
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()  # the step thread and an eval call may read at once

    def num_samples(self, seq_len: int) -> int:
        """Conversations, whatever ``seq_len`` (each fits one window: ``check_fits``)."""
        return self.num_conversations

    def conversation(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``i``: (int32 token ids, int8 loss mask)."""
        if not 0 <= i < self.num_conversations:
            raise IndexError(f"conversation {i} out of range [0, {self.num_conversations})")
        k = int(np.searchsorted(self._row_bounds, i, side="right")) - 1
        offsets, tokens, masks = self._row_group(k)
        r = i - int(self._row_bounds[k])
        lo, hi = int(offsets[r]), int(offsets[r + 1])
        return tokens[lo:hi], masks[lo:hi]

    def microbatch(self, ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), int64 ``[len(ids), seq_len]``: each conversation shifted by one, padded;
        a target counts (is not IGNORE) only where the mask is 1 on the token it predicts."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        inputs = np.full((ids.size, seq_len), self.pad_id, np.int64)
        targets = np.full((ids.size, seq_len), IGNORE, np.int64)
        for row, i in enumerate(ids.tolist()):
            tokens, mask = self.conversation(i)
            n = max(0, len(tokens) - 1)
            if n > seq_len:
                raise DataError(f"data.path = {self.name!r}: conversation {i} has {len(tokens)} tokens, more than "
                                f"model.seq_len {seq_len} + 1; raise model.seq_len", key="model.seq_len")
            inputs[row, :n] = tokens[:-1]
            targets[row, :n] = np.where(mask[1:] == 1, tokens[1:], IGNORE)
        return inputs, targets

    def check_fits(self, seq_len: int, global_batch_size: int) -> None:
        """Every conversation fits a window of ``seq_len`` (at most ``seq_len + 1`` tokens) and there is
        at least one global batch of them; DataError (counting the ones that do not fit) otherwise."""
        if self.longest > seq_len + 1:
            lengths = self.lengths()
            over = int(np.count_nonzero(lengths > seq_len + 1))
            raise DataError(f"data.path = {self.name!r}: {over} of {len(lengths)} conversations have more than "
                            f"model.seq_len {seq_len} + 1 tokens (the longest {int(lengths.max())}); conversations are "
                            f"refused, not truncated: set model.seq_len >= {int(lengths.max()) - 1} or prepare the "
                            "data without them", key="model.seq_len")
        if self.num_conversations < global_batch_size:
            raise DataError(f"data.path = {self.name!r} holds {self.num_conversations} conversations, fewer than one "
                            f"global batch ({global_batch_size}); add data or lower train.global_batch_size")

    def lengths(self) -> np.ndarray:
        """Every conversation's token count (reads the shards' list offsets: the error path only)."""
        import pyarrow.compute as pc

        out = []
        for name in self.index.files:
            column = self._location.open_parquet(name).read(columns=["tokens"]).column("tokens")
            out.append(pc.list_value_length(column).to_numpy(zero_copy_only=False))
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)

    def _row_group(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        with self._lock:
            hit = self._cache.get(k)
            if hit is not None:
                self._cache.move_to_end(k)
                return hit
            entry = self._read(k)
            self._cache[k] = entry
            total = sum(t.nbytes + m.nbytes for _, t, m in self._cache.values())
            while total > self._cache_bytes and len(self._cache) > 1:
                _, t, m = self._cache.popitem(last=False)[1]
                total -= t.nbytes + m.nbytes
            return entry

    def _read(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        import pyarrow as pa

        name = self.index.files[int(self.index.rg_file[k])]
        rg = int(self.index.rg_index[k])
        where = f"data.path shard {self._location.uri(name)!r}"
        try:
            table = self._location.open_parquet(name).read_row_group(rg, columns=["tokens", "loss_mask"])
            tokens, masks = (table.column(c).combine_chunks() for c in ("tokens", "loss_mask"))
        except (pa.ArrowException, OSError, KeyError) as e:
            raise DataError(f"{where} is corrupt or has no loss_mask column ({one_line(e)}); {_FIX_COPY}") from None
        offsets = tokens.offsets.to_numpy()
        offsets = offsets - offsets[0]
        values = tokens.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
        mask = masks.flatten().to_numpy(zero_copy_only=False).astype(np.int8)
        rows = int(self._row_bounds[k + 1] - self._row_bounds[k])
        if len(offsets) != rows + 1 or len(values) != int(self.index.rg_tokens[k]) or len(mask) != len(values):
            raise DataError(f"{where} row group {rg} does not match {SIDECAR} (rows, tokens or mask length); {_FIX_COPY}")
        return offsets, values, mask
