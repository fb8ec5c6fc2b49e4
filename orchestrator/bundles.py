"""Which placement-group bundle each actor holds, and which bundles are vacant and safe to refill.

Why this exists: a bundle outlives its actor. When an actor dies its bundle stays reserved, and when
a *node* dies Ray re-places that node's bundles on the next node that fits — so a replacement node
is taken by bundles nobody uses, no resources show as available, and the job could never grow back
onto it. ``WorkerGroup.add`` therefore refills vacant bundles before asking for new ones.

The catch is a node that died but that Ray's GCS has not declared dead yet (its health checks take
~15 s): the placement table still shows the bundle there, and an actor sent to it never starts. So a
vacant bundle counts as usable only with evidence that its node is up: Ray moved it to another node
since it was vacated, or one of our live actors runs on that node, or it has sat there longer than
the GCS needs to notice a dead node (``NODE_DEATH_GRACE_S``) while ``ray.nodes()`` calls it alive.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group_table

NODE_DEATH_GRACE_S = 30.0  # > Ray's default node-death detection (5 health checks x 3 s)


@dataclass
class Vacancy:
    pg: Any
    index: int
    node_id: str  # where the bundle was when its actor was lost
    since: float


def bundle_node(pg: Any, index: int) -> str:
    """The node a bundle is placed on now, or "" while it is not placed (e.g. being re-placed)."""
    table = placement_group_table(pg)
    if table.get("state") != "CREATED":
        return ""
    return table.get("bundles_to_node_id", {}).get(index, "") or ""


class BundleLedger:
    def __init__(self) -> None:
        self.slots: dict[int, tuple[Any, int]] = {}  # actor id -> (placement group, bundle index)
        self.nodes: dict[int, str] = {}  # actor id -> node id of its bundle when it started
        self.vacant: list[Vacancy] = []

    def assign(self, actor_id: int, pg: Any, index: int) -> None:
        self.vacant = [v for v in self.vacant if (v.pg, v.index) != (pg, index)]
        self.slots[actor_id] = (pg, index)
        self.nodes[actor_id] = bundle_node(pg, index)

    def release(self, actor_id: int) -> None:
        """The actor is gone: its bundle becomes vacant."""
        slot = self.slots.pop(actor_id, None)
        node = self.nodes.pop(actor_id, "")
        if slot is not None:
            self.vacant.append(Vacancy(slot[0], slot[1], node, time.monotonic()))

    def usable(self, draining: Collection[str] = ()) -> list[tuple[Any, int]]:
        """Vacant bundles placed on a node that is up and not ``draining`` (see the module
        docstring), oldest first."""
        if not self.vacant:
            return []
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")} - set(draining)
        ours = set(self.nodes.values())
        out = []
        for v in self.vacant:
            node = bundle_node(v.pg, v.index)
            if not node or node not in alive:
                continue
            moved = node != v.node_id
            if moved or node in ours or time.monotonic() - v.since > NODE_DEATH_GRACE_S:
                out.append((v.pg, v.index))
        return out
