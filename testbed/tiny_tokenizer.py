"""A real byte-level BPE tokenizer, trained offline in a second on a few documents (no download).

``make_tokenizer(folder)`` writes ``tokenizer.json`` + ``tokenizer_config.json`` as a Hugging Face
tokenizer directory holds them, for ``data prepare`` and the runs on prepared shards; ``DOCS`` are the
documents it is trained on, which tests/unit/test_data_prepare.py also prepares (every kind of text
the reader must keep byte for byte: non-ASCII, tabs, CRLF, a long document, a short one).
"""

from __future__ import annotations

import json
from pathlib import Path

DOCS = [
    "The baker sold bread to the sailors at dawn.",
    "Ünïcödé text: café, naïve, 東京, emoji 🙂 and tabs\tinside.",
    "A longer document. " * 300,
    "short",
    "Line one\nline two\r\nline three",
]


def make_tokenizer(folder: Path, *, add_bos: bool = True):
    """A byte-level BPE trained offline on a few KB, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": add_bos, "bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    return tok
