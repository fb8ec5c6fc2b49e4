"""Which placement-group bundle each actor holds, and which bundles are vacant and safe to refill.

Why this exists: a bundle outlives its actor. When an actor dies its bundle stays reserved, and when
a *node* dies Ray re-places that node's bundles on the next node that fits — so a replacement node
is taken by bundles nobody uses, no resources show as available, and the job could never grow back
onto it. ``WorkerGroup.add`` therefore refills vacant bundles before asking for new ones.

The catch is a node that died but that Ray's GCS has not declared dead yet (its health checks take
~15 s): the placement table still shows the bundle there, and an actor sent to it never starts. So a
vacant bundle counts as usable only with evidence that its node is up: Ray moved it to another node
since it was vacated, or one of our live actors runs on that node, or it has sat there longer than
the GCS needs to notice a dead node (``NODE_DEATH_GRACE_S``) while ``ray.nodes()`` calls it alive,
or (no wait) its actor was lost to its *worker process* dying — Ray's raylet on that node reported the
death, so the node was up then (``WorkerGroup`` tells us, from the ``ActorDiedError``) — and that
node's raylet still accepts a connection now. The second half matters: a node may die right after
one of its workers did (the chaos bench's node removal kills the workers first), and then the
connection is refused or times out. A node death, an unknown cause, a hang we killed, or a raylet
that does not answer keeps the grace (docs/design.md: Bundle reuse).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group_table

NODE_DEATH_GRACE_S = 30.0  # > Ray's default node-death detection (5 health checks x 3 s)
RAYLET_PROBE_S = 0.5  # a live raylet accepts a TCP connection at once; a vanished host never answers


@dataclass
class Vacancy:
    pg: Any
    index: int
    node_id: str  # where the bundle was when its actor was lost
    since: float
    node_was_up: bool = False  # Ray's raylet there reported the actor's worker process dead


def raylet_listening(node: dict) -> bool:
    """Whether the raylet of ``node`` (an entry of ``ray.nodes()``) accepts a TCP connection now.
    Ray has no call for "is this node up right now" other than the GCS's view, which lags a node
    death by its health checks; every Ray node must reach the others' raylets, so the driver can too."""
    address, port = node.get("NodeManagerAddress"), node.get("NodeManagerPort")
    if not address or not port:
        return False
    try:
        with socket.create_connection((address, int(port)), timeout=RAYLET_PROBE_S):
            return True
    except OSError:
        return False


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

    def release(self, actor_id: int, *, node_was_up: bool = False) -> None:
        """The actor is gone: its bundle becomes vacant. ``node_was_up``: Ray reported its worker
        process dead (so its raylet was up when it died), not its node."""
        slot = self.slots.pop(actor_id, None)
        node = self.nodes.pop(actor_id, "")
        if slot is not None:
            self.vacant.append(Vacancy(slot[0], slot[1], node, time.monotonic(), node_was_up))

    def usable(self, draining: Collection[str] = ()) -> list[tuple[Any, int]]:
        """Vacant bundles placed on a node that is up and not ``draining`` (see the module
        docstring), oldest first."""
        if not self.vacant:
            return []
        draining = set(draining)
        alive = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in draining}
        ours = set(self.nodes.values())
        out = []
        for v in self.vacant:
            node = bundle_node(v.pg, v.index)
            if not node or node not in alive:
                continue
            moved = node != v.node_id
            if v.node_was_up and not (moved or node in ours) and not raylet_listening(alive[node]):
                v.node_was_up = False  # its node went after the worker did: wait out the grace
            if moved or node in ours or v.node_was_up or time.monotonic() - v.since > NODE_DEATH_GRACE_S:
                out.append((v.pg, v.index))
        return out
