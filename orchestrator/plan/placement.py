"""Which actor gets which world rank: TP groups inside a node, then PP, then DP across nodes (pure data).

Rank order is TP innermost (``meshspeak.mesh``): a TP group is ``tp`` consecutive ranks and a
replica ``pp * tp`` consecutive ranks. TP runs collectives inside every layer, so a TP group split
across nodes puts them on the slowest link of the job; PP sends one activation per microbatch between
neighbours, DP one gradient reduction per step. So the rule, per replica in rank order:

1. the whole replica on one node (the node with the fewest free actors that still fits it: best
   fit, so that big nodes stay free for the replicas after it);
2. else each of its TP groups on one node, preferring a node this replica already uses (its PP
   neighbours then talk inside the node), then best fit;
3. else (no node has ``tp`` actors left) the TP group spans nodes, taken from the nodes with the
   most free actors so it spans as few as possible; the placement reports it (``split_tp_groups``).

Every chunk taken from a node is a multiple of ``tp``, so no choice in 1-2 ever costs a later TP
group its node: all TP groups fit inside nodes exactly when ``sum(free // tp) >= dp * pp``, and then
this rule finds such a placement. Sorting by node address (the rule before) did not: with nodes of
3 and 5 actors and tp=2 the second TP group straddled them.

Actors left over are spares. Ties break on node key, then actor id (oldest first), so the result is
a deterministic function of its inputs. No ray, no torch.

A re-formed generation of the same shape keeps the ranks it can (``keep_ranks``): the replicas this
rule placed are reordered so that survivors hold the world ranks they held before (under pure dp,
every survivor: one that the rule left out is swapped in). Under ZeRO a dp
rank's shard is its rank's, so a survivor that kept its rank restores from its own in-memory
snapshot with nothing fetched, and only the replacement's shard moves; placed afresh, a spare
promoted for rank 1 of 4 shifted ranks 2 and 3 down and three shards moved (the chaos bench: 79.5 MB
fetched where 26.5 MB was the lost rank's).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshspeak.mesh import MeshShape

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Placement:
    members: tuple[int, ...]  # actor id of every world rank, in rank order
    spares: tuple[int, ...]  # live actors left out of the generation
    split_tp_groups: tuple[int, ...]  # TP groups (by index, rank // tp) that span nodes

    @property
    def order(self) -> list[int]:
        """Members in rank order, then the spares."""
        return [*self.members, *self.spares]


def tp_groups_fit(node_sizes: Sequence[int], shape: MeshShape) -> bool:
    """Whether every TP group of ``shape`` can lie inside one node, given the actors per node."""
    return sum(n // shape.tp for n in node_sizes) >= shape.dp * shape.pp


def place_ranks(actors: Sequence[int], node_of: Mapping[int, str], shape: MeshShape) -> Placement:
    """Assign ``shape.world`` of ``actors`` to world ranks by the rule in the module docstring.

    Args:
        actors: live actor ids (lower = older).
        node_of: actor id -> node key (an address or a Ray node id); missing actors share node "".

    Raises:
        ValueError: fewer actors than ranks.
    """
    if len(actors) < shape.world:
        raise ValueError(f"{len(actors)} actors cannot hold the {shape.world} ranks of {shape}")
    free: dict[str, list[int]] = {}
    for actor in sorted(actors):
        free.setdefault(node_of.get(actor, ""), []).append(actor)
    replica, tp = shape.pp * shape.tp, shape.tp

    def best_fit(need: int, prefer: Sequence[str] = ()) -> str | None:
        fits = [n for n in free if len(free[n]) >= need]
        for node in prefer:
            if node in fits:
                return node
        return min(fits, key=lambda n: (len(free[n]), n)) if fits else None

    def take(node: str, count: int) -> list[int]:
        got, free[node] = free[node][:count], free[node][count:]
        return got

    members: list[int] = []
    split: list[int] = []
    for _ in range(shape.dp):
        node = best_fit(replica)
        if node is not None:
            members += take(node, replica)
            continue
        used: list[str] = []
        for _ in range(shape.pp):
            node = best_fit(tp, used)
            if node is not None:
                used.append(node)
                members += take(node, tp)
                continue
            split.append(len(members) // tp)
            group: list[int] = []
            while len(group) < tp:  # spill over the fullest nodes: as few nodes as possible
                fullest = max((n for n in free if free[n]), key=lambda n: (len(free[n]), n))
                group += take(fullest, tp - len(group))
            members += group
    spares = sorted(a for rest in free.values() for a in rest)
    if split:
        sizes = dict(sorted(Counter(node_of.get(a, "") for a in actors).items()))
        logger.warning("placement: TP groups %s of %s span nodes: the nodes (actors per node: %s) "
                       "hold only sum(actors // tp) < dp * pp whole TP groups", split, shape, sizes)
    return Placement(tuple(members), tuple(spares), tuple(split))


def keep_ranks(placement: Placement, previous: Mapping[int, int], shape: MeshShape) -> Placement:
    """``placement`` with its replicas reordered so that as many actors as it can keep the world rank
    they held in ``previous`` (world rank -> actor id: the generation before, of this same ``shape``).

    A replica — ``pp * tp`` consecutive ranks — lies on its nodes whatever its dp index, so any order
    of the replicas is as good a placement: the members, the spares and every TP group's node stay
    what ``place_ranks`` chose. Greedy, the replica keeping the most actors at their old positions
    first; ties and the replicas that keep nobody stay in ``placement``'s order. Pure dp (a replica is
    one actor, which fits any node) goes further: every live actor of ``previous`` keeps its rank, a
    survivor ``place_ranks`` left out (it fills small nodes first) swapped in for an actor it chose."""
    replica = shape.pp * shape.tp
    if replica == 1:
        return _keep_pure_dp(placement, previous, shape.dp)
    blocks = [placement.members[i * replica:(i + 1) * replica] for i in range(shape.dp)]
    old = [tuple(previous.get(j * replica + k) for k in range(replica)) for j in range(shape.dp)]
    scored = sorted(((-sum(a == b for a, b in zip(block, old[j])), i, j)
                     for i, block in enumerate(blocks) for j in range(shape.dp)))
    slot_of: dict[int, int] = {}  # block index -> its dp index
    taken: set[int] = set()
    for negative_kept, i, j in scored:
        if negative_kept < 0 and i not in slot_of and j not in taken:
            slot_of[i] = j
            taken.add(j)
    free = iter(j for j in range(shape.dp) if j not in taken)
    for i in range(shape.dp):
        if i not in slot_of:
            slot_of[i] = next(free)
    order = sorted(range(shape.dp), key=lambda i: slot_of[i])
    members = tuple(a for i in order for a in blocks[i])
    split = tuple(sorted(slot_of[g // shape.pp] * shape.pp + g % shape.pp for g in placement.split_tp_groups))
    return Placement(members, placement.spares, split)


def _keep_pure_dp(placement: Placement, previous: Mapping[int, int], dp: int) -> Placement:
    """``keep_ranks`` for pure dp: the live actors of ``previous`` at their ranks, the other ranks
    filled with ``placement``'s members in its order (then its spares), the rest spares."""
    live = [*placement.members, *placement.spares]
    kept = {rank: actor for rank, actor in previous.items() if rank < dp and actor in live}
    others = iter(a for a in live if a not in kept.values())
    members = tuple(kept[rank] if rank in kept else next(others) for rank in range(dp))
    return Placement(members, tuple(sorted(set(live) - set(members))), ())
