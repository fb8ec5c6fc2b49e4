"""Two Ray nodes sharing one IP address (issue 35): processes are told apart by Ray node id, never by
address. ``ray.cluster_utils.Cluster`` starts its nodes on this machine, all at 127.0.0.1, as pods
on one host's network are. On such nodes an actor's pid means something only on its own node (in a
pod it is its own pid namespace's), so the driver signals pids on its own Ray node only, and judges no
process of another node gone. Here every rank runs on a worker node (the head, the driver's node,
has no CPUs); the pid recorded for the victim is planted to be an unrelated process of this host, as
a pid from another namespace would read here, and another rank's to be no process at all."""

from __future__ import annotations

import subprocess
import time

import psutil
import pytest

from testbed.ray_cluster import make_group, multinode_ray

pytestmark = pytest.mark.ray


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(300)
def test_killing_a_rank_on_a_node_sharing_the_drivers_address_kills_no_other_process():
    bystander = subprocess.Popen(["sleep", "600"])
    done = subprocess.Popen(["true"])
    done.wait()  # its pid names no process now
    try:
        with multinode_ray(2, cpus=2):
            group = make_group(3)
            try:
                assert len(set(group.node_ips.values())) == 1  # one address...
                assert len(set(group.node_ids.values())) == 2  # ...two Ray nodes hold the ranks
                victim, other, third = group.live_ids
                real = {a: group.pids[a] for a in group.live_ids}
                group.pids[victim] = bystander.pid
                group.pids[other] = done.pid
                assert group.exited(group.live_ids) == set()  # a live remote rank is never "gone"
                group.kill_now([victim])
                deadline = time.monotonic() + 60
                while not _gone(real[victim]) and time.monotonic() < deadline:  # Ray ends it
                    time.sleep(0.2)
                assert _gone(real[victim])
                assert bystander.poll() is None  # the pid it was recorded under: untouched
                assert not _gone(real[other]) and not _gone(real[third])
                assert group.live_ids == [other, third]
            finally:
                group.shutdown()
    finally:
        bystander.kill()
        bystander.wait()
