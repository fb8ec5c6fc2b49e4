"""Ray set-ups the Ray tests and the benchmarks share: a worker group of real RankActors, and a local
multi-node Ray (``ray.cluster_utils.Cluster``).

pytest is imported only where a test needs it (``multinode_ray``'s skip): the benchmarks import this
module on a plain install, which has no pytest."""

from __future__ import annotations

from contextlib import contextmanager

import ray


def make_group(count: int):
    from orchestrator.cluster.worker_group import ActorResources, WorkerGroup

    group = WorkerGroup(ActorResources(cpus=1, gpus=0), placement_timeout_s=60)
    group.add(count)
    return group


@contextmanager
def multinode_ray(worker_nodes: int, cpus: int = 2):
    """A local multi-node Ray for this process (``ray.cluster_utils.Cluster``): a CPU-less head (the
    driver's node: the store host lives there) and ``worker_nodes`` nodes of ``cpus`` slots. Yields
    (cluster, worker nodes). Metrics collection off: after a node loss Ray's metric export (GCS + a
    dashboard agent) burns a core for tens of seconds, which on a 2-core box starves the ranks."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        import pytest  # only the tests come here

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
