"""Elastic building blocks without processes: requested resizes, which vacant bundles may be refilled,
and how the socket kick recognises a peer."""

from __future__ import annotations

import pytest

from orchestrator.cluster import bundles
from orchestrator.cluster.bundles import NODE_DEATH_GRACE_S, BundleLedger
from orchestrator.config.load import load_config
from orchestrator.control.scaling import fit_dp
from workers import sockets


def test_fit_dp_takes_the_largest_feasible_dp_the_actors_hold():
    cfg = load_config(None, ["mesh.dp=4", "mesh.tp=2", "train.global_batch_size=8", "train.micro_batch_size=2"])
    assert fit_dp(cfg, 4, 8) == 4
    assert fit_dp(cfg, 4, 7) == 2  # 3 replicas fit, but dp=3 does not divide 8 samples into 2s
    assert fit_dp(cfg, 8, 16) == 4  # dp=8 would leave 1 sample per replica: less than a microbatch
    assert fit_dp(cfg, 2, 1) == 0  # not one whole replica (pp*tp=2)
    assert fit_dp(load_config(None, ["mesh.dp=1", "mesh.tp=1", "elastic.max_dp=1"]), 2, 2) == 2  # not capped


class FakePlacement:
    """Placement tables and node liveness as Ray would report them."""

    def __init__(self) -> None:
        self.where: dict[tuple[str, int], str] = {}
        self.alive: set[str] = set()

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(bundles, "bundle_node", lambda pg, index: self.where.get((pg, index), ""))
        monkeypatch.setattr(bundles.ray, "nodes",
                            lambda: [{"NodeID": n, "Alive": True} for n in sorted(self.alive)])


@pytest.fixture
def placement(monkeypatch):
    fake = FakePlacement()
    fake.install(monkeypatch)
    return fake


def test_vacancy_on_a_node_that_may_be_dead_is_not_refilled(placement):
    placement.alive = {"A", "B"}
    placement.where = {("pg", 0): "A", ("pg", 1): "A", ("pg", 2): "B", ("pg", 3): "B"}
    ledger = BundleLedger()
    for actor in range(4):
        ledger.assign(actor, "pg", actor)
    # Node B crashed: its actors are lost, but the GCS still reports B alive and the bundles there.
    ledger.release(2)
    ledger.release(3)
    assert ledger.usable() == []
    # Ray re-placed them on a new node C: moved, so C is up and they are ours to refill.
    placement.where.update({("pg", 2): "C", ("pg", 3): "C"})
    placement.alive = {"A", "C"}
    assert ledger.usable() == [("pg", 2), ("pg", 3)]
    ledger.assign(4, "pg", 2)
    assert ledger.usable() == [("pg", 3)]


def test_vacancy_beside_a_live_actor_or_after_the_grace_is_refilled(placement):
    placement.alive = {"A", "B"}
    placement.where = {("pg", 0): "A", ("pg", 1): "A", ("pg", 2): "B"}
    ledger = BundleLedger()
    for actor in range(3):
        ledger.assign(actor, "pg", actor)
    ledger.release(1)  # an actor died, its node A still runs actor 0: A is up
    assert ledger.usable() == [("pg", 1)]
    ledger.release(2)  # the only actor on B died: trusted only once the GCS would have noticed
    assert ledger.usable() == [("pg", 1)]
    for vacancy in ledger.vacant:
        vacancy.since -= NODE_DEATH_GRACE_S + 1
    assert ledger.usable() == [("pg", 1), ("pg", 2)]
    placement.alive = {"A"}  # ...unless Ray says B is dead
    assert ledger.usable() == [("pg", 1)]


def test_kick_matches_ipv4_peers_behind_ipv6_sockets():
    # TCPStore/gloo sockets are AF_INET6: psutil shows an IPv4 peer as ::ffff:a.b.c.d.
    assert sockets._plain_ip("::ffff:192.0.2.2") == "192.0.2.2"
    assert sockets._plain_ip("192.0.2.2") == "192.0.2.2"
    assert sockets.endpoint("127.0.0.1", 80) == ("127.0.0.1", 80)
