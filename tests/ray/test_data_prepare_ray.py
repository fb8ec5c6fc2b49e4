"""`data prepare` over Ray tasks (its own local Ray, as the CLI starts it): the shards equal the
in-process run's byte for byte (input order kept across units finishing in any order), and a bad
line inside a task is still one DataError naming the file and line."""

from __future__ import annotations

import json

import pytest

from meshdata import DataError, prepare
from meshdata.index import SIDECAR
from orchestrator.cluster.prepare_tasks import RayFanOut
from testbed.tiny_tokenizer import make_tokenizer

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


def test_ray_tasks_equal_in_process(tmp_path):
    tok = tmp_path / "tok"
    make_tokenizer(tok)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"line {i} " + "abc " * (i % 50)}) + "\n" for i in range(3000)))
    (tmp_path / "z.txt").write_text("the last document")
    inputs = [str(docs), str(tmp_path / "z.txt")]
    local = prepare(inputs, str(tmp_path / "local"), tokenizer=str(tok), shard_tokens=5000, parallel=False,
                    unit_bytes=20_000)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(docs.read_text() + '{"text": "unterminated\n')
    with pytest.raises(DataError, match=f"{bad}:3001: invalid JSON"):
        prepare([str(bad)], str(tmp_path / "bad-out"), tokenizer=str(tok), parallel=True, unit_bytes=20_000,
                fan_out=RayFanOut())
    assert not (tmp_path / "bad-out").exists()
    ray_meta = prepare(inputs, str(tmp_path / "ray"), tokenizer=str(tok), shard_tokens=5000, parallel=True,
                       unit_bytes=20_000, fan_out=RayFanOut())
    assert ray_meta == local and len(local["files"]) > 5 and local["documents"] == 3001
    for f in [*local["files"], SIDECAR, "tokenizer.json"]:
        assert (tmp_path / "ray" / f).read_bytes() == (tmp_path / "local" / f).read_bytes(), f


def test_chat_over_ray_tasks_equals_in_process(tmp_path):
    """--chat through Ray tasks: the job (with its chat template) travels to the tasks, each renders
    and masks its units, and the shards and sidecar equal the in-process run's byte for byte."""
    from testbed.tiny_tokenizer import conversations, make_chat_tokenizer

    make_chat_tokenizer(tmp_path / "tok")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in conversations(300, seed=3)))
    common = dict(tokenizer=str(tmp_path / "tok"), chat=True, shard_tokens=5000, unit_bytes=20_000)
    local = prepare([str(rows)], str(tmp_path / "local"), parallel=False, **common)
    ray_meta = prepare([str(rows)], str(tmp_path / "ray"), parallel=True, fan_out=RayFanOut(), **common)
    assert ray_meta == local and len(local["files"]) > 3 and local["documents"] == 300
    for f in [*local["files"], SIDECAR, "tokenizer.json", "tokenizer_config.json"]:
        assert (tmp_path / "ray" / f).read_bytes() == (tmp_path / "local" / f).read_bytes(), f
