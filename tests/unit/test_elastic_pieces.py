"""Elastic building blocks without processes: requested resizes and how the socket kick recognises a
peer (placement groups: tests/unit/test_bundle_reuse.py)."""

from __future__ import annotations

from orchestrator.config.load import load_config
from orchestrator.control.scaling import policy_for
from workers import sockets


def test_fit_dp_takes_the_largest_feasible_dp_the_actors_hold():
    cfg = load_config(None, ["mesh.dp=4", "mesh.tp=2", "train.global_batch_size=8", "train.micro_batch_size=2"])
    policy = policy_for(cfg)
    assert policy.fit(4, 8) == 4
    assert policy.fit(4, 7) == 2  # 3 replicas fit, but dp=3 does not divide 8 samples into 2s
    assert policy.fit(8, 16) == 4  # dp=8 would leave 1 sample per replica: less than a microbatch
    assert policy.fit(2, 1) == 0  # not one whole replica (pp*tp=2)
    assert policy_for(load_config(None, ["mesh.dp=1", "mesh.tp=1", "elastic.max_dp=1"])).fit(2, 2) == 2  # not capped


def test_kick_matches_ipv4_peers_behind_ipv6_sockets():
    # TCPStore/gloo sockets are AF_INET6: psutil shows an IPv4 peer as ::ffff:a.b.c.d.
    assert sockets._plain_ip("::ffff:192.0.2.2") == "192.0.2.2"
    assert sockets._plain_ip("192.0.2.2") == "192.0.2.2"
    assert sockets.endpoint("127.0.0.1", 80) == ("127.0.0.1", 80)
