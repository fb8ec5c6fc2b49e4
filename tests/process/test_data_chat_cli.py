"""`elastimesh data prepare --chat` and `elastimesh train` on chat shards through the real CLI, in a fresh
interpreter: good input prints what was written; each bad input is exit 2, one line naming the file
(and line) or key and the fix, no traceback, and nothing written (no --out directory, no run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.tiny_tokenizer import CHATML_TEMPLATE, conversations, make_chat_tokenizer

ROOT = Path(__file__).resolve().parents[2]
ROWS = conversations(20, seed=2)
ENV = dict(os.environ, PYTHONPATH=str(ROOT), RAY_ADDRESS="127.0.0.1:1")  # no cluster may be touched


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=100, cwd=ROOT, env=ENV)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("elastimesh: error:"), lines
    return lines[0]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chat_cli")
    make_chat_tokenizer(root / "tok")
    make_chat_tokenizer(root / "no_template", template=None)
    good = [json.dumps(r) for r in ROWS]
    (root / "rows.jsonl").write_text("\n".join(good) + "\n")
    (root / "not_a_list.jsonl").write_text("\n".join([good[0], '{"messages": {"role": "user"}}', good[1]]) + "\n")
    (root / "not_json.jsonl").write_text("\n".join([good[0], good[1], "role: user, content: hi"]) + "\n")
    return root


def test_prepare_writes_conversations_and_train_refuses_a_short_seq_len(inputs, tmp_path):
    proc = _cli("data", "prepare", str(inputs / "rows.jsonl"), "--tokenizer", str(inputs / "tok"), "--chat",
                "--out", str(tmp_path / "out"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {len(ROWS)} conversations (") and "assistant tokens counted" in proc.stdout
    longest = json.loads((tmp_path / "out" / "elastimesh-data.json").read_text())["chat"]["longest"]
    train = _cli("train", "--set", f"data.path={tmp_path / 'out'}", "--set", "model.seq_len=16", "--set", "mesh.tp=1",
                 "--set", "train.global_batch_size=8", "--set", "train.micro_batch_size=1",
                 "--set", f"checkpoint.dir={tmp_path / 'ckpt'}")
    line = _one_error_line(train)
    assert "model.seq_len 16 + 1 tokens" in line and f"set model.seq_len >= {longest - 1}" in line
    assert "not truncated" in line and "RAY_ADDRESS" not in line
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("case", ["no_template", "not_a_list", "not_json", "too_long"])
def test_bad_chat_input_is_one_line_and_writes_nothing(inputs, tmp_path, case):
    rows, tok, extra = inputs / "rows.jsonl", inputs / "tok", []
    if case == "no_template":
        tok = inputs / "no_template"
    elif case == "too_long":
        extra = ["--seq-len", "40"]
    else:
        rows = inputs / f"{case}.jsonl"
    out = tmp_path / "out"
    line = _one_error_line(_cli("data", "prepare", str(rows), "--tokenizer", str(tok), "--chat", "--out", str(out),
                                "--no-progress", *extra))
    expect = {"no_template": "has no chat template", "not_a_list": f"{rows}:2: \"messages\" is an object",
              "not_json": f"{rows}:3: invalid JSON", "too_long": "conversations have more than --seq-len 40 + 1"}
    assert expect[case] in line, line
    assert not out.exists()
    if case == "too_long":
        assert f"of {len(ROWS)} conversations" in line and "refused, not truncated" in line


def test_template_variables_are_sandboxed(inputs, tmp_path):
    """A template reaching for Python internals is refused by jinja2's sandbox: one line, exit 2."""
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}{% generation %}{% endgeneration %}" + CHATML_TEMPLATE
    make_chat_tokenizer(tmp_path / "evil", template=evil)
    line = _one_error_line(_cli("data", "prepare", str(inputs / "rows.jsonl"), "--tokenizer", str(tmp_path / "evil"),
                                "--chat", "--out", str(tmp_path / "out"), "--no-progress"))
    assert "fails on this conversation" in line and "unsafe" in line.lower(), line
    assert not (tmp_path / "out").exists()
