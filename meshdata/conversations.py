"""``data prepare --chat``: conversations -> one row each, ``tokens`` with a ``loss_mask`` beside them.

Each row of the input is ``{"messages": [{"role", "content"}, ...]}`` (``meshdata.inputs.read_rows``),
checked and rendered with the tokenizer's chat template (``meshdata.chat``); its row holds exactly
the ids transformers' ``apply_chat_template(tokenize=True)`` gives, and its mask is 1 exactly where
``return_assistant_tokens_mask`` says (the template's ``{% generation %}`` blocks: the assistant's
content and end-of-turn token). No EOS is added: the template writes the turn ends.

A conversation of more than ``seq_len + 1`` tokens (a sample's ``seq_len`` inputs and the last
target) is refused, never truncated: a cut conversation loses the end of an answer, or its
end-of-turn token, and would teach the model not to stop. ``--seq-len`` refuses them here; training
refuses them again against ``model.seq_len`` (``meshdata.chat_source``). Either way the error counts
them and names the first few.

The sidecar (format 3) says ``"samples": "conversations"`` (one sample per row, not windows over a
stream) and records the conversations, the masked-in tokens and the longest conversation.
"""

from __future__ import annotations

import os

import numpy as np

from meshdata.chat import check_messages, encode
from meshdata.errors import DataError
from meshdata.inputs import KEY, read_rows
from meshdata.tokenizer import loaded

CHAT_FORMAT_VERSION = 3
CONVERSATIONS = "conversations"  # the sidecar's "samples" value for chat shards
BATCH = 256  # conversations rendered, then tokenized as one batch
NAMED = 3  # refused conversations named in the message


def tokenize_conversations(unit, job, builder) -> None:
    """The unit's conversations -> rows (tokens + loss mask) through ``builder`` (meshdata.prepare)."""
    tokenizer = loaded(job.tokenizer.path)
    rows: list[list[dict]] = []
    wheres: list = []
    for row, where in read_rows(unit, job.encoding):
        rows.append(check_messages(row, where))
        wheres.append(where)
        if len(rows) == BATCH:
            _add_batch(tokenizer, job, rows, wheres, builder)
            rows, wheres = [], []
    if rows:
        _add_batch(tokenizer, job, rows, wheres, builder)


def _add_batch(tokenizer, job, rows: list[list[dict]], wheres: list, builder) -> None:
    result = builder.result
    kept_ids, kept_masks = [], []
    for (ids, mask), where in zip(encode(tokenizer, job.tokenizer.chat, rows, wheres), wheres):
        result.longest = max(result.longest, len(ids))
        if job.seq_len is not None and len(ids) > job.seq_len + 1:
            result.too_long += 1
            if len(result.too_long_at) < NAMED:
                result.too_long_at.append(f"{where()} ({len(ids)} tokens)")
            continue
        kept_ids.append(ids)
        kept_masks.append(mask)
        result.counted += int(mask.sum())
    result.documents += len(kept_ids)
    if not kept_ids:
        return
    lengths = np.fromiter(map(len, kept_ids), np.int64, count=len(kept_ids))
    builder.add(np.concatenate(kept_ids), lengths, np.concatenate(kept_masks))


def check_conversations(meta: dict, seq_len: int | None) -> None:
    """Refuse a prepare that met conversations longer than ``--seq-len`` (and one with no assistant
    token at all: training on it would count nothing)."""
    chat = meta["chat"]
    too_long, named = chat.pop("too_long"), chat.pop("too_long_at")
    if too_long:
        more = ", ..." if too_long > len(named[:NAMED]) else ""
        raise DataError(f"data prepare --chat: {too_long} of {too_long + meta['documents']} conversations have more "
                        f"than --seq-len {seq_len} + 1 tokens ({', '.join(named[:NAMED])}{more}); they are refused, "
                        "not truncated: shorten or split them, or raise --seq-len", key=KEY)
    if meta["documents"] and not chat["counted_tokens"]:
        raise DataError(f"data prepare --chat: no conversation has an assistant token (the template's {{% generation %}} "
                        "blocks marked nothing); add assistant turns, or check the template marks them", key=KEY)


def chat_sidecar(template, totals: dict) -> dict:
    """The sidecar's chat entries (``too_long*`` are taken out again by :func:`check_conversations`)."""
    return {"format": CHAT_FORMAT_VERSION, "samples": CONVERSATIONS,
            "chat": {"template": os.path.basename(template.where), "conversations": totals["documents"],
                     "counted_tokens": totals["counted"], "longest": totals["longest"],
                     "too_long": totals["too_long"], "too_long_at": totals["too_long_at"]}}
