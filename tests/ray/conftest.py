"""Local-Ray fixtures: one embedded Ray and one pool of RankActors per test module.

Reusing the same actor processes across tests is deliberate: every test then also proves that
re-forming groups in long-lived processes works (and the pids let tests assert "no restart").
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_local():
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def store_address(ray_local):
    from workers.store import StoreHost

    host = StoreHost.remote()
    yield ray.get(host.address.remote(), timeout=60)
    ray.kill(host)


def make_group(count: int):
    from orchestrator.cluster.worker_group import ActorResources, WorkerGroup

    group = WorkerGroup(ActorResources(cpus=1, gpus=0), placement_timeout_s=60)
    group.add(count)
    return group


@pytest.fixture(scope="module")
def pool4(ray_local):
    group = make_group(4)
    yield group
    group.shutdown()


@contextmanager
def multinode_ray(worker_nodes: int, cpus: int = 2):
    """A local multi-node Ray for this process (``ray.cluster_utils.Cluster``): a CPU-less head (the
    driver's node: the store host lives there) and ``worker_nodes`` nodes of ``cpus`` slots. Yields
    (cluster, worker nodes). Metrics collection off: after a node loss Ray's metric export (GCS + a
    dashboard agent) burns a core for tens of seconds, which on a 2-core box starves the ranks."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        pytest.skip("another Ray is connected in this process")
    nodes = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "_system_config": {"enable_metrics_collection": False}})
    workers = [nodes.add_node(num_cpus=cpus) for _ in range(worker_nodes)]
    ray.init(address=nodes.address, log_to_driver=False)
    try:
        yield nodes, workers
    finally:
        ray.shutdown()
        nodes.shutdown()
