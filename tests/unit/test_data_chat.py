"""`data prepare --chat`: 50 conversations rendered with a ChatML (Qwen2) and a Llama-3-style template that
mark the assistant's turns with {% generation %}; every row equals transformers' `apply_chat_template(tokenize=True)` and
its loss mask the `assistant_masks` transformers reports (the oracle), through several units, shards
and row groups. The chat source then counts exactly the targets that predict a masked-in token, one
conversation per padded sample. Bad input is one DataError line naming the file (and line) and the
fix, with nothing written."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from meshdata import DataError, microbatch_tokens, open_source, prepare, validate_source
from meshdata.chat_source import IGNORE as CHAT_IGNORE
from meshdata.index import SIDECAR
from meshdata.masks import IGNORE, boundary_eos
from testbed.tiny_tokenizer import CHATML_TEMPLATE, LLAMA3_TEMPLATE, conversations, make_chat_tokenizer

ROWS = conversations(50)


@pytest.fixture(scope="module", params=["chatml-config", "chatml-jinja_file", "llama3-config"])
def chat_tok(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat_tok")
    template = CHATML_TEMPLATE if request.param.startswith("chatml") else LLAMA3_TEMPLATE
    make_chat_tokenizer(folder, template=template, as_file=request.param.endswith("jinja_file"))
    return folder


@pytest.fixture(scope="module")
def oracle(chat_tok):
    """transformers' tokens and assistant masks for ROWS (test-only: transformers is never a runtime dep)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(chat_tok))
    out = [hf.apply_chat_template(r["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
           for r in ROWS]
    return [(list(o["input_ids"]), list(o["assistant_masks"])) for o in out]


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return str(path)


def _rows(out) -> list[tuple[list[int], list[int]]]:
    meta = json.loads((out / SIDECAR).read_text())
    rows = []
    for f in meta["files"]:
        t = pq.read_table(str(out / f))
        rows.extend(zip(t.column("tokens").to_pylist(), t.column("loss_mask").to_pylist()))
    return rows


def test_rows_and_masks_equal_transformers_apply_chat_template(tmp_path, chat_tok, oracle):
    first = _write(tmp_path / "a.jsonl", ROWS[:30])
    second = _write(tmp_path / "b.jsonl", ROWS[30:])
    # Small units, shards and row groups: rows must come out in input order, none lost or repeated.
    meta = prepare([first, second], str(tmp_path / "out"), tokenizer=str(chat_tok), chat=True, parallel=False,
                   unit_bytes=4000, shard_tokens=2000)
    assert _rows(tmp_path / "out") == oracle
    assert sum(m for _, mask in oracle for m in mask) == meta["chat"]["counted_tokens"] > 0
    assert meta["documents"] == meta["chat"]["conversations"] == 50 and len(meta["files"]) > 1
    assert meta["chat"]["longest"] == max(len(ids) for ids, _ in oracle)


def test_chat_source_counts_the_targets_that_predict_assistant_tokens(tmp_path, chat_tok, oracle):
    prepare([_write(tmp_path / "a.jsonl", ROWS)], str(tmp_path / "out"), tokenizer=str(chat_tok), chat=True,
            shard_tokens=3000)
    src = open_source(str(tmp_path / "out"))
    seq_len = max(len(ids) for ids, _ in oracle) + 7  # room for padding in every window
    assert src.num_samples(seq_len) == 50 and boundary_eos(True, src) is None and boundary_eos("auto", src) is None
    ids = np.array([49, 0, 17, 3])
    x, y = microbatch_tokens(src, ids, seq_len)
    assert x.shape == y.shape == (4, seq_len) and x.dtype == y.dtype == np.int64
    for row, i in enumerate(ids):
        tokens, mask = (np.asarray(a) for a in oracle[i])
        n = len(tokens) - 1
        np.testing.assert_array_equal(x[row, :n], tokens[:-1])
        np.testing.assert_array_equal(y[row, :n], np.where(mask[1:] == 1, tokens[1:], IGNORE))
        assert (y[row, n:] == IGNORE).all()  # padding never counts
    assert CHAT_IGNORE == IGNORE


def test_a_conversation_longer_than_seq_len_is_refused_and_counted(tmp_path, chat_tok, oracle):
    lengths = np.array([len(ids) for ids, _ in oracle])
    seq_len = int(np.sort(lengths)[-4])  # three conversations have more than seq_len + 1 tokens
    over = int(np.count_nonzero(lengths > seq_len + 1))
    rows = _write(tmp_path / "a.jsonl", ROWS)
    with pytest.raises(DataError, match=f"{over} of 50 conversations have more than --seq-len {seq_len} \\+ 1"):
        prepare([rows], str(tmp_path / "refused"), tokenizer=str(chat_tok), chat=True, seq_len=seq_len)
    assert not (tmp_path / "refused").exists()  # nothing written
    prepare([rows], str(tmp_path / "out"), tokenizer=str(chat_tok), chat=True)  # no --seq-len: training checks
    with pytest.raises(DataError, match=f"{over} of 50 conversations have more than model.seq_len {seq_len}") as ei:
        validate_source(str(tmp_path / "out"), seq_len, 512, 8)
    assert ei.value.key == "model.seq_len" and "not truncated" in str(ei.value)
    validate_source(str(tmp_path / "out"), int(lengths.max()) - 1, 512, 8)  # the longest fits exactly


# --- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("line, expect", [
    ('{"messages": "hello"}', '"messages" is a string, not a non-empty list'),
    ('{"messages": [{"role": "user", "content": 3}]}', "message 0 is not a role/content object"),
    ('{"messages": []}', '"messages" is an empty list'),
    ('{"messages": [{"role": "user"}]}', "message 0 is not a role/content object"),
    ('{"messages": [{"content": "hi"}]}', "message 0 is not a role/content object"),
    ('{"text": "plain"}', 'expected an object with "messages"'),
    ('[1, 2]', 'expected an object with "messages", got list'),
    ('{"messages": [{"role": "user", "content": "hi"}', "invalid JSON"),
])
def test_bad_rows_name_file_and_line(tmp_path, chat_tok, line, expect):
    good = json.dumps(ROWS[0])
    path = tmp_path / "in.jsonl"
    path.write_text(f"{good}\n{good}\n{line}\n{good}\n")
    with pytest.raises(DataError, match=expect) as ei:
        prepare([str(path)], str(tmp_path / "out"), tokenizer=str(chat_tok), chat=True)
    assert f"{path}:3" in str(ei.value) and "\n" not in str(ei.value)
    assert not (tmp_path / "out").exists()


