"""One placement group per actor (orchestrator/cluster/bundles.py): the job never holds a bundle Ray cannot
place, new groups are packed onto nodes, and a request that cannot be placed is withdrawn (Ray's
placement API, node list and free resources faked; no Ray started).

Issue 29: a group kept after its node died is re-placed by Ray 2.60's GCS without backoff, spinning
the head at ~80% of a core. Issue 25: a spare that could not be placed left a pending group behind
every ~180 s.
"""

from __future__ import annotations

import sys
from itertools import count
from types import SimpleNamespace

import pytest

from orchestrator.cluster import bundles, worker_group
from orchestrator.cluster.bundles import RETRY_FIRST_S, WATCH_S, Placements, target_nodes
from orchestrator.cluster.worker_group import START_GRACE_S, ActorResources, WorkerGroup


class FakePG:
    def __init__(self, ident: int, node: str | None) -> None:
        self.id, self.target, self.bundle_count = ident, node, 1
        self.node = ""  # where it is placed ("" while pending)
        self.removed = False


class FakeCluster:
    """Placement groups as the GCS would hold them: placed on their target when it has room."""

    def __init__(self, monkeypatch, room: dict[str, int]) -> None:
        self.room = dict(room)  # node -> free bundles the free-resource view reports
        self.places = True  # False: groups stay pending whatever the view says (capacity absent)
        self.alive = set(room)
        self.groups: list[FakePG] = []
        self.table_calls = 0
        ids = count()

        def create(bundle_list, strategy, _soft_target_node_id=None):
            assert strategy == "STRICT_PACK" and len(bundle_list) == 1
            pg = FakePG(next(ids), _soft_target_node_id)
            if self.places and _soft_target_node_id and self.room.get(_soft_target_node_id, 0) > 0:
                pg.node = _soft_target_node_id
                self.room[pg.node] -= 1
            self.groups.append(pg)
            return pg

        def remove(pg):
            assert not pg.removed, "removed twice"
            pg.removed = True
            if pg.node in self.alive:
                self.room[pg.node] += 1

        def table(pg):
            self.table_calls += 1
            state = "REMOVED" if pg.removed else "RESCHEDULING" if pg.node and pg.node not in self.alive \
                else "CREATED" if pg.node else "PENDING"
            return {"state": state, "bundles_to_node_id": {0: pg.node} if pg.node else {}}

        monkeypatch.setattr(bundles, "placement_group", create)
        monkeypatch.setattr(bundles, "remove_placement_group", remove)
        monkeypatch.setattr(bundles, "placement_group_table", table)
        monkeypatch.setattr(bundles, "alive_nodes", lambda: frozenset(self.alive))
        monkeypatch.setattr(bundles, "free_by_node", lambda: {n: {"CPU": float(self.room[n])}
                                                             for n in sorted(self.alive)})

    def pending(self) -> list[FakePG]:
        return [pg for pg in self.groups if not pg.removed and not pg.node]

    def held(self) -> list[FakePG]:
        return [pg for pg in self.groups if not pg.removed]

    def kill_node(self, node: str) -> None:
        self.alive.discard(node)
        del self.room[node]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# -- which node each new group asks for -----------------------------------------------------------
def test_pack_takes_the_tightest_node_that_holds_all_else_as_few_nodes_as_possible():
    assert target_nodes(2, {"A": 4, "B": 2, "C": 3}, "PACK") == ["B", "B"]
    assert target_nodes(5, {"A": 4, "B": 2, "C": 3}, "PACK") == ["A"] * 4 + ["C"]
    assert target_nodes(3, {"A": 1}, "PACK") == ["A", None, None]  # no room: Ray decides (pending)
    assert target_nodes(1, {}, "PACK") == [None]


def test_spread_puts_one_per_node_where_fewest_of_ours_run():
    assert target_nodes(2, {"A": 4, "B": 1, "C": 2}, "SPREAD", {"A": 2}) == ["C", "B"]
    assert target_nodes(4, {"A": 2, "B": 1}, "SPREAD") == ["A", "B", "A", None]


