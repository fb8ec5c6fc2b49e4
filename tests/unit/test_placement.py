"""Rank placement keeps every TP group inside one node, then PP, then spreads DP across nodes."""

from __future__ import annotations

import itertools
import random

import pytest

from meshspeak.mesh import MeshShape
from orchestrator.plan.placement import place_ranks, tp_groups_fit


def _cluster(sizes: dict[str, int]) -> tuple[list[int], dict[int, str]]:
    """Actors numbered across nodes in interleaved start order (as a real start hands them out)."""
    node_of: dict[int, str] = {}
    queues = {n: c for n, c in sizes.items()}
    actor = 0
    while any(queues.values()):
        for node in sorted(queues):
            if queues[node]:
                node_of[actor] = node
                queues[node] -= 1
                actor += 1
    return sorted(node_of), node_of


def _tp_nodes(members, node_of, shape: MeshShape) -> list[set[str]]:
    return [{node_of[a] for a in members[g * shape.tp:(g + 1) * shape.tp]}
            for g in range(shape.dp * shape.pp)]


def test_uneven_nodes_keep_every_tp_group_on_one_node_where_address_order_split_one():
    actors, node_of = _cluster({"10.0.0.1": 3, "10.0.0.2": 5})
    shape = MeshShape(dp=3, pp=1, tp=2)
    old = sorted(actors, key=lambda a: (node_of[a], a))[:shape.world]  # the rule this replaces
    assert any(len(nodes) > 1 for nodes in _tp_nodes(old, node_of, shape))
    placed = place_ranks(actors, node_of, shape)
    assert all(len(nodes) == 1 for nodes in _tp_nodes(placed.members, node_of, shape))
    assert placed.split_tp_groups == ()
    assert sorted(placed.order) == actors and len(placed.spares) == 2


def test_a_replica_stays_on_one_node_when_one_fits_it_best_fit_first():
    actors, node_of = _cluster({"a": 8, "b": 4})
    shape = MeshShape(dp=3, pp=2, tp=2)
    placed = place_ranks(actors, node_of, shape)
    replicas = [{node_of[a] for a in placed.members[r * 4:(r + 1) * 4]} for r in range(3)]
    assert replicas == [{"b"}, {"a"}, {"a"}]  # the small node first leaves the big one whole


def test_a_replica_that_fits_no_node_keeps_its_tp_groups_whole_and_its_pp_neighbours_close():
    actors, node_of = _cluster({"a": 6, "b": 4, "c": 2})
    shape = MeshShape(dp=2, pp=3, tp=2)  # replica of 6: only node a holds one
    placed = place_ranks(actors, node_of, shape)
    assert placed.split_tp_groups == ()
    assert {node_of[a] for a in placed.members[:6]} == {"a"}
    assert all(len(n) == 1 for n in _tp_nodes(placed.members, node_of, shape))