def test_tokenizers_without_a_usable_template_and_non_json_inputs_are_refused(tmp_path):
    rows = _write(tmp_path / "a.jsonl", ROWS[:3])
    make_chat_tokenizer(tmp_path / "none", template=None)
    with pytest.raises(DataError, match="has no chat template"):
        prepare([rows], str(tmp_path / "o"), tokenizer=str(tmp_path / "none"), chat=True)
    plain = CHATML_TEMPLATE.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    make_chat_tokenizer(tmp_path / "plain", template=plain)
    with pytest.raises(DataError, match="no {% generation %} block"):
        prepare([rows], str(tmp_path / "o"), tokenizer=str(tmp_path / "plain"), chat=True)
    make_chat_tokenizer(tmp_path / "broken", template="{% for m in messages %}{% generation %}")
    with pytest.raises(DataError, match="does not compile"):
        prepare([rows], str(tmp_path / "o"), tokenizer=str(tmp_path / "broken"), chat=True)
    with pytest.raises(DataError, match="--chat needs --tokenizer"):
        prepare([rows], str(tmp_path / "o"), chat=True)
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(DataError, match="is not JSON lines"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "o"), tokenizer=str(tmp_path / "plain"), chat=True)
    assert not (tmp_path / "o").exists()


def test_a_template_that_raises_names_the_row(tmp_path):
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be the user') }}{% endif %}" \
             + CHATML_TEMPLATE
    make_chat_tokenizer(tmp_path / "tok", template=strict)
    rows = [{"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"role": "assistant", "content": "hi"}]}]
    with pytest.raises(DataError, match="first turn must be the user") as ei:
        prepare([_write(tmp_path / "a.jsonl", rows)], str(tmp_path / "o"), tokenizer=str(tmp_path / "tok"), chat=True)
    assert f"{tmp_path / 'a.jsonl'}:2" in str(ei.value)
    assert not (tmp_path / "o").exists()


def test_conversations_without_any_assistant_token_are_refused(tmp_path, chat_tok):
    rows = [{"messages": [{"role": "user", "content": "hello"}]}, {"messages": [{"role": "system", "content": "x"}]}]
    with pytest.raises(DataError, match="no conversation has an assistant token"):
        prepare([_write(tmp_path / "a.jsonl", rows)], str(tmp_path / "o"), tokenizer=str(chat_tok), chat=True)
    assert not (tmp_path / "o").exists()
