"""`elastimesh config` prints a file that `plan` and `train` accept (issue 29, part 2), for the built-in
model, every example in examples/ (the TOML jobs, and the user family ``examples/posnorm_family.py``)
and ``model.from_hf``.

Before: with ``model.from_hf`` the printed file carried the default size keys (``n_layers = 4``,
``vocab_size = 256``, ...) beside ``from_hf``, so reading it back exited 2 ("model.n_layers and
model.from_hf are both set"). Now those keys are comments holding config.json's values.

Each case: ``config`` -> a file; loading the file gives the same ``JobConfig``; ``plan FILE`` exits 0.
The slow test trains each printed file for one step on one rank (a local Ray).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config.load import load_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_JOBS = sorted(REPO.glob("examples/*.toml"))
FAMILY = "examples.posnorm_family:PosNormFamily"
pytestmark = pytest.mark.timeout(600)  # the family imports torch: minutes on a loaded 2-core box

# A Llama config.json (what `from_pretrained` writes, the fields the llama family reads): 512 tokens,
# so a printed `vocab_size = 256` (the default) would be wrong as well as refused.
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
             "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
             "hidden_act": "silu", "max_position_embeddings": 128, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("hf")
    (directory / "config.json").write_text(json.dumps(HF_CONFIG))
    return directory


def printed(capsys, args: list[str]) -> str:
    assert main(["config", *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def cases(hf_dir: Path) -> dict[str, tuple[str | None, list[str]]]:
    """name -> (job file or None, overrides)."""
    out: dict[str, tuple[str | None, list[str]]] = {"builtin": (None, [])}
    for job in EXAMPLE_JOBS:
        out[job.stem] = (str(job), [])
    out["posnorm_family"] = (None, [f"model.family={FAMILY}"])
    out["from_hf"] = (None, [f"model.from_hf={hf_dir}", "mesh.tp=1"])
    return out


def test_every_example_is_covered():
    # train_on_head.py is what `ray submit` runs on a cluster's head: tests/e2e/test_hosts_ray_up.py runs it.
    assert {p.name for p in (REPO / "examples").iterdir() if p.suffix in (".toml", ".py")} == \
        {*(p.name for p in EXAMPLE_JOBS), "posnorm_family.py", "train_on_head.py"}


@pytest.mark.parametrize("name", ["builtin", *(p.stem for p in EXAMPLE_JOBS), "posnorm_family", "from_hf"])
def test_config_output_reads_back_and_plans(name, hf_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # the example family is importable from the repository root
    job, overrides = cases(hf_dir)[name]
    args = ([job] if job else []) + [a for o in overrides for a in ("--set", o)]
    text = printed(capsys, args)
    path = tmp_path / "job.toml"
    path.write_text(text)
    assert load_config(path) == load_config(job, overrides)
    assert main(["plan", str(path)]) == 0, capsys.readouterr().err
    assert "mesh" in capsys.readouterr().out
    assert printed(capsys, [str(path)]) == text  # a fixed point


def test_from_hf_sizes_are_comments_with_config_json_values(hf_dir, capsys):
    text = printed(capsys, ["--set", f"model.from_hf={hf_dir}", "--set", "mesh.tp=1"])
    model = tomllib.loads(text)["model"]
    assert model["from_hf"] == str(hf_dir) and "n_layers" not in model and "vocab_size" not in model
    assert "# n_layers = 2" in text and "# vocab_size = 512" in text and "# d_model = 64" in text
    assert "# ffn_hidden = 96" in text and "# n_heads = 4" in text


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["builtin", *(p.stem for p in EXAMPLE_JOBS), "posnorm_family", "from_hf"])
def test_a_printed_file_trains(name, hf_dir, tmp_path, capsys, monkeypatch):
    """`train` of the printed file, one step on one rank (the file's own mesh is what `plan` checked
    above; 8 ranks of torch are minutes on this machine), run where the file's relative output paths
    land in ``tmp_path``."""
    monkeypatch.chdir(REPO)
    job, overrides = cases(hf_dir)[name]
    path = tmp_path / "job.toml"
    path.write_text(printed(capsys, ([job] if job else []) + [a for o in overrides for a in ("--set", o)]))
    sets = ["train.steps=1", "mesh.dp=1", "mesh.pp=1", "mesh.tp=1", f"metrics.path={tmp_path / 'm.jsonl'}",
            f"checkpoint.dir={tmp_path / 'ckpt'}"]
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "train", str(path), "--no-progress",
                           *(a for o in sets for a in ("--set", o))], capture_output=True, text=True,
                          timeout=840, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1]
    assert [r["step"] for r in records if r.get("event") == "done"] == [1]
