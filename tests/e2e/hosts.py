"""What the e2e tests on namespace hosts share: the check that this machine can make them, and a Ray
cluster whose head (0 CPUs, as Ray advises for large clusters) holds the bridge address in the root
namespace and whose worker nodes each run on a host of their own (testbed.netns_hosts).

Namespace hosts need root and `ip netns`. Elsewhere the tests skip with the reason; under ``CI=true``
they fail instead, so CI cannot pass with them skipped (.ci/run also checks the e2e pass ran them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import pytest

from testbed.netns_hosts import HostNet, unavailable_reason
from tests.e2e.raycluster import REPO, RayCluster


def require_hosts() -> None:
    """Skip (fail under CI=true) when namespace hosts cannot be made here."""
    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"namespace hosts are required under CI=true: {reason}")
    pytest.skip(f"namespace hosts: {reason}")


@contextmanager
def hosts_cluster(prefix: str, workers: int, cpus: int | list[int], *, loopback_hostnames: bool = False,
                  node_env: dict | None = None):
    """(cluster, net): a Ray head with 0 CPUs on the bridge address, and ``workers`` worker nodes of
    ``cpus`` CPUs (or ``cpus[i]`` on host i), one per namespace host, started one after another.
    Everything is torn down afterwards, whatever happened (and at interpreter exit, should this frame
    never finish)."""
    per_host = list(cpus) if isinstance(cpus, list) else [cpus] * workers
    assert len(per_host) == workers, (cpus, workers)
    require_hosts()
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))  # short: Ray's unix socket paths
    net = HostNet(workers, root, loopback_hostnames=loopback_hostnames)
    cluster = None
    try:
        cluster = start_head(root, net)
        for i, host in enumerate(net.hosts):
            start_node(cluster, net, host, per_host[i], node_env)
            cluster.wait_nodes(2 + i)
        yield cluster, net
    finally:
        if cluster is not None:
            cluster.shutdown()
        net.teardown()
        shutil.rmtree(root, ignore_errors=True)


def start_head(root: Path, net: HostNet, attempts: int = 2) -> RayCluster:
    """The 0-CPU head on the bridge address; tried again in a fresh folder when `ray start --head` gives
    up (its 30 s for the head's node to register, hard-coded in Ray 2.60, was missed here under a load
    of ~20 on 2 cores, several times in a row; a head without its dashboard started within it)."""
    for attempt in range(1, attempts + 1):
        folder = root / f"head{attempt}"
        folder.mkdir()
        cluster = RayCluster(folder, num_cpus=0, node_ip=net.bridge_ip)
        try:
            cluster.start()
            return cluster
        except RuntimeError:
            cluster.shutdown()
            if attempt == attempts:
                raise
            print(f"ray start --head failed (attempt {attempt}); again", flush=True)
    raise AssertionError("unreachable")


def start_node(cluster: RayCluster, net: HostNet, host, cpus: int, env: dict | None = None, attempts: int = 4):
    """A Ray node on ``host``; tried again (after killing what the failed try left there) when `ray start`
    gives up: it gives its raylet 30 s to register (hard-coded in Ray 2.60), which a loaded 2-core
    machine can miss. Returns its `ray start` process."""
    for attempt in range(1, attempts + 1):
        try:
            return cluster.add_node(cpus, env=env, on_host=(net, host))
        except RuntimeError:
            net.kill_host(host)
            if attempt == attempts:
                raise
            print(f"ray start on {host.hostname} failed (attempt {attempt}); again", flush=True)
    raise AssertionError("unreachable")


def rank_log(root: Path) -> list[tuple[float, str]]:
    """(time, line) of every timestamped line the rank actors logged, on every node of the cluster (a
    node's `ray start` keeps its logs under the cluster's root)."""
    lines = []
    for log in sorted(root.glob("ray*/session_2*/logs/worker-*.err")):
        for line in log.read_text(errors="replace").splitlines():
            try:
                when = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except ValueError:
                continue
            lines.append((when, line))
    return sorted(lines)


@contextmanager
def armed_driver(cluster: RayCluster, module: str, spec: dict, log: Path, timeout_s: float = 600):
    """(driver process, what it armed): runs ``python -m module <spec as JSON>`` against ``cluster`` (its
    output to ``log``) and waits until it wrote ``spec["armed"]`` (the fault it armed, as JSON), failing
    with the log's tail if it exits or the time runs out first. The driver is killed on leaving, should
    it still run."""
    env = {**cluster.env, "RAY_ADDRESS": cluster.gcs_address, "PYTHONPATH": str(REPO)}
    with open(log, "ab") as out:
        driver = subprocess.Popen([sys.executable, "-m", module, json.dumps(spec)],
                                  env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + timeout_s
        while not Path(spec["armed"]).exists():
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        yield driver, json.loads(Path(spec["armed"]).read_text())
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
