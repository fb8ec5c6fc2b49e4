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


# Qwen2's ChatML template (a default system turn when the conversation has none), with the assistant's
# content and end-of-turn token inside {% generation %}: what transformers' return_assistant_tokens_mask
# (and `data prepare --chat`) read as the tokens to train on.
CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {%- if loop.first and messages[0]['role'] != 'system' %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'assistant' %}\n"
    "        {{- '<|im_start|>assistant\\n' }}\n"
    "        {%- generation %}\n"
    "            {{- message['content'] + '<|im_end|>' }}\n"
    "        {%- endgeneration %}\n"
    "        {{- '\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
# Llama 3's layout (BOS from the bos_token variable, header tokens, <|eot_id|> ends a turn, contents
# trimmed), counting turns in a namespace: the template features a renderer must get right.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- set ns = namespace(turns=0) %}\n"
    "{%- for message in messages %}\n"
    "    {%- set ns.turns = ns.turns + 1 %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}\n"
    "    {%- if message['role'] == 'assistant' %}\n"
    "        {%- generation %}\n"
    "            {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "        {%- endgeneration %}\n"
    "    {%- else %}\n"
    "        {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if ns.turns > 6 %}{{- '<|start_header_id|>note<|end_header_id|>\n\nlong<|eot_id|>' }}{%- endif %}\n"
)
CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eot_id|>"]


def make_chat_tokenizer(folder: Path, *, template: str | None = CHATML_TEMPLATE, as_file: bool = False):
    """A byte-level BPE with ChatML's and Llama 3's special tokens and ``template`` as its chat template
    (in tokenizer_config.json, or in chat_template.jinja when ``as_file``; None: no template). Its
    bos_token is Llama 3's (ChatML never writes it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=CHAT_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 20 + [w for w in CHAT_WORDS] * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "bos_token": "<|begin_of_text|>", "add_bos_token": False}
    if template is not None and as_file:
        (folder / "chat_template.jinja").write_text(template)
    elif template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


CHAT_WORDS = ("what is the capital of france? paris is. explain the tide: the moon pulls the sea. "
              "write a haiku about rain — drops on the tin roof. 東京 café naïve 🙂 sure! no. thanks").split()


def conversations(count: int, seed: int = 0) -> list[dict]:
    """``count`` rows ``{"messages": [...]}``: 1-4 user/assistant exchanges, some with a system turn,
    contents drawn from CHAT_WORDS (non-ASCII and emoji included), an empty assistant reply now and then."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": " ".join(rng.choices(CHAT_WORDS, k=rng.randint(1, 6)))})
        for _ in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": " ".join(rng.choices(CHAT_WORDS, k=rng.randint(1, 12)))})
            reply = "" if rng.random() < 0.05 else " ".join(rng.choices(CHAT_WORDS, k=rng.randint(1, 20)))
            messages.append({"role": "assistant", "content": reply})
        rows.append({"messages": messages})
    return rows
