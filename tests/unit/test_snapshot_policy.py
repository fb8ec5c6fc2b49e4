"""The pure decisions of in-memory snapshots (orchestrator/saves/snapshots.py): who holds whose
snapshot, whether a set can restore a run and who gives each shard, snapshot or storage; with HSDP's
replicas (or ZeRO-0's ranks) a lost shard is covered by another rank holding the same one."""

import random
from collections import Counter

from meshspeak.mesh import MeshShape, same_shard_ranks
from meshspeak.messages import SnapshotInventory
from orchestrator.saves.snapshots import (
    backup_ring,
    choose_source,
    copies_of,
    covered,
    newest_covered,
    second_homes,
)


def test_ring_prefers_another_node():
    members = {r: 10 + r for r in range(6)}
    node = {10: "a", 11: "a", 12: "a", 13: "b", 14: "b", 15: "b"}
    ring = backup_ring(members, node)
    assert sorted(ring) == sorted(ring.values()) == list(range(6))  # a permutation: one holder each
    assert all(node[members[r]] != node[members[h]] for r, h in ring.items())


def test_ring_crosses_nodes_whenever_no_node_holds_more_than_half():
    # bench/chaos.py's mesh after a node loss: ranks 0 and 2 on one node. Visiting the nodes in turn
    # made 0 -> 1 -> 3 -> 2 -> 0, so losing that node lost rank 2's both copies.
    members = {r: 10 + r for r in range(4)}
    node = {10: "a", 11: "b", 12: "a", 13: "c"}
    ring = backup_ring(members, node)
    assert all(node[members[r]] != node[members[h]] for r, h in ring.items())
    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(2, 12)
        node = {10 + r: rng.choice("abcde"[:rng.randint(1, 5)]) for r in range(n)}
        members = {r: 10 + r for r in range(n)}
        ring = backup_ring(members, node)
        cycle, at = [0], ring[0]
        while at != 0:
            cycle.append(at)
            at = ring[at]
        assert sorted(cycle) == list(range(n))  # one ring through every rank
        if max(Counter(node.values()).values()) <= n // 2:
            assert all(node[members[r]] != node[members[h]] for r, h in ring.items()), node


def test_ring_uneven_nodes_and_one_node_and_one_rank():
    members = {0: 0, 1: 1, 2: 2}
    ring = backup_ring(members, {0: "a", 1: "a", 2: "b"})
    assert ring == {0: 2, 2: 1, 1: 0}
    assert backup_ring(members, {0: "a", 1: "a", 2: "a"}) == {0: 2, 2: 1, 1: 0}  # one node: any ring
    assert backup_ring({0: 5}, {5: "a"}) == {}


def test_covered_needs_every_shard_alive_somewhere():
    members = {0: 10, 1: 11, 2: 12, 3: 13}
    holders = {0: 2, 2: 1, 1: 3, 3: 0}
    assert covered(members, holders, {10, 11, 12, 13})
    assert covered(members, holders, {10, 12, 13})  # rank 1 lost: its copy is on rank 3
    assert not covered(members, holders, {10, 12})  # ranks 1 and its holder 3 lost
    assert covered(members, holders, {11, 13}) is False  # rank 0 and its holder 2 lost
    assert not covered(members, {}, set(members.values()))  # no ring: nothing was held


def test_newest_covered_set_and_who_gives_each_shard():
    k3, k4, old = (2, 0, 3), (2, 0, 4), (1, 1, 9)
    inventories = {  # actor 11 (rank 1) is lost; its copies of steps 3 and 4 live on actor 13
        10: SnapshotInventory(own=((k3, 0), (k4, 0)), held=((k3, 3),)),
        12: SnapshotInventory(own=((k3, 2), (k4, 2)), held=((k3, 0), (k4, 0))),
        13: SnapshotInventory(own=((k3, 3), (k4, 3), (old, 0)), held=((k3, 1), (k4, 1))),
    }
    key, givers = newest_covered(inventories, {1: 1, 2: 4})
    assert key == k4 and givers == {0: 10, 1: 13, 2: 12, 3: 13}  # own copies first, else a holder's
    # Step 4 trained in flight but never recorded by the driver: restores stop at step 3.
    assert newest_covered(inventories, {1: 1, 2: 4}, at_most=3)[0] == k3
    del inventories[13]  # rank 1's copies gone with rank 3
    assert newest_covered(inventories, {1: 1, 2: 4}) is None
    assert newest_covered({13: SnapshotInventory(own=((old, 0),), held=())}, {1: 1, 2: 4}) == (old, {0: 13})


def test_ranks_holding_the_same_shard():
    assert same_shard_ranks(MeshShape(4, 1, 1), 1) == [0, 1, 2, 3]  # plain FSDP: each its own
    assert same_shard_ranks(MeshShape(4, 1, 1), 2) == [0, 1, 0, 1]  # 2 replicas of 2 shards
    assert same_shard_ranks(MeshShape(4, 1, 1), 4) == [0, 0, 0, 0]  # ZeRO-0: one replicated state
    # (dp, pp, tp) = (2, 2, 2), 2 replicas: rank 4 = (dp 1, pp 0, tp 0) holds what rank 0 holds
    assert same_shard_ranks(MeshShape(2, 2, 2), 2) == [0, 1, 2, 3, 0, 1, 2, 3]


