"""Issue 6 end to end: the default job on a real `ray start` cluster through `ray job submit`.

One cluster per module (a head with exactly the 4 CPUs the default dp=2 x tp=2 job needs, token auth
on, no autoscaler). Each test submits with `--working-dir` the repository, as README tells users to:
  * the default job runs to SUCCEEDED, joined the cluster (not an embedded Ray), and its metrics
    file has every step with a finite loss and a `done` event;
  * a run stopped with `ray job stop` after a checkpoint committed, then submitted again, resumes
    from the newest committed checkpoint (not step 0) and finishes; the stopped driver withdrew its
    autoscaler request on the way out (SIGTERM cleanup);
  * a job asking for GPUs on this CPU-only cluster fails after resources.placement_timeout_s with one
    clear line instead of waiting forever.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.raycluster import RayCluster

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

DEFAULT_STEPS = 20  # the built-in job's train.steps


@pytest.fixture(scope="module")
def cluster():
    # A short root: Ray puts unix sockets under --temp-dir, and their paths have a ~107-byte limit.
    root = Path(tempfile.mkdtemp(prefix="em-e2e-", dir="/tmp"))
    c = RayCluster(root, num_cpus=4)
    try:
        c.start()
        yield c
    finally:
        c.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_of(recs: list[dict]) -> list[dict]:
    return [r for r in recs if "step" in r and "loss" in r]


@pytest.mark.timeout(900)
def test_default_job_succeeds_on_the_cluster(cluster, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    started = time.monotonic()
    out = cluster.submit("default-1", ["--set", f"metrics.path={metrics}",
                                       "--set", f"checkpoint.dir={tmp_path / 'ckpt'}",
                                       "--set", "checkpoint.every=5"], wait=True)
    elapsed = time.monotonic() - started
    assert cluster.job_status("default-1") == "SUCCEEDED", out.stdout[-4000:] + out.stderr[-2000:]
    print(f"default job on the cluster: submit -> SUCCEEDED in {elapsed:.1f}s")
    logs = cluster.job_logs("default-1")
    # The driver joined this cluster through RAY_ADDRESS (set by the job), not a local Ray of its own.
    assert "Connecting to existing Ray cluster" in logs and "Started a local Ray" not in logs, logs[-3000:]
    recs = records(metrics)
    steps = steps_of(recs)
    assert sorted({r["step"] for r in steps}) == list(range(1, DEFAULT_STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert all((r["dp"], r["pp"], r["tp"]) == (2, 1, 2) for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]  # it trained
    assert [r["step"] for r in recs if r.get("event") == "done"] == [DEFAULT_STEPS]
    assert {r["step"] for r in recs if r.get("event") == "checkpoint"} >= {5, 10, 15}


def scrape(cluster: RayCluster, name: str, timeout_s: float = 60) -> str:
    """The head's Prometheus endpoint, polled until ``name`` shows up (metrics are pushed periodically)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        if name in text or time.monotonic() > deadline:
            return text
        time.sleep(2)


