"""The benches' node removal (``remove_node`` in bench/common.py) takes every process of the node at once, as a
machine that vanishes would: also an actor the caller does not know the pid of (one still starting
when the chaos campaign removes its node). Left to notice its raylet's death by itself, such a process
lived on for a second in the chaos campaign, answered the failure path's liveness probe and was
promoted as a spare; the next generation's join then failed on it."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from testbed.ray_cluster import multinode_ray

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from common import node_processes, remove_node  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_removing_a_node_kills_its_actors_whose_pids_the_caller_does_not_know():
    with multinode_ray(1, cpus=1) as (nodes, (worker,)):
        @ray.remote(num_cpus=1)
        class OnTheWorker:
            def pid(self) -> int:
                return os.getpid()

        pid = ray.get(OnTheWorker.remote().pid.remote(), timeout=120)
        assert pid in node_processes(worker)  # the raylet's child: its worker process
        removed = []
        real_remove = nodes.remove_node
        # The raylet stays up here: only remove_node's own kills can end the actor (left to notice its
        # raylet's death, it would exit by itself after a while, and the test could not tell).
        nodes.remove_node = lambda node, allow_graceful=True: removed.append(node)
        try:
            remove_node(nodes, worker, [])  # no pid given
            for _ in range(1000):  # SIGKILL is delivered asynchronously; bounded by rounds
                if _gone(pid):
                    break
                time.sleep(0.01)
            assert removed == [worker] and _gone(pid)
        finally:
            nodes.remove_node = real_remove
            nodes.remove_node(worker, allow_graceful=False)
