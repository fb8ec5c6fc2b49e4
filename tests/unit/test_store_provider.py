"""Where the rendezvous store is hosted and what it binds to (pure decisions, no Ray)."""

from __future__ import annotations

import socket

import pytest

from orchestrator.cluster.store_provider import FixedStore, StoreSource, host_candidates, one_machine
from testbed.controller_run import make  # noqa: F401  (the fixture)
from workers.store import bind_host, listen_on

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


def test_the_store_binds_loopback_or_a_private_node_address_never_a_public_one():
    assert bind_host("10.1.2.3", loopback=True) == "127.0.0.1"
    assert bind_host("fd00::5", loopback=True) == "::1"
    for private in ("10.1.2.3", "172.17.0.2", "192.168.1.9", "fd00::5", "100.64.0.1"):
        assert bind_host(private, loopback=False) == private
    for public in ("8.8.8.8", "2001:4860:4860::8888"):
        with pytest.raises(RuntimeError, match="public"):
            bind_host(public, loopback=False)


def test_every_rendezvous_key_carries_the_runs_secret_and_no_repr_shows_it(monkeypatch):
    from meshspeak.mesh import MeshShape
    from meshspeak.messages import JoinSpec
    from workers import groups

    secret = "ab" * 16
    spec = JoinSpec(1, MeshShape(1, 1, 1), 0, "127.0.0.1", 1, "run-gen1", store_secret=secret)
    assert secret not in repr(spec)
    seen = {}

    class Stop(Exception):
        pass

    def prefix_store(prefix, store):
        seen["prefix"] = prefix
        raise Stop

    monkeypatch.setattr(groups, "check_store", lambda *a, **k: None)  # no store listens on port 1
    monkeypatch.setattr(groups.dist, "TCPStore", lambda *a, **k: object())
    monkeypatch.setattr(groups.dist, "PrefixStore", prefix_store)
    import torch

    with pytest.raises(Stop):
        groups.build_process_groups(store_addr="127.0.0.1", store_port=1, generation=1, shape=spec.shape,
                                    world_rank=0, timeout_s=5, device=torch.device("cpu"),
                                    store_prefix=spec.store_prefix, store_secret=spec.store_secret)
    assert seen["prefix"] == f"{secret}-run-gen1"



def test_the_controller_hands_every_rank_its_runs_128_bit_secret(make, monkeypatch):
    """One secret per run (16 random bytes, hex), the same for every rank and generation, another for
    the next run; it reaches the ranks only as the JoinSpec argument of a (Ray) call."""
    from testbed import fake_group

    seen = []
    real = fake_group.FakeRank.join_generation
    monkeypatch.setattr(fake_group.FakeRank, "join_generation",
                        lambda self, spec, *rest: seen.append(spec) or real(self, spec, *rest))
    first = make()
    first.steps(2)
    first_secrets = {spec.store_secret for spec in seen}
    first.close()  # the first run stops (and gives up its lease on the checkpoint directory)
    seen.clear()
    make().steps(1)
    (one,), (other,) = first_secrets, {spec.store_secret for spec in seen}
    assert len(one) == 32 and int(one, 16) >= 0 and one != other