@pytest.mark.timeout(1200)
def test_stopped_job_resumes_from_its_last_checkpoint(cluster, tmp_path):
    from checkpoints.catalog import latest_valid

    steps = 30
    metrics = tmp_path / "metrics.jsonl"
    ckpt = f"file://{tmp_path / 'ckpt'}"  # a URI, as on cloud storage (s3://...)
    args = ["--set", f"metrics.path={metrics}", "--set", f"checkpoint.dir={ckpt}",
            "--set", "checkpoint.every=3", "--set", f"train.steps={steps}"]
    out = cluster.submit("resume-1", args, wait=False)
    assert out.returncode == 0, out.stderr[-2000:]

    # Stop it mid-way, once a checkpoint has committed and training went on past it.
    deadline = time.monotonic() + 600
    while True:
        recs = records(metrics) if metrics.exists() else []
        committed = [r["step"] for r in recs if r.get("event") == "checkpoint"]
        done_steps = [r["step"] for r in steps_of(recs)]
        if committed and done_steps and max(done_steps) > committed[-1]:
            break
        assert time.monotonic() < deadline, f"no checkpoint committed in time: {recs[-5:]}"
        assert cluster.job_status("resume-1") in ("PENDING", "RUNNING"), cluster.job_logs("resume-1")[-3000:]
        time.sleep(1)
    # While it runs the job's metrics reach Ray's Prometheus endpoint, and its standing request to
    # the autoscaler (one bundle per rank of the largest mesh, here dp=2 x tp=2) is in the cluster.
    exported = scrape(cluster, "ray_elastimesh_loss")
    assert "ray_elastimesh_loss" in exported and "ray_elastimesh_step" in exported, exported[-2000:]
    assert cluster.autoscaler_request() == [{"CPU": 1.0}] * 4

    stop = cluster.ray("job", "stop", "--address", cluster.dashboard, "resume-1")
    assert stop.returncode == 0, stop.stderr[-2000:]
    assert cluster.wait_job("resume-1", 120) == "STOPPED"
    assert "done" not in {r.get("event") for r in records(metrics)}
    stopped_at = max(r["step"] for r in steps_of(records(metrics)))
    assert stopped_at < steps, "the job finished before it was stopped: nothing to resume"
    # The driver caught SIGTERM and withdrew its request: idle nodes would otherwise never go away.
    assert "stopping: got SIGTERM" in cluster.job_logs("resume-1")
    assert cluster.autoscaler_request() == []
    newest = latest_valid(ckpt)
    assert newest is not None and 0 < newest.step <= stopped_at

    started = time.monotonic()
    out = cluster.submit("resume-2", args, wait=True)
    resumed_in = time.monotonic() - started
    assert cluster.job_status("resume-2") == "SUCCEEDED", out.stdout[-4000:] + out.stderr[-2000:]
    recs = records(metrics)
    starts = [r for r in recs if r.get("event") == "start"]
    assert [s["resumed_from_step"] for s in starts] == [0, newest.step]
    second = recs[recs.index(starts[1]):]
    resumed_steps = [r["step"] for r in steps_of(second)]
    assert resumed_steps == list(range(newest.step + 1, steps + 1)), resumed_steps
    assert all(math.isfinite(r["loss"]) for r in steps_of(second))
    assert [r["step"] for r in second if r.get("event") == "done"] == [steps]
    assert f"resumed_from_step={newest.step}" in cluster.job_logs("resume-2")
    print(f"stop/resume: stopped after step {stopped_at}, resumed from checkpoint step {newest.step}, "
          f"resubmitted run SUCCEEDED in {resumed_in:.1f}s")


@pytest.mark.timeout(600)
def test_gpu_job_on_a_cpu_only_cluster_fails_clearly(cluster, tmp_path):
    wait_s = 5
    started = time.monotonic()
    cluster.submit("gpu-1", ["--set", "resources.use_gpu=true",
                             "--set", f"resources.placement_timeout_s={wait_s}",
                             "--set", f"metrics.path={tmp_path / 'm.jsonl'}"], wait=True, timeout=400)
    status = cluster.wait_job("gpu-1", 120)
    elapsed = time.monotonic() - started
    assert status == "FAILED"
    logs = cluster.job_logs("gpu-1")
    errors = [line for line in logs.splitlines() if line.startswith("elastimesh: error:")]
    assert len(errors) == 1, logs[-3000:]
    assert "resources.placement_timeout_s=5s" in errors[0] and "no node has a GPU" in errors[0]
    assert "resources.use_gpu=false" in errors[0]
    assert "Traceback" not in logs
    # Bounded: the configured wait plus start-up (connect, store actor) on a loaded 2-core machine.
    assert elapsed < wait_s + 240, elapsed
    print(f"GPU job on a CPU-only cluster: FAILED with a clear line after {elapsed:.1f}s")
