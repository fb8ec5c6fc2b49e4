"""WorkerGroup.add never refills a vacant bundle on a draining node (the placement ledger and the drain
list faked; no Ray started).

After an evacuation the drained node keeps the job's vacant bundles until its deadline (a spot notice
can be 120 s, more than the ledger's ``NODE_DEATH_GRACE_S``); Ray starts no new actor there, so an
actor sent to such a bundle would only time out. ``free_slots`` already left those bundles out; ``add``
must pick from the same set.
"""

from __future__ import annotations

import pytest

from orchestrator.cluster import bundles, worker_group
from orchestrator.cluster.bundles import NODE_DEATH_GRACE_S
from orchestrator.cluster.worker_group import ActorResources, WorkerGroup
from orchestrator.errors import WorkerGroupStartupError


def test_add_skips_vacant_bundles_on_a_draining_node(monkeypatch):
    where = {("pg", 0): "A", ("pg", 1): "A", ("pg", 2): "B", ("pg", 3): "B"}
    monkeypatch.setattr(bundles, "bundle_node", lambda pg, index: where.get((pg, index), ""))
    monkeypatch.setattr(bundles.ray, "nodes", lambda: [{"NodeID": n, "Alive": True} for n in ("A", "B")])
    group = WorkerGroup(ActorResources(cpus=1, gpus=0), placement_timeout_s=1)
    for actor in range(4):
        group._bundles.assign(actor, "pg", actor)
    group._bundles.release(1)  # a rank lost on A, beside a live one
    group._bundles.release(2)  # B's ranks evacuated: B drains, long enough for the grace to pass
    group._bundles.release(3)
    for vacancy in group._bundles.vacant:
        vacancy.since -= NODE_DEATH_GRACE_S + 1
    monkeypatch.setattr(group, "draining_nodes", lambda: {"B": 60.0})
    assert group.placed_vacancies() == [("pg", 1)]

    asked: list[int] = []

    def new_placement_group(bundle_list, strategy):
        asked.append(len(bundle_list))
        return "new-pg"

    monkeypatch.setattr(worker_group, "placement_group", new_placement_group)
    monkeypatch.setattr(worker_group, "remove_placement_group", lambda pg: None)
    monkeypatch.setattr(group, "_wait_placed", lambda pg, count, wait_s: False)  # nothing fits: stop there
    monkeypatch.setattr(group, "_unplaceable", lambda count, wait_s: f"{count} unplaceable")
    monkeypatch.setattr(worker_group.ray, "remote", lambda *a, **k: pytest.fail("would start an actor"))
    with pytest.raises(WorkerGroupStartupError):
        group.add(3, wait_s=0)
    assert asked == [2]  # one vacancy refilled (on A); B's two are not, so two new bundles were asked for
