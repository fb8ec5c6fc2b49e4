"""`metrics.profile_steps`: every rank writes a torch.profiler Chrome trace of exactly the steps asked."""

from __future__ import annotations

import glob
import json
import os

import pytest

from meshspeak.profile import TRACE_SUFFIX, worker_name
from orchestrator.config.load import load_config

pytestmark = pytest.mark.ray


@pytest.mark.timeout(300)
def test_profile_steps_write_one_trace_per_rank_and_step(ray_local, tmp_path):
    from orchestrator.launch import run_job

    cfg = load_config(None, [
        "mesh.dp=2", "mesh.tp=1", "model.n_layers=2", "model.d_model=32", "model.n_heads=2",
        "model.seq_len=32", "train.steps=4", "train.global_batch_size=4", "train.micro_batch_size=2",
        "resources.cpus_per_worker=0.25", "elastic.grow_check_s=1e6",
        f"metrics.path={tmp_path / 'run' / 'metrics.jsonl'}", "metrics.profile_steps=2:3",
    ])
    summary = run_job(cfg, progress=False)
    assert summary.final_step == 4

    out = tmp_path / "run" / "profiles"  # the default: beside the metrics file
    files = sorted(os.listdir(out))
    expected = {worker_name(rank, 1, step) for rank in (0, 1) for step in (2, 3)}
    assert {f.split(".", 1)[0] for f in files} == expected and len(files) == 4, files
    for name in expected:
        path, = glob.glob(str(out / f"{name}.*{TRACE_SUFFIX}"))
        trace = json.load(open(path))  # Chrome trace JSON: what Perfetto and TensorBoard read
        events = trace["traceEvents"]
        step = int(name.rsplit("step", 1)[1])
        steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
        assert steps == {f"ProfilerStep#{step}"}
        # The step's work is in it: matrix multiplies of forward/backward, and the optimizer.
        names = {e.get("name", "") for e in events if e.get("ph") == "X"}
        assert any(n.startswith("aten::") and "mm" in n for n in names), sorted(names)[:20]
        assert any("Optimizer.step" in n for n in names), sorted(names)[:40]
