"""Where the rendezvous store is hosted and what it binds to (pure decisions, no Ray)."""

from __future__ import annotations

import socket

import pytest

from orchestrator.cluster.store_provider import FixedStore, StoreSource, host_candidates, one_machine
from workers.store import listen_on

HEAD = {"node:__internal_head__": 1.0, "CPU": 3.0}


def node(node_id: str, ip: str = "10.0.0.1", *, alive: bool = True, head: bool = False) -> dict:
    return {"NodeID": node_id, "NodeManagerAddress": ip, "Alive": alive,
            "Resources": dict(HEAD) if head else {"CPU": 2.0}}


def test_loopback_only_when_every_node_shares_the_store_nodes_ip():
    assert one_machine("10.0.0.1", ["10.0.0.1", "10.0.0.1"])  # two raylets on one machine
    assert not one_machine("10.0.0.1", ["10.0.0.1", "10.0.0.2"])  # a node elsewhere needs the real address
    assert not one_machine("10.0.0.1", [])
    assert not one_machine("", ["10.0.0.1"])  # the store's node is unknown: never loopback


def test_candidates_driver_node_first_then_head_then_others_skipping_dead_and_draining():
    nodes = [node("w1"), node("head", head=True), node("drv"), node("dead", alive=False), node("w2")]
    assert host_candidates("drv", nodes) == ["drv", "head", "w1", "w2"]
    assert host_candidates("drv", nodes, draining={"drv"}) == ["head", "w1", "w2"]
    assert host_candidates("dead", nodes) == ["head", "w1", "drv", "w2"]
    assert host_candidates("head", nodes, draining={"w1"}) == ["head", "drv", "w2"]
    assert host_candidates("x", [node("a", alive=False)]) == []


def test_fixed_store_is_a_store_source():
    src = FixedStore(("127.0.0.1", 1234))
    assert isinstance(src, StoreSource) and src.address() == ("127.0.0.1", 1234) and src.healthy()
    assert not isinstance(("127.0.0.1", 1234), StoreSource)


@pytest.mark.parametrize("host", ["127.0.0.1"])
def test_listen_on_binds_only_the_given_address(host):
    sock = listen_on(host)
    try:
        bound, port = sock.getsockname()[:2]
        assert bound == host and port > 0
        socket.create_connection((host, port), timeout=5).close()
    finally:
        sock.close()