# -- a group's life is its actor's -----------------------------------------------------------------
def test_a_released_actor_takes_its_group_with_it_and_its_room_is_free_again(monkeypatch):
    cluster = FakeCluster(monkeypatch, {"A": 2, "B": 2})
    p = Placements({"CPU": 1.0})
    slots = p.slots(4, "PACK", (), None)
    for actor, slot in enumerate(slots):
        p.assign(actor, slot)
    assert sorted(pg.node for pg in cluster.held()) == ["A", "A", "B", "B"]
    assert p.free_slots() == 0
    p.release(1)
    assert len(cluster.held()) == 3 and p.free_slots() == 1  # before: the bundle stayed reserved


def test_a_node_the_gcs_declares_dead_loses_its_groups_at_the_next_watch(monkeypatch):
    cluster = FakeCluster(monkeypatch, {"A": 2, "B": 2})
    clock = Clock()
    p = Placements({"CPU": 1.0}, clock=clock)
    for actor, slot in enumerate(p.slots(4, "PACK", (), None)):
        p.assign(actor, slot)
        if actor < 3:  # actor 3 has not answered yet: its node is not known
            p.placed(actor, slot[0].node)
    on_b = {a for a, pg in p.own.items() if pg.node == "B"}
    assert p.watch() == set()
    calls = cluster.table_calls
    clock.t += WATCH_S
    assert p.watch() == set() and cluster.table_calls == calls  # nothing changed: one node-list call only
    cluster.kill_node("B")  # the groups there would now be RESCHEDULING, forever on a full cluster
    assert p.watch() == set()  # within WATCH_S of the last look: not yet
    clock.t += WATCH_S
    assert p.watch() == on_b and p.lost == on_b
    assert all(pg.node == "A" for pg in cluster.held())  # no group of ours left on the dead node
    for actor in on_b:  # the failure path kills them later: nothing is removed twice
        p.release(actor)
    assert p.lost == set() and len(cluster.held()) == 2


def test_a_reserved_bundle_is_used_first_never_removed_and_reused(monkeypatch):
    cluster = FakeCluster(monkeypatch, {"A": 2})

    class Reserved:
        bundle_count = 2

    reserved = Reserved()
    monkeypatch.setattr(bundles, "bundle_node", lambda pg, index: "A")
    p = Placements({"CPU": 1.0}, reserved=reserved)
    slots = p.slots(3, "PACK", (), None)
    assert slots[:2] == [(reserved, 0), (reserved, 1)] and len(cluster.groups) == 1
    for actor, slot in enumerate(slots):
        p.assign(actor, slot)
    p.release(0)
    assert p.reserved_free == [(reserved, 0)] and not any(pg.removed for pg in cluster.groups)
    assert p.free_slots() == 1 + 1  # the reserved bundle, and the room A still has


def test_free_slots_leave_out_draining_nodes(monkeypatch):
    FakeCluster(monkeypatch, {"A": 1, "B": 3})
    p = Placements({"CPU": 1.0})
    assert p.free_slots() == 4 and p.free_slots(draining={"B"}) == 1
    assert target_nodes(2, p.room(draining={"B"}), "PACK") == ["A", None]


# -- issue 25: a request that cannot be placed is withdrawn -----------------------------------------
def controller_loop(group: WorkerGroup, clock: Clock, minutes: float, spares: int, check_s: float = 5.0):
    """What the controller does for its spares at each grow check (orchestrator/control/spares.py:
    ``SparePool.adopt_started`` then ``SparePool.refill``), over ``minutes`` of simulated time; yields after each."""
    end = clock.t + minutes * 60
    while clock.t < end:
        group.adopt_started()
        missing = min(spares - len(group.live_ids) - group.starting, group.free_slots())
        if missing > 0:
            group.start_background(missing, strategy="SPREAD")
        yield
        clock.t += check_s


