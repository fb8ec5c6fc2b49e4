"""What the e2e tests on namespace hosts share: the check that this machine can make them, and a Ray
cluster whose head (0 CPUs, as Ray advises for large clusters) holds the bridge address in the root
namespace and whose worker nodes each run on a host of their own (testbed.netns_hosts).

Namespace hosts need root and `ip netns`. Elsewhere the tests skip with the reason; under ``CI=true``
they fail instead, so CI cannot pass with them skipped (.ci/run also checks the e2e pass ran them).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

from testbed.netns_hosts import HostNet, unavailable_reason
from tests.e2e.raycluster import RayCluster


def require_hosts() -> None:
    """Skip (fail under CI=true) when namespace hosts cannot be made here."""
    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"namespace hosts are required under CI=true: {reason}")
    pytest.skip(f"namespace hosts: {reason}")


@contextmanager
def hosts_cluster(prefix: str, workers: int, cpus: int, *, loopback_hostnames: bool = False,
                  node_env: dict | None = None):
    """(cluster, net): a Ray head with 0 CPUs on the bridge address, and ``workers`` worker nodes of
    ``cpus`` CPUs, one per namespace host, started one after another. Everything is torn down
    afterwards, whatever happened (and at interpreter exit, should this frame never finish)."""
    require_hosts()
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))  # short: Ray's unix socket paths
    net = HostNet(workers, root, loopback_hostnames=loopback_hostnames)
    cluster = RayCluster(root, num_cpus=0, node_ip=net.bridge_ip)
    try:
        cluster.start()
        for i, host in enumerate(net.hosts):
            cluster.add_node(cpus, env=node_env, on_host=(net, host))
            cluster.wait_nodes(2 + i)
        yield cluster, net
    finally:
        cluster.shutdown()
        net.teardown()
        shutil.rmtree(root, ignore_errors=True)