def test_a_lost_replica_is_covered_by_a_live_one():
    members = {0: 10, 1: 11, 2: 12, 3: 13}
    holders = {0: 1, 1: 2, 2: 3, 3: 0}
    hsdp = same_shard_ranks(MeshShape(4, 1, 1), 2)  # replica A = ranks 0, 1; replica B = ranks 2, 3
    # Replica A lost (ranks 0 and 1): rank 0's copies (own, on rank 1) are gone, not its shard.
    assert not covered(members, holders, {12, 13})
    assert covered(members, holders, {12, 13}, hsdp)
    assert not covered(members, holders, set(), hsdp)
    # One live actor holds its own shard and its ring predecessor's: under ZeRO-0 that is all of it.
    assert not covered(members, holders, {12})
    assert covered(members, holders, {12}, same_shard_ranks(MeshShape(4, 1, 1), 4))
    k = (2, 0, 4)
    inventories = {12: SnapshotInventory(own=((k, 2),), held=((k, 1),)), 13: SnapshotInventory(own=((k, 3),), held=())}
    assert newest_covered(inventories, {2: 4}) is None
    # Shard 0 from rank 2 (replica B), shard 1 from ranks 1 (its copy on actor 12) and 3.
    assert newest_covered(inventories, {2: 4}, same={2: hsdp}) == (k, {1: 12, 2: 12, 3: 13})


def test_a_shard_left_with_one_copy_gets_a_second_home_elsewhere():
    key = (1, 0, 4)
    # Actor 11 (rank 1) died: its shard lives on its holder 13 only, and rank 2's (held by 11) on 12 only.
    inventories = {10: SnapshotInventory(own=((key, 0),), held=((key, 3),)),
                   12: SnapshotInventory(own=((key, 2),), held=((key, 0),)),
                   13: SnapshotInventory(own=((key, 3),), held=((key, 1),))}
    copies = copies_of(inventories, key)
    assert copies == {0: {10, 12}, 1: {13}, 2: {12}, 3: {10, 13}}
    node_of = {10: "A", 12: "B", 13: "B"}
    # Rank 1's copy goes to the other node; rank 2's to the actor given none yet (13 before 10).
    assert second_homes(copies, [0, 1, 2, 3], [10, 12, 13], node_of) == {1: (13, 10), 2: (12, 13)}
    # Nobody else is left to hold one: nothing to do.
    assert second_homes({0: {10}}, [0], [10], {10: "A"}) == {}
    # A mesh of the old size: each lone shard's copy goes to the actor that loads it in place (rank 1's
    # to 12, rank 2's to 13), each on another node than the shard's holder ...
    loaders = {0: 10, 1: 12, 2: 13, 3: 14}
    spread = {10: "A", 12: "C", 13: "B", 14: "A"}
    assert second_homes(copies, [0, 1, 2, 3], [10, 12, 13, 14], spread, loaders) == {1: (13, 12), 2: (12, 13)}
    # ... but not to a loader on the holder's node while another node has a candidate (12 and 13 on C).
    paired = {10: "A", 12: "C", 13: "C", 14: "A"}
    assert second_homes(copies, [0, 1, 2, 3], [10, 12, 13, 14], paired, loaders) == {1: (13, 10), 2: (12, 14)}
    # One node (bench/recovery.py): each lone shard goes to its loader.
    one = dict.fromkeys([10, 12, 13, 14], "A")
    assert second_homes(copies, [0, 1, 2, 3], [10, 12, 13, 14], one, loaders) == {1: (13, 12), 2: (12, 13)}
    # HSDP's replicas: a class with copies on two actors is covered twice already.
    assert second_homes({0: {10}, 2: {12}, 1: {11}, 3: set()}, [0, 1, 0, 1], [10, 11, 12], {}) == {1: (11, 10)}


def test_choose_source():
    assert choose_source(4, 2) == "snapshot"
    assert choose_source(4, 4) == "snapshot"  # as new, and no storage read
    assert choose_source(3, 4) == "storage"
    assert choose_source(None, 0) == "storage"


def test_plan_shows_the_host_memory_snapshots_take_per_rank(tmp_path):
    from orchestrator.config.load import load_config
    from orchestrator.plan.mesh_plan import describe, make_plan
    from orchestrator.plan.render import render

    def info(*overrides):
        cfg = load_config(None, ["mesh.dp=2", "mesh.tp=1", *overrides])
        return describe(cfg, make_plan(cfg))

    on = info(f"checkpoint.dir={tmp_path}")
    mem = on["memory_per_rank"][0]
    # 3 own buffer sets + the first take + 3 held + 2 in the object store + the staging copy
    assert on["snapshot_host_memory"]["per_rank"] == {0: 10 * (mem["grads"] + mem["optimizer"])}
    assert "checkpoint.memory_keep=3: 10 copies of the rank's state" in render(on)
    staging_only = info(f"checkpoint.dir={tmp_path}", "checkpoint.memory_every=0")
    assert staging_only["snapshot_host_memory"]["copies"] == {"staging": 1}
    assert "in-memory snapshots: off" in render(staging_only)
    assert info()["snapshot_host_memory"] is None and "checkpoint staging: off" in render(info())
