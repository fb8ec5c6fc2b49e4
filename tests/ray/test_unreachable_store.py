"""Bad input (issue 35): ranks that cannot reach the rendezvous store's address. The run stops with one
line naming the address and the port to open (exit 2: ``ClusterNetworkError``), within the store's reach
bound (``workers.reach.STORE_REACH_S``) instead of each rank waiting out the store timeout and then being
killed as hung; no rank is killed for it, and the driver imported no torch to read the ranks' errors
(tests/ray/test_driver_torch_free.py runs a whole run so)."""

from __future__ import annotations

import socket

import pytest

from orchestrator.config.load import load_config
from orchestrator.errors import ClusterNetworkError
from testbed.ray_cluster import make_group
from testbed.ray_harness import events, make_controller
from testbed.reference import TEST_LR

pytestmark = pytest.mark.ray


@pytest.mark.timeout(180)
def test_a_store_the_ranks_cannot_reach_stops_the_run_with_one_line(ray_local, tmp_path):
    with socket.socket() as s:  # a port on loopback that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = load_config(None, [TEST_LR, "mesh.dp=2", "mesh.pp=1", "mesh.tp=1", "train.steps=2",
                             "checkpoint.memory_every=0", f"metrics.path={tmp_path / 'm.jsonl'}"])
    group = make_group(2)
    try:
        pids = dict(group.pids)
        controller = make_controller(cfg, group, ("127.0.0.1", port))
        with pytest.raises(ClusterNetworkError) as info:
            controller.run()
        line = str(info.value)
        assert info.value.exit_code == 2 and "\n" not in line
        assert f"cannot reach the rendezvous store at 127.0.0.1:{port} (Connection refused" in line, line
        assert f"open TCP port {port} on 127.0.0.1" in line, line
        assert group.pids == pids  # nobody killed as hung, nobody restarted
        failure, = events(tmp_path / "m.jsonl", "failure")
        assert failure["reason"] == line
    finally:
        group.shutdown()
