"""Issue 6 end to end: the default job on a real `ray start` cluster through `ray job submit`.

One cluster per module (a head with exactly the 4 CPUs the default dp=2 x tp=2 job needs, token auth
on, no autoscaler). Each test submits with `--working-dir` the repository, as README tells users to:
  * the default job runs to SUCCEEDED, joined the cluster (not an embedded Ray), and its metrics
    file has every step with a finite loss and a `done` event;
  * a run stopped with `ray job stop` saves the step it was at, exits 0 with one line saying where
    it resumes, and withdrew its autoscaler request on the way out; submitted again, it resumes
    there: no step trained twice, losses equal one process's;
  * a job asking for GPUs on this CPU-only cluster fails after resources.placement_timeout_s with one
    clear line instead of waiting forever.

And on a cluster of its own shaped as Ray advises for large clusters (issue 35): a head with no CPUs
and a worker node holding the ranks, both `ray start`ed on this machine the plain way (one session
directory), the job trains to the end.
"""

from __future__ import annotations

import math
import re
import time
import urllib.request
from pathlib import Path

import pytest

from testbed.ray_start import free_ports
from tests.e2e.raycluster import RayCluster, records, running_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

DEFAULT_STEPS = 20  # the built-in job's train.steps


@pytest.fixture(scope="module")
def cluster():
    with running_cluster("em-e2e-", num_cpus=4) as c:
        yield c


def steps_of(recs: list[dict]) -> list[dict]:
    return [r for r in recs if "step" in r and "loss" in r]


def add_plain_node(cluster: RayCluster, num_cpus: int, timeout_s: float = 180.0) -> None:
    """A worker node started as a user starts a second node on one machine: `ray start --address`
    with no --temp-dir, so it shares the head's session directory. Its runtime-env agent then unpacks
    the job's working_dir package into the directory the head's job driver runs in, deleting it
    under the driver: a driver that imports torch after that dies in MKL (issue 35). Stopped with the
    cluster (its `ray start --block` process is one of ``cluster.procs``)."""
    agent_listen, agent_grpc, runtime_env, metrics = free_ports(4)
    log = cluster.root / "plain-node.log"
    cluster._spawn(["ray", "start", f"--address={cluster.gcs_address}", "--block",
                    f"--dashboard-agent-listen-port={agent_listen}", f"--dashboard-agent-grpc-port={agent_grpc}",
                    f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
                    "--min-worker-port=0", "--max-worker-port=0", f"--num-cpus={num_cpus}", "--num-gpus=0",
                    "--disable-usage-stats"], cluster.env, log)
    deadline = time.monotonic() + timeout_s
    while "Ray runtime started" not in (log.read_text(errors="replace") if log.exists() else ""):
        assert cluster.procs[-1].poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(1)


@pytest.mark.timeout(1200)
def test_a_job_on_a_head_without_cpus_trains_on_the_worker_node(tmp_path):
    """Issue 35's reproduction: `ray start --head --num-cpus=0`, a 4-CPU worker node, `ray job submit
    --working-dir .` of dp=2 pp=2 for 30 steps with checkpoints every 20 (metrics.path left at its
    relative default). It died about a second after the store was hosted ("Intel oneMKL FATAL ERROR:
    Cannot load .../libtorch_cpu.so", exit 2): the driver imported torch (the actor class's module)
    after the worker node unpacked the job's package over its working directory. Without torch, the
    relative metrics.path then failed (FileNotFoundError): the driver re-enters the directory
    (``reenter_cwd``)."""
    from checkpoints.catalog import list_checkpoints

    steps = 30
    with running_cluster("em-e2e0-", num_cpus=0) as cluster:
        add_plain_node(cluster, 4)
        # Four ranks importing torch on a loaded 2-core machine took up to 100 s to answer: a wider wait.
        out = cluster.submit("zero-cpu-head", ["--no-progress", "--set", "mesh.dp=2", "--set", "mesh.pp=2",
                                               "--set", "mesh.tp=1", "--set", f"train.steps={steps}",
                                               "--set", f"checkpoint.dir={tmp_path / 'ckpt'}",
                                               "--set", "checkpoint.every=20",
                                               "--set", "resources.placement_timeout_s=600"], wait=True)
        status = cluster.job_status("zero-cpu-head")
        logs = cluster.job_logs("zero-cpu-head")
    assert status == "SUCCEEDED", out.stdout[-4000:] + out.stderr[-2000:]
    assert "oneMKL" not in logs, logs[-3000:]
    driver_lines = [line for line in logs.splitlines() if "(RankActor" not in line and "(StoreHost" not in line]
    assert not [line for line in driver_lines if "Traceback" in line], logs[-3000:]
    trained = {int(m.group(1)): float(m.group(2))
               for m in re.finditer(r"orchestrator\.metrics: step +(\d+) +loss ([0-9.]+) .* mesh dp=2 pp=2 tp=1", logs)}
    assert sorted(trained) == list(range(1, steps + 1)), logs[-3000:]
    assert trained[steps] < trained[1]  # it trained
    # One generation, no restart: never a failure, never a shrink.
    assert f"elastimesh: done: step {steps}, 1 generation(s), 0 restart(s)" in logs, logs[-3000:]
    assert {c.step for c in list_checkpoints(str(tmp_path / "ckpt")) if c.valid} >= {20}


