"""The data checks of `elastimesh train` through the real CLI, in a fresh interpreter: a tokenizer vocab
larger than model.vocab_size is exit 2, one line, before Ray is even contacted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from meshdata import prepare

ROOT = Path(__file__).resolve().parents[2]


def test_tokenizer_vocab_larger_than_model_is_exit_2_before_any_actor(tmp_path):
    from testbed.tiny_tokenizer import make_tokenizer

    tok = make_tokenizer(tmp_path / "tok")
    (tmp_path / "a.txt").write_text("some words for the corpus " * 200)
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "shards"), tokenizer=str(tmp_path / "tok"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_ADDRESS="127.0.0.1:1")  # no cluster may be touched
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "train", "--set", f"data.path={tmp_path / 'shards'}",
                           "--set", "model.vocab_size=256", "--set", "mesh.tp=1"],
                          capture_output=True, text=True, timeout=100, cwd=ROOT, env=env)
    lines = [ln for ln in proc.stderr.splitlines() if "elastimesh: error:" in ln]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "model.vocab_size" in lines[0] and f">= {tok.get_vocab_size()}" in lines[0]
    assert "RAY_ADDRESS" not in lines[0]  # refused before even connecting to Ray
