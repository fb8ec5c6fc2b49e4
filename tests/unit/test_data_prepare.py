"""`data prepare` with a real tokenizer (trained offline here): the shard rows equal the `tokenizers`
library's own encode of each document plus BOS/EOS, for .txt, JSON lines and Parquet input; and every
bad input is one line naming the file (and the line for JSON) and the fix, exit 2."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshdata import DataError, open_source, prepare
from meshdata.index import SIDECAR
from orchestrator.cli import main
from testbed.tiny_tokenizer import DOCS, make_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    return folder, make_tokenizer(folder)


def _write_inputs(tmp_path, kind: str) -> list[str]:
    if kind == "txt":
        paths = []
        for i, d in enumerate(DOCS):
            p = tmp_path / f"doc{i}.txt"
            p.write_bytes(d.encode())
            paths.append(str(p))
        return paths
    if kind == "jsonl":
        p = tmp_path / "docs.jsonl"
        p.write_text("\n".join(json.dumps({"id": i, "body": d}) for i, d in enumerate(DOCS)) + "\n\n")
        return [str(p)]
    p = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"content": DOCS[:3], "n": [1, 2, 3]}), str(p), row_group_size=2)
    q = tmp_path / "more.parquet"
    pq.write_table(pa.table({"content": DOCS[3:], "n": [4, 5]}), str(q))
    return [str(tmp_path)]  # a directory: both files, sorted by name (docs < more)


def _rows(out) -> list[list[int]]:
    meta = json.loads((out / SIDECAR).read_text())
    rows = []
    for f in meta["files"]:
        rows.extend(pq.read_table(str(out / f)).column("tokens").to_pylist())
    return rows


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_rows_equal_tokenizers_encode_plus_bos_eos(tmp_path, tok_dir, kind):
    folder, tok = tok_dir
    (tmp_path / "in").mkdir()
    inputs = _write_inputs(tmp_path / "in", kind)
    out = tmp_path / "out"
    meta = prepare(inputs, str(out), tokenizer=str(folder), text_key="body", text_column="content",
                   shard_tokens=500, parallel=False)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    want = [[bos] + tok.encode(d, add_special_tokens=False).ids + [eos] for d in DOCS]
    assert _rows(out) == want
    assert meta["documents"] == len(DOCS) and meta["num_tokens"] == sum(map(len, want))
    assert len(meta["files"]) > 1  # shard_tokens=500 bounds the shards (one long doc gets its own)
    side = meta["tokenizer"]
    assert side["kind"] == "tokenizers" and side["vocab_size"] == tok.get_vocab_size()
    assert (side["bos_id"], side["eos_id"]) == (bos, eos) and len(side["hash"]) == 64
    assert sorted(side["files"]) == ["tokenizer.json", "tokenizer_config.json"]
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    src = open_source(str(out))
    assert (src.eos_id, src.bos_id, src.vocab_size) == (eos, bos, tok.get_vocab_size())
    assert src.read_all().tolist() == [t for row in want for t in row]


def test_no_bos_unless_the_config_asks(tmp_path):
    tok = make_tokenizer(tmp_path / "tok", add_bos=False)
    (tmp_path / "a.txt").write_text(DOCS[0])
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "out"), tokenizer=str(tmp_path / "tok" / "tokenizer.json"))
    assert _rows(tmp_path / "out") == [tok.encode(DOCS[0], add_special_tokens=False).ids + [tok.token_to_id("</s>")]]


def test_units_split_big_json_lines_without_losing_or_repeating_a_line(tmp_path, tok_dir):
    folder, tok = tok_dir
    docs = [f"document number {i} " + "x" * (i % 37) for i in range(400)]
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    meta = prepare([str(big)], str(tmp_path / "out"), tokenizer=str(folder), parallel=False, unit_bytes=1000)
    eos, bos = tok.token_to_id("</s>"), tok.token_to_id("<s>")
    assert meta["documents"] == len(docs)
    assert _rows(tmp_path / "out") == [[bos] + tok.encode(d, add_special_tokens=False).ids + [eos] for d in docs]


def test_an_empty_document_gets_no_row(tmp_path, tok_dir):
    folder, _ = tok_dir
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": ""}\n{"text": "x"}\n')
    meta = prepare([str(p)], str(tmp_path / "out"), tokenizer=str(folder))
    assert meta["documents"] == 1 and len(_rows(tmp_path / "out")) == 1


# --- bad input: exit 2, one line naming the file (and line) and the fix ----------------------------------------

def _cli(capsys, *args) -> str:
    code = main(["data", "prepare", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_bad_json_line_names_file_and_line(tmp_path, capsys):
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "ok"}\n\n{"text": "broken"\n')
    line = _cli(capsys, str(p), "--out", str(tmp_path / "o"))
    assert f"{p}:3" in line and "invalid JSON" in line
    assert not (tmp_path / "o").exists()  # nothing left behind


def test_missing_text_key_and_column(tmp_path, capsys):
    p = tmp_path / "a.jsonl"
    p.write_text('{"text": "ok"}\n{"body": "no text key"}\n')
    line = _cli(capsys, str(p), "--out", str(tmp_path / "o"))
    assert f"{p}:2" in line and "--text-key" in line
    q = tmp_path / "b.parquet"
    pq.write_table(pa.table({"body": ["x"]}), str(q))
    line = _cli(capsys, str(q), "--out", str(tmp_path / "o"))
    assert str(q) in line and "--text-column" in line


def test_unknown_extension_unreadable_and_missing(tmp_path, capsys, monkeypatch):
    p = tmp_path / "a.csv"
    p.write_text("x")
    assert ".csv" in _cli(capsys, str(p), "--out", str(tmp_path / "o"))
    assert "nope.txt" in _cli(capsys, str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o"))
    r = tmp_path / "locked.txt"
    r.write_text("x")
    real = os.access
    monkeypatch.setattr(os, "access", lambda f, m: False if str(f) == str(r) else real(f, m))
    line = _cli(capsys, str(r), "--out", str(tmp_path / "o"))
    assert "locked.txt" in line and "permission" in line


def test_bad_tokenizer_files(tmp_path, capsys, tok_dir):
    (tmp_path / "a.txt").write_text("x")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text('{"this is": "not a tokenizer"}')
    assert "corrupt" in _cli(capsys, str(tmp_path / "a.txt"), "--tokenizer", str(bad), "--out", str(tmp_path / "o"))
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _cli(capsys, str(tmp_path / "a.txt"), "--tokenizer", str(empty), "--out", str(tmp_path / "o"))
    assert "has no tokenizer.json" in line
    folder, _ = tok_dir
    cfg = tmp_path / "cfgbad"
    cfg.mkdir()
    (cfg / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (cfg / "tokenizer_config.json").write_text("{not json")
    line = _cli(capsys, str(tmp_path / "a.txt"), "--tokenizer", str(cfg), "--out", str(tmp_path / "o"))
    assert "tokenizer_config.json" in line and "not valid JSON" in line


def test_out_must_be_empty(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("x")
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.md").write_text("keep me")
    line = _cli(capsys, str(tmp_path / "a.txt"), "--out", str(out))
    assert str(out) in line and "empty" in line
    assert (out / "notes.md").read_text() == "keep me"


def test_failed_prepare_removes_what_it_wrote(tmp_path, tok_dir):
    folder, _ = tok_dir
    good = tmp_path / "a.jsonl"
    good.write_text("".join(json.dumps({"text": "y" * 50}) + "\n" for _ in range(200)))
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": 1}\n')
    out = tmp_path / "o"
    out.mkdir()
    with pytest.raises(DataError, match="b.jsonl:1"):
        prepare([str(good), str(bad)], str(out), tokenizer=str(folder), shard_tokens=100, parallel=False)
    assert list(out.iterdir()) == []
    np.testing.assert_equal(out.is_dir(), True)  # an --out that existed stays, empty
