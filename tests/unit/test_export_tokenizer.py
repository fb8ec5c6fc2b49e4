"""An export ships the tokenizer the run's data was prepared with (meshmodels/export.py)."""

from __future__ import annotations

import json

from meshmodels.export import copy_tokenizer_files


def test_tokenizer_files_beside_the_shards_are_copied(tmp_path):
    data, out = tmp_path / "shards", tmp_path / "out"
    data.mkdir()
    out.mkdir()
    (data / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    (data / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (data / "part-00000.parquet").write_bytes(b"not copied")
    assert copy_tokenizer_files(str(data), str(out)) == ["tokenizer.json", "tokenizer_config.json"]
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"eos_token": "</s>"}
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    # The same through a URI (fsspec), and nothing for byte-token data.
    uri_out = tmp_path / "uri-out"
    uri_out.mkdir()
    assert copy_tokenizer_files(f"file://{data}", str(uri_out)) == ["tokenizer.json", "tokenizer_config.json"]
    empty = tmp_path / "bytes"
    empty.mkdir()
    assert copy_tokenizer_files("builtin", str(out)) == [] and copy_tokenizer_files(str(empty), str(out)) == []
