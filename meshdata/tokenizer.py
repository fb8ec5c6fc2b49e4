"""Tokenizers for ``data prepare``: a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library, fully
offline, no ``transformers``) or the byte tokenizer (the default: one token per UTF-8 byte, vocab 256).

A document's row is ``[BOS] + encode(text, add_special_tokens=False).ids + [EOS]``: BOS only when
``tokenizer_config.json`` says ``add_bos_token: true``; EOS always (so documents stay apart in the
concatenated stream, and ``data.mask_document_boundaries`` can find the boundaries). The special
tokens are added here, not by the tokenizer's post-processor, so every tokenizer gets the same rule.
The byte tokenizer has no room for special tokens: its rows are the bytes alone.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
from dataclasses import dataclass

import numpy as np

from meshdata.chat import ChatTemplate, load_template, template_path
from meshdata.errors import DataError, one_line

KEY = "data.prepare"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
_EOS_GUESSES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
_BOS_GUESSES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]")


@dataclass(frozen=True)
class TokenizerSpec:
    """What the sidecar records and every prepare task needs (picklable; tasks load the files)."""

    kind: str  # "bytes" or "tokenizers"
    path: str  # tokenizer.json ("" for bytes)
    hash: str  # sha256 of tokenizer.json + the config files (identity of the tokenization)
    vocab_size: int
    bos_id: int | None  # prepended to every document (None: not asked for)
    eos_id: int | None  # appended to every document (None only for bytes)
    files: tuple[str, ...] = ()  # files to copy beside the shards
    chat: ChatTemplate | None = None  # --chat: the chat template conversations are rendered with

    def sidecar(self) -> dict:
        return {"kind": self.kind, "hash": self.hash, "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                "eos_id": self.eos_id, "files": [os.path.basename(f) for f in self.files]}


BYTES = TokenizerSpec("bytes", "", "bytes", 256, None, None)


def load_spec(tok: str | None, *, chat: bool = False) -> TokenizerSpec:
    """Resolve ``--tokenizer``: None -> bytes; a tokenizer.json file, or a directory holding one.
    ``chat``: also its chat template (``meshdata.chat``), which is then hashed and copied with it."""
    if not tok and chat:
        raise DataError("data prepare --chat needs --tokenizer DIR: the chat model's tokenizer directory (its chat "
                        "template renders the conversations)", key=KEY)
    if not tok:
        return BYTES
    if os.path.isdir(tok):
        path = os.path.join(tok, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise DataError(f"data prepare: --tokenizer directory {tok!r} has no {TOKENIZER_FILE}; pass a "
                            "directory saved by tokenizers/transformers (save_pretrained) or the file itself",
                            key=KEY)
    elif os.path.isfile(tok):
        path = tok
    else:
        raise DataError(f"data prepare: --tokenizer {tok!r} does not exist; pass a {TOKENIZER_FILE} or a "
                        "directory holding it", key=KEY)
    folder = os.path.dirname(os.path.abspath(path))
    configs = [os.path.join(folder, c) for c in CONFIG_FILES if os.path.isfile(os.path.join(folder, c))]
    tokenizer = _load(path)
    config: dict = {}
    for c in reversed(configs):  # tokenizer_config.json wins over special_tokens_map.json
        config.update(_read_json(c))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    eos = _token_id(tokenizer, config.get("eos_token"), path, "eos_token")
    if eos is None:
        eos = next((i for i in map(tokenizer.token_to_id, _EOS_GUESSES) if i is not None), None)
    if eos is None:
        raise DataError(f"data prepare: tokenizer {path!r} has no end-of-document token; add "
                        f"\"eos_token\" to {CONFIG_FILES[0]} beside it", key=KEY)
    bos = None
    if config.get("add_bos_token") is True:
        bos = _token_id(tokenizer, config.get("bos_token"), path, "bos_token")
        if bos is None:
            bos = next((i for i in map(tokenizer.token_to_id, _BOS_GUESSES) if i is not None), None)
        if bos is None:
            raise DataError(f"data prepare: {CONFIG_FILES[0]} of {path!r} sets add_bos_token but names no "
                            "bos_token the tokenizer knows; set \"bos_token\"", key=KEY)
    template = load_template(folder, config) if chat else None
    extra = [template_path(folder)] if template_path(folder) else []  # chat_template.jinja: part of the tokenizer
    digest = hashlib.sha256()
    for f in [path, *configs, *extra]:
        with open(f, "rb") as fh:
            digest.update(hashlib.sha256(fh.read()).digest())
    return TokenizerSpec("tokenizers", os.path.abspath(path), digest.hexdigest(), int(vocab), bos, eos,
                         tuple([os.path.abspath(path), *configs, *extra]), template)


def _read_json(f: str) -> dict:
    try:
        with open(f, "rb") as fh:
            data = json.loads(fh.read())
    except (OSError, ValueError) as e:
        raise DataError(f"data prepare: tokenizer config {f!r} is not valid JSON ({one_line(e)}); fix or "
                        "re-save it", key=KEY) from None
    if not isinstance(data, dict):
        raise DataError(f"data prepare: tokenizer config {f!r} is not a JSON object; re-save it", key=KEY)
    return data


def _token_id(tokenizer, token, path: str, what: str) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    if not token:
        return None
    tid = tokenizer.token_to_id(token)
    if tid is None:
        raise DataError(f"data prepare: {what} {token!r} of {path!r} is not in its vocabulary; fix "
                        f"{CONFIG_FILES[0]}", key=KEY)
    return int(tid)


def _load(path: str):
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers is a dependency
        raise DataError("data prepare: --tokenizer needs the `tokenizers` package; pip install tokenizers",
                        key=KEY) from None
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises plain Exception subclasses for every parse error
        raise DataError(f"data prepare: tokenizer file {path!r} is corrupt or not a Hugging Face "
                        f"{TOKENIZER_FILE} ({one_line(e)}); re-save it with tokenizers/transformers",
                        key=KEY) from None


@functools.lru_cache(maxsize=2)
def loaded(path: str):
    """The tokenizer of ``path``, loaded once per (task worker) process."""
    return _load(path)


def encode_rows(spec: TokenizerSpec, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The texts' rows, flat: (int32 token ids of every row in order, int64 row lengths).

    Built with numpy over the whole batch (one pass to flatten, BOS/EOS placed by index), not row by
    row in Python: this is the per-token overhead on top of the tokenizer (bench/data_prepare.py).
    """
    if spec.kind == "bytes":
        parts = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter(map(len, parts), np.int64, count=len(parts))
        return np.frombuffer(b"".join(parts), np.uint8).astype(np.int32), lengths
    ids = [e.ids for e in loaded(spec.path).encode_batch_fast(texts, add_special_tokens=False)]
    n = np.fromiter(map(len, ids), np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), np.int32, count=int(n.sum()))
    lengths = n + 1 + (spec.bos_id is not None)
    ends = np.cumsum(lengths)
    out = np.empty(int(ends[-1]) if len(ends) else 0, np.int32)
    keep = np.ones(len(out), bool)
    out[ends - 1] = spec.eos_id
    keep[ends - 1] = False
    if spec.bos_id is not None:
        out[ends - lengths] = spec.bos_id
        keep[ends - lengths] = False
    out[keep] = flat
    return out, lengths