def scrape(cluster: RayCluster, name: str, timeout_s: float = 60) -> str:
    """The head's Prometheus endpoint, polled until ``name`` shows up (metrics are pushed periodically)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        if name in text or time.monotonic() > deadline:
            return text
        time.sleep(2)


def wait_for_step(cluster: RayCluster, job: str, metrics: Path, step: int, timeout_s: float = 600) -> None:
    """Until ``job``'s metrics record ``step`` trained; fails if the job ends first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        recs = records(metrics) if metrics.exists() else []
        done_steps = [r["step"] for r in steps_of(recs)]
        if done_steps and max(done_steps) >= step:
            return
        assert time.monotonic() < deadline, f"no step {step} in time: {recs[-5:]}"
        assert cluster.job_status(job) in ("PENDING", "RUNNING"), cluster.job_logs(job)[-3000:]
        time.sleep(0.5)


def check_stopped_cleanly(cluster: RayCluster, job: str, recs: list[dict], steps: int, ckpt: str) -> int:
    """The stopped ``job`` saved where it stopped, withdrew its autoscaler request and exited 0 on its
    own, with one line saying where it resumes (the supervisor never had to SIGKILL it), no traceback.
    Returns the step it stopped after."""
    assert "done" not in {r.get("event") for r in recs}
    stopped, = [r for r in recs if r.get("event") == "stopped"]
    stopped_at = stopped["step"]
    assert stopped_at == max(r["step"] for r in steps_of(recs)) < steps  # saved where it stopped
    logs = cluster.job_logs(job)
    assert f"elastimesh: stopped after step {stopped_at}: committed in checkpoint.dir={ckpt}; running it " \
        f"again resumes from step {stopped_at + 1}" in logs, logs[-3000:]
    # (Lines of the actors are tagged "(RankActor pid=...)": ray.kill at teardown makes Ray print a
    # SystemExit from inside an actor's thread pool, which is no output of the driver's.)
    driver_lines = [line for line in logs.splitlines() if "(RankActor" not in line and "(StoreHost" not in line]
    assert not [line for line in driver_lines if "Traceback" in line], logs[-3000:]
    assert cluster.autoscaler_request() == []
    return stopped_at


@pytest.mark.timeout(1200)
def test_stopped_job_saves_exits_cleanly_and_a_resubmit_reruns_no_step(cluster, tmp_path):
    from checkpoints.catalog import latest_valid
    from testbed.reference import CONTROLLER_FP32, TEST_LR, assert_matches_reference, reference

    # Enough steps that the stop (after step 13, then up to a minute for the metrics' export to show
    # in Prometheus: Ray pushes them every ~10 s) lands well before the end; each one more is trained
    # again by the resubmission and by the reference.
    steps = 120
    metrics = tmp_path / "metrics.jsonl"
    ckpt = f"file://{tmp_path / 'ckpt'}"  # a URI, as on cloud storage (s3://...)
    overrides = [TEST_LR, f"metrics.path={metrics}", f"checkpoint.dir={ckpt}", "checkpoint.every=10",
                 f"train.steps={steps}"]
    args = [a for o in overrides for a in ("--set", o)]
    # `ray job stop` sends SIGTERM, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S (3 s by default): the
    # job's runtime env gives it the time a save at the next step boundary takes (README, Run).
    wait = {"RAY_JOB_STOP_WAIT_TIME_S": "60"}
    out = cluster.submit("resume-1", args, wait=False, env_vars=wait)
    assert out.returncode == 0, out.stderr[-2000:]

    # Stop it mid-way, away from the periodic saves (so the stop's own save is what counts).
    wait_for_step(cluster, "resume-1", metrics, 13)
    # While it runs the job's metrics reach Ray's Prometheus endpoint, and its standing request to
    # the autoscaler (one bundle per rank of the largest mesh, here dp=2 x tp=2) is in the cluster.
    exported = scrape(cluster, "ray_elastimesh_loss")
    assert "ray_elastimesh_loss" in exported and "ray_elastimesh_step" in exported, exported[-2000:]
    assert cluster.autoscaler_request() == [{"CPU": 1.0}] * 4

    stop = cluster.ray("job", "stop", "--address", cluster.dashboard, "resume-1")
    assert stop.returncode == 0, stop.stderr[-2000:]
    assert cluster.wait_job("resume-1", 120) == "STOPPED"
    stopped_at = check_stopped_cleanly(cluster, "resume-1", records(metrics), steps, ckpt)
    newest = latest_valid(ckpt)
    assert newest is not None and newest.step == stopped_at

    started = time.monotonic()
    out = cluster.submit("resume-2", args, wait=True, env_vars=wait)
    resumed_in = time.monotonic() - started
    assert cluster.job_status("resume-2") == "SUCCEEDED", out.stdout[-4000:] + out.stderr[-2000:]
    recs = records(metrics)
    starts = [r for r in recs if r.get("event") == "start"]
    assert [s["resumed_from_step"] for s in starts] == [0, stopped_at]
    trained = [r["step"] for r in steps_of(recs)]
    assert trained == list(range(1, steps + 1))  # across the stop, no step trained twice
    assert [r["step"] for r in recs if r.get("event") == "done"] == [steps]
    assert f"resumed_from_step={stopped_at}" in cluster.job_logs("resume-2")
    assert_matches_reference({r["step"]: r["loss"] for r in steps_of(recs)}, None,
                             reference(overrides, steps), CONTROLLER_FP32)
    print(f"stop/resume: stopped and saved after step {stopped_at}, resubmitted run SUCCEEDED in "
          f"{resumed_in:.1f}s, losses equal the single-process run")


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
