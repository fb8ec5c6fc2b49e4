"""When a vacant bundle may be refilled at once instead of after ``NODE_DEATH_GRACE_S`` (Ray's placement
table, node list, raylet probe and actor errors faked; no Ray started).

A bundle whose actor Ray reported dead of its *worker process* (the raylet on that node saw it die) is
on a node that was up then; if that raylet still accepts a connection, the bundle is refilled now. A
node death, an unknown cause, or a raylet that does not answer keeps the grace (docs/design.md:
Bundle reuse).
"""

from __future__ import annotations

import pytest
from ray.core.generated.common_pb2 import ActorDiedErrorContext
from ray.exceptions import ActorDiedError, RayActorError

from orchestrator.cluster import bundles, worker_group
from orchestrator.cluster.bundles import NODE_DEATH_GRACE_S, BundleLedger
from orchestrator.cluster.worker_group import ActorResources, WorkerGroup, worker_process_died

WORKER_DIED = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
               "Worker exit detail: Worker exits unexpectedly by a signal. SIGKILL")
NODE_DIED = "The actor died because its node has died. Node Id: abc"


def died(message: str, *, preempted: bool = False) -> ActorDiedError:
    ctx = ActorDiedErrorContext(error_message=message, actor_id=b"\x01" * 16, class_name="RankActor")
    if preempted:
        ctx.node_death_info.reason = ctx.node_death_info.AUTOSCALER_DRAIN_PREEMPTED
    return ActorDiedError(ctx)


class FakeCluster:
    """Placement tables, the GCS's node list and which raylets accept a connection now."""

    def __init__(self, monkeypatch) -> None:
        self.where: dict[tuple[str, int], str] = {}
        self.alive: set[str] = set()
        self.listening: set[str] = set()
        self.probed: list[str] = []
        monkeypatch.setattr(bundles, "bundle_node", lambda pg, index: self.where.get((pg, index), ""))
        monkeypatch.setattr(bundles.ray, "nodes", lambda: [{"NodeID": n, "Alive": True} for n in sorted(self.alive)])
        monkeypatch.setattr(bundles, "raylet_listening", self._probe)

    def _probe(self, node: dict) -> bool:
        self.probed.append(node["NodeID"])
        return node["NodeID"] in self.listening


@pytest.fixture
def cluster(monkeypatch):
    return FakeCluster(monkeypatch)


def two_nodes(cluster) -> BundleLedger:
    """Actor 0 on node A, actor 1 alone on node B."""
    cluster.alive = cluster.listening = {"A", "B"}
    cluster.where = {("pg", 0): "A", ("pg", 1): "B"}
    ledger = BundleLedger()
    ledger.assign(0, "pg", 0)
    ledger.assign(1, "pg", 1)
    return ledger


def test_a_worker_process_death_on_a_live_node_frees_the_bundle_at_once(cluster):
    ledger = two_nodes(cluster)
    ledger.release(1, node_was_up=True)
    assert ledger.usable() == [("pg", 1)]  # before: waited NODE_DEATH_GRACE_S with dp down meanwhile
    assert cluster.probed == ["B"]


def test_an_unknown_cause_keeps_the_grace_without_probing(cluster):
    ledger = two_nodes(cluster)
    ledger.release(1)  # a hang we killed, a node death, a failed start: nothing says B is up
    assert ledger.usable() == []
    assert cluster.probed == []


def test_a_node_that_died_after_its_worker_keeps_the_grace(cluster):
    ledger = two_nodes(cluster)
    ledger.release(1, node_was_up=True)
    cluster.listening = {"A"}  # B's raylet went too, and the GCS has not noticed yet
    assert ledger.usable() == []
    cluster.listening = {"A", "B"}  # a later answer (a port reused?) does not bring the trust back
    assert ledger.usable() == []
    ledger.vacant[0].since -= NODE_DEATH_GRACE_S + 1
    assert ledger.usable() == [("pg", 1)]  # the GCS had its time to notice and still calls B alive


def test_a_node_the_gcs_calls_dead_or_draining_is_never_refilled(cluster):
    ledger = two_nodes(cluster)
    ledger.release(1, node_was_up=True)
    assert ledger.usable(draining={"B"}) == []
    cluster.alive = {"A"}
    assert ledger.usable() == []


def test_only_a_worker_process_death_counts_as_the_node_being_up():
    assert worker_process_died(died(WORKER_DIED))
    assert not worker_process_died(died(NODE_DIED))
    assert not worker_process_died(died(WORKER_DIED, preempted=True))
    assert not worker_process_died(ActorDiedError())  # cause unknown
    assert not worker_process_died(RayActorError())


def test_the_group_passes_the_cause_from_a_failed_call_to_the_ledger(monkeypatch, cluster):
    cluster.alive = cluster.listening = {"A", "B", "C"}
    cluster.where = {("pg", 0): "A", ("pg", 1): "B", ("pg", 2): "C"}
    group = WorkerGroup(ActorResources(cpus=1, gpus=0), placement_timeout_s=1)
    for actor in range(3):
        group._bundles.assign(actor, "pg", actor)
        group.actors[actor] = object()
    errors = {"ref1": died(WORKER_DIED), "ref2": died(NODE_DIED)}

    def get(ref, timeout=None):
        if ref in errors:
            raise errors[ref]
        return "ok"

    monkeypatch.setattr(worker_group.ray, "wait", lambda refs, num_returns=1, timeout=None: (refs[:1], refs[1:]))
    monkeypatch.setattr(worker_group.ray, "get", get)
    monkeypatch.setattr(worker_group.ray, "kill", lambda handle, no_restart=True: None)
    outcome = group.collect({"ref0": 0, "ref1": 1, "ref2": 2}, timeout_s=5)
    assert outcome.results == {0: "ok"} and set(outcome.dead) == {1, 2}
    group.kill([1, 2])
    assert group.placed_vacancies() == [("pg", 1)]  # B's raylet saw its worker die; C's node died