@pytest.mark.parametrize("seed", range(40))
def test_random_clusters_split_tp_groups_only_when_nothing_else_fits(seed):
    rng = random.Random(seed)
    sizes = {f"n{i}": rng.randint(1, 8) for i in range(rng.randint(1, 5))}
    total = sum(sizes.values())
    tp = rng.choice([1, 2, 4])
    pp = rng.choice([1, 2, 3])
    dp = max(1, total // (tp * pp) - rng.randint(0, 1))
    shape = MeshShape(dp=dp, pp=pp, tp=tp)
    if shape.world > total:
        return
    actors, node_of = _cluster(sizes)
    placed = place_ranks(actors, node_of, shape)
    assert len(placed.members) == shape.world and len(set(placed.order)) == total
    whole = [len(n) == 1 for n in _tp_nodes(placed.members, node_of, shape)]
    assert all(whole) == tp_groups_fit(list(sizes.values()), shape)
    assert [g for g, ok in enumerate(whole) if not ok] == list(placed.split_tp_groups)


def test_impossible_fit_spills_over_the_fewest_nodes_and_says_so(caplog):
    actors, node_of = _cluster({"a": 3, "b": 3})
    shape = MeshShape(dp=3, pp=1, tp=2)
    placed = place_ranks(actors, node_of, shape)
    assert placed.split_tp_groups == (2,)
    assert len(_tp_nodes(placed.members, node_of, shape)[2]) == 2
    assert "span nodes" in caplog.text


def test_deterministic_and_too_few_actors_refused():
    actors, node_of = _cluster({"a": 4, "b": 4})
    shape = MeshShape(dp=2, pp=2, tp=2)
    for perm in itertools.islice(itertools.permutations(actors), 5):
        assert place_ranks(list(perm), node_of, shape) == place_ranks(actors, node_of, shape)
    with pytest.raises(ValueError, match="cannot hold"):
        place_ranks(actors[:7], node_of, shape)


# -- a re-formed generation of the same shape keeps its survivors' ranks (keep_ranks) -----------------
def test_a_spare_takes_the_lost_ranks_place_and_the_survivors_keep_theirs():
    """dp=4 on one host: rank 1's actor died, spare 4 joins. Placed afresh the survivors 2 and 3 move
    down a rank (three shards to move); kept, only rank 1 changes hands."""
    from orchestrator.plan.placement import keep_ranks

    shape = MeshShape(dp=4, pp=1, tp=1)
    node_of = dict.fromkeys([0, 2, 3, 4], "host")
    fresh = place_ranks([0, 2, 3, 4], node_of, shape)
    assert fresh.members == (0, 2, 3, 4)
    kept = keep_ranks(fresh, {0: 0, 1: 1, 2: 2, 3: 3}, shape)
    assert kept.members == (0, 4, 2, 3) and kept.spares == fresh.spares


def test_pure_dp_keeps_a_survivor_the_placement_left_out_for_a_spare():
    """Survivors 0, 1, 4 on node A (ranks 0-2), actor 5 (rank 3) died; spares 2 and 3 alone on nodes B
    and C. ``place_ranks`` fills the smaller nodes first and leaves survivor 4 out; kept, 4 holds rank 2
    again and one spare takes rank 3 (one shard moves, not two)."""
    from orchestrator.plan.placement import keep_ranks

    shape = MeshShape(dp=4, pp=1, tp=1)
    node_of = {0: "A", 1: "A", 4: "A", 2: "B", 3: "C"}
    fresh = place_ranks([0, 1, 2, 3, 4], node_of, shape)
    assert 4 in fresh.spares
    kept = keep_ranks(fresh, {0: 0, 1: 1, 2: 4, 3: 5}, shape)
    assert kept.members[:3] == (0, 1, 4) and kept.members[3] in (2, 3) and len(kept.spares) == 1


def test_kept_ranks_move_whole_replicas_so_every_tp_group_stays_on_its_node():
    """pp=2 x tp=2 replicas on two nodes: the replica that held dp index 0 before keeps it, though the
    placement ordered it second; members, spares and each TP group's node are the placement's."""
    from orchestrator.plan.placement import keep_ranks

    shape = MeshShape(dp=2, pp=2, tp=2)
    actors, node_of = _cluster({"a": 5, "b": 4})
    fresh = place_ranks(actors, node_of, shape)
    first, second = fresh.members[:4], fresh.members[4:]
    previous = dict(enumerate(second + (99, 98, 97, 96)))  # the second replica held dp index 0
    kept = keep_ranks(fresh, previous, shape)
    assert kept.members == second + first and kept.spares == fresh.spares
    assert sorted(_tp_nodes(kept.members, node_of, shape), key=sorted) == \
        sorted(_tp_nodes(fresh.members, node_of, shape), key=sorted)
    assert all(len(nodes) == 1 for nodes in _tp_nodes(kept.members, node_of, shape))


def test_keeping_ranks_never_keeps_fewer_and_is_a_reordering_of_replicas():
    from orchestrator.plan.placement import keep_ranks

    rng = random.Random(7)
    for _ in range(200):
        shape = MeshShape(dp=rng.choice([2, 3, 4]), pp=rng.choice([1, 2]), tp=rng.choice([1, 2]))
        actors, node_of = _cluster({f"n{i}": rng.randint(2, 6) for i in range(rng.randint(2, 4))})
        if len(actors) < shape.world:
            continue
        fresh = place_ranks(actors, node_of, shape)
        previous = dict(enumerate(rng.sample(actors, shape.world)))
        kept = keep_ranks(fresh, previous, shape)
        replica = shape.pp * shape.tp
        same = lambda m: sum(previous[r] == a for r, a in enumerate(m))  # noqa: E731
        assert same(kept.members) >= same(fresh.members)
        assert sorted(kept.members + kept.spares) == sorted(actors) and list(kept.spares) == sorted(kept.spares)
        if replica == 1:  # pure dp: every live actor of the generation before keeps its rank
            assert same(kept.members) == shape.world
        else:  # a reordering of the placement's replicas
            blocks = lambda m: sorted(m[i:i + replica] for i in range(0, len(m), replica))  # noqa: E731
            assert blocks(kept.members) == blocks(fresh.members) and kept.spares == fresh.spares


def test_an_unsplit_placement_reports_no_split_after_reordering_and_a_split_one_follows_its_replica():
    from orchestrator.plan.placement import keep_ranks

    shape = MeshShape(dp=2, pp=1, tp=2)
    node_of = {0: "a", 1: "b", 2: "c", 3: "c"}  # the first replica's TP group spans a and b
    fresh = place_ranks([0, 1, 2, 3], node_of, shape)
    assert len(fresh.split_tp_groups) == 1
    split_block = fresh.split_tp_groups[0]
    previous = dict(enumerate(fresh.members[2:] + fresh.members[:2]))  # the blocks swapped before
    kept = keep_ranks(fresh, previous, shape)
    assert kept.members == fresh.members[2:] + fresh.members[:2]
    assert kept.split_tp_groups == (1 - split_block,)