@pytest.fixture
def fake_actors(monkeypatch):
    """RankActor handles whose ping answers once their group is placed."""

    class Ref:
        def __init__(self, pg):
            self.pg = pg

    class Handle:
        def __init__(self, pg):
            self.ping = type("M", (), {"remote": staticmethod(lambda: Ref(pg))})

    class Remote:
        def options(self, scheduling_strategy, **_):
            pg = scheduling_strategy.placement_group
            return type("R", (), {"remote": staticmethod(lambda *a, **k: Handle(pg))})

    # The real RankActor module imports torch (minutes on a loaded box): the class is never used here.
    monkeypatch.setitem(sys.modules, "workers.actor", SimpleNamespace(TRAIN_GROUP="train", RankActor=object))
    monkeypatch.setattr(worker_group.ray, "remote", lambda **_: lambda cls: Remote())
    monkeypatch.setattr(worker_group, "PlacementGroupSchedulingStrategy",
                        lambda placement_group, placement_group_bundle_index: type(
                            "S", (), {"placement_group": placement_group})())
    monkeypatch.setattr(worker_group.ray, "wait", lambda refs, timeout=0, **_: (
        [r for r in refs if r.pg.node], [r for r in refs if not r.pg.node]))
    monkeypatch.setattr(worker_group.ray, "get", lambda ref, timeout=0: (4242, "10.0.0.9", ref.pg.node, 0))
    monkeypatch.setattr(worker_group.ray, "kill", lambda handle, no_restart=True: None)


def new_group(monkeypatch, clock) -> WorkerGroup:
    group = WorkerGroup(ActorResources(cpus=1, gpus=0), placement_timeout_s=60, clock=clock)
    monkeypatch.setattr(group, "draining_nodes", lambda: {})
    return group


def test_capacity_absent_for_ten_minutes_leaves_at_most_one_pending_group(monkeypatch, fake_actors):
    """The free-resource view says one bundle fits, but nothing is ever placed (the room is gone:
    another job took it, or its node is going): each request is withdrawn when given up, and the
    next waits a growing backoff."""
    cluster = FakeCluster(monkeypatch, {"A": 1})
    cluster.places = False
    clock = Clock()
    group = new_group(monkeypatch, clock)
    asked_at = []
    for _ in controller_loop(group, clock, minutes=10, spares=1):
        assert len(cluster.pending()) <= 1
        if len(cluster.groups) > len(asked_at):
            asked_at.append(clock.t)
    assert group.starting <= 1 and len(cluster.held()) <= 1
    # Before the fix: a new group every placement_timeout_s + 120 s, none ever removed (4 by now).
    gaps = [b - a for a, b in zip(asked_at, asked_at[1:])]
    assert len(asked_at) >= 2 and all(g >= 60 + START_GRACE_S + RETRY_FIRST_S for g in gaps)
    assert gaps == sorted(gaps)  # the backoff grows (capped at RETRY_MAX_S)


def test_no_room_at_all_asks_for_no_group(monkeypatch, fake_actors):
    cluster = FakeCluster(monkeypatch, {"A": 0})
    clock = Clock()
    group = new_group(monkeypatch, clock)
    for _ in controller_loop(group, clock, minutes=10, spares=2):
        pass
    assert cluster.groups == []  # the autoscaler request stands for them (orchestrator/cluster/autoscale.py)
    cluster.room["A"] = 2  # a node's worth of room appears: both are asked for and placed
    for _ in controller_loop(group, clock, minutes=0.2, spares=2):
        pass
    assert len(group.live_ids) == 2 and len(cluster.held()) == 2 and not cluster.pending()


def test_a_lost_node_then_a_replacement_the_group_grows_onto_it(monkeypatch, fake_actors):
    cluster = FakeCluster(monkeypatch, {"A": 2, "B": 2})
    clock = Clock()
    group = new_group(monkeypatch, clock)
    group.start_background(4)
    clock.t += 1
    assert len(group.adopt_started()) == 4 and group.free_slots() == 0
    cluster.kill_node("B")
    clock.t += WATCH_S
    group.adopt_started()  # the boundary's watch: B's groups are removed at once
    lost = group.lost_ids
    assert len(lost) == 2 and all(pg.node == "A" for pg in cluster.held())
    group.kill(lost)  # what the failure path does
    cluster.alive.add("C")
    cluster.room["C"] = 2  # the replacement node: its room is free, nothing of ours squats there
    assert group.free_slots() == 2
    group.start_background(2)
    assert sorted(group.adopt_started()) == [4, 5] and {pg.node for pg in cluster.held()} == {"A", "C"}
