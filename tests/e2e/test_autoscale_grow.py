"""Issue 6, autoscaling end to end: a job that wants more DP replicas than the cluster holds asks the
autoscaler for them, the autoscaler adds a node, and the job grows onto it.

The cluster is a real `ray start --head` with Ray's own autoscaler (the monitor process) driving
Ray's fake multi-node provider, which "launches" a node as one more local raylet. The head has
1 CPU: room for one rank. The job starts at dp=1 (pp=tp=1) with elastic.max_dp=2; nothing else asks
for capacity (min_workers=0, the job's placement group fits), so the only reason a node appears is
the job's request_resources call. The controller's grow check then starts a rank there and grows.

The job is submitted without --working-dir (it runs the package installed in this venv; the upload
path is tested in test_ray_job_submit.py). Every node on this machine shares the head's session
directory, and the node the autoscaler adds unpacks the job's working_dir package into that same
directory again ("Removing .../runtime_resources/working_dir_files/_ray_pkg_..." in its
runtime_env_setup log), deleting the current directory of any worker starting on the head at that
moment; torch's MKL then aborts its import ("Intel oneMKL FATAL ERROR: Cannot load
libtorch_cpu.so"). Real nodes have disks of their own and never race like that.
"""

from __future__ import annotations

import math
import time

import pytest

from tests.e2e.raycluster import RayCluster, fake_autoscaling_config, records, running_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

HEAD_CPUS = 1
# The fake multi-node provider by its own type name (the v1 monitor knows its defaults).
AUTOSCALING = fake_autoscaling_config("elastimesh-e2e", 1, HEAD_CPUS, {
    "type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
    "disable_launch_config_check": True})

ALIVE_NODES = "import ray\nray.init(log_to_driver=False)\nprint('NODES=%d' % sum(n['Alive'] for n in ray.nodes()))\n"


def alive_nodes(cluster: RayCluster) -> int:
    out = cluster.python(ALIVE_NODES)
    return int(next(x for x in out.splitlines() if x.startswith("NODES=")).removeprefix("NODES="))


@pytest.fixture(scope="module")
def cluster():
    with running_cluster("em-as-", num_cpus=HEAD_CPUS, autoscaling_config=AUTOSCALING) as c:
        yield c


@pytest.mark.timeout(1500)
def test_job_requests_capacity_and_grows_onto_the_new_node(cluster, tmp_path):
    assert alive_nodes(cluster) == 1  # the autoscaler has no reason to add a node yet
    metrics = tmp_path / "metrics.jsonl"
    args = ["--set", "mesh.dp=1", "--set", "mesh.tp=1", "--set", "elastic.max_dp=2",
            "--set", "elastic.grow_check_s=2", "--set", "train.steps=1000",
            "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", "checkpoint.every=20",
            "--set", f"metrics.path={metrics}"]
    submitted = time.monotonic()
    out = cluster.submit("grow-1", args, wait=False, working_dir=False)
    assert out.returncode == 0, out.stderr[-2000:]

    # Grown: a `grow` event to dp=2 and a few steps trained at dp=2 in that new generation.
    deadline = time.monotonic() + 900
    while True:
        recs = records(metrics)
        grows = [r for r in recs if r.get("event") == "grow"]
        steps = [r for r in recs if "loss" in r]
        if grows and sum(r["generation"] == grows[0]["generation"] for r in steps) >= 3:
            break
        status = cluster.job_status("grow-1")
        assert status in ("PENDING", "RUNNING"), cluster.job_logs("grow-1")[-4000:]
        assert time.monotonic() < deadline, f"no growth: {recs[-3:]}\n{cluster.job_logs('grow-1')[-3000:]}"
        time.sleep(2)
    grown_after = time.monotonic() - submitted
    # The request the job made: one bundle per rank of the dp=2 mesh it may grow to.
    assert cluster.autoscaler_request() == [{"CPU": 1.0}] * 2
    assert alive_nodes(cluster) == 2
    grow = grows[0]
    start = next(r for r in recs if r.get("event") == "start")
    before = [r for r in steps if r["generation"] == start["generation"]]
    after = [r for r in steps if r["generation"] == grow["generation"]]
    assert start["dp"] == 1 and all(r["dp"] == 1 for r in before)  # what the cluster held at first
    # The node may come before the first step (the autoscaler is quick here) or after a few.
    resumed = before[-1]["step"] if before else 0
    assert grow["dp"] == 2 and grow["resumed_from_step"] == resumed
    assert all(r["dp"] == 2 and math.isfinite(r["loss"]) for r in after)
    assert [r["step"] for r in after] == list(range(resumed + 1, after[-1]["step"] + 1))
    print(f"autoscale: submitted -> grown to dp=2 with 3 steps done in {grown_after:.1f}s "
          f"(grew after step {resumed}, recovery_s={grow.get('recovery_s', float('nan')):.1f})")

    stop = cluster.ray("job", "stop", "--address", cluster.dashboard, "grow-1")
    assert stop.returncode == 0, stop.stderr[-2000:]
    assert cluster.wait_job("grow-1", 120) == "STOPPED"
    assert cluster.autoscaler_request() == []  # withdrawn: the autoscaler may now retire the node
