"""The job's placement groups: one per actor, so the job never holds a bundle Ray cannot place.

Why one group per actor (issue 29; docs/design.md, Placement groups): a bundle outlives its actor, and
when a node dies Ray re-places that node's bundles. With no node that fits, Ray 2.60's GCS queues a
failed re-placement ("RESCHEDULING") again at once, without the backoff a new group's failed attempt
gets: the head's ``gcs_server`` spun at ~80% of a core for as long as the group lived (the rest of the
run on a fixed cluster) and every step of the run became 11-30x slower. Upstream knows it
(ray-project/ray#65007, #65970 add a backoff; not in 2.60). So a group's life here is its actor's:

* it is removed when its actor is killed, seen dead by a call, given up while starting, or found on a
  node the GCS declared dead (``watch``, from the driver's wait loop, at most every ``WATCH_S``) — a
  lost node takes whole groups with it and leaves nothing to re-place;
* capacity that comes back (a replacement node) then shows as free resources, and a grow or a spare
  takes it with a new group. ``free_slots`` counts only bundles that fit a live, non-draining node
  now; new groups are asked for only for those (what the cluster lacks goes to the autoscaler through
  ``orchestrator.cluster.autoscale.CapacityRequest``, never as a pending group). A request still not answered
  by its deadline is withdrawn (its group removed) and, after one was, ``free_slots`` offers no new
  capacity until a backoff (``RETRY_FIRST_S`` doubling to ``RETRY_MAX_S``) has passed.

Packing: Ray places a one-bundle group on the emptiest node that fits (its PACK policy packs the
bundles *of one group*), which would scatter a mesh over every node and split TP groups. So each new
group names its node (``_soft_target_node_id``, which Ray honours for STRICT_PACK groups; a soft hint,
elsewhere if that node is full or gone), chosen by ``target_nodes``: "PACK" fills as few nodes as
possible, tightest fit first (what one PACK group of all the bundles did); "SPREAD" (hot spares) one
per node in turn, nodes holding fewer of our actors first.

A placement group reserved for the job by its owner (a Tune trial's) is not ours to remove: its
bundles are used first and a bundle whose actor is gone is used again while its node lives.

The GCS's views of the nodes that placement reads live here too, one reader each: ``alive_nodes``,
``free_by_node`` and ``draining_nodes`` (which the preemption watch and the rendezvous store's
placement read as well).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from orchestrator.errors import WorkerGroupStartupError

logger = logging.getLogger(__name__)

WATCH_S = 1.0  # how often the driver looks for dead nodes (one GetAllNodeInfo call to the GCS)
RETRY_FIRST_S = 30.0  # after a start was given up: no new capacity offered for this long, doubling...
RETRY_MAX_S = 600.0  # ...up to this
LOG_WAIT_EVERY_S = 30.0  # progress line while waiting for placement (an autoscaler may be adding nodes)

Slot = tuple[Any, int]  # (placement group, bundle index)


def fits(bundle: Mapping[str, float], free: Mapping[str, float]) -> int:
    """How many ``bundle``s fit in ``free`` (one node's resources)."""
    return min(int(free.get(key, 0.0) // amount) for key, amount in bundle.items() if amount > 0)


def target_nodes(count: int, room: Mapping[str, int], strategy: str,
                 ours: Mapping[str, int] | None = None) -> list[str | None]:
    """A node for each of ``count`` new one-bundle groups (None: no node has room, Ray decides).

    Args:
        room: node id -> how many more bundles fit there now.
        strategy: "PACK" (as few nodes as possible: the tightest node that holds all, else the
            roomiest first) or "SPREAD" (one per node in turn, nodes with fewer of ``ours`` first).
        ours: node id -> our live actors there.
    """
    room = {node: n for node, n in room.items() if n > 0}
    ours = ours or {}
    out: list[str | None] = []
    if strategy == "SPREAD":
        while len(out) < count and room:
            for node in sorted(room, key=lambda n: (ours.get(n, 0), -room[n], n)):
                if len(out) == count:
                    break
                out.append(node)
                room[node] -= 1
                ours = {**ours, node: ours.get(node, 0) + 1}
            room = {node: n for node, n in room.items() if n > 0}
    else:
        whole = [node for node, n in room.items() if n >= count]
        if whole:
            return [min(whole, key=lambda n: (room[n], n))] * count
        for node in sorted(room, key=lambda n: (-room[n], n)):
            out += [node] * min(room[node], count - len(out))
    return out + [None] * (count - len(out))


def bundle_node(pg: Any, index: int) -> str:
    """The node a bundle is placed on now, or "" while it is not placed."""
    table = placement_group_table(pg)
    if table.get("state") != "CREATED":
        return ""
    return table.get("bundles_to_node_id", {}).get(index, "") or ""


def alive_nodes() -> frozenset[str]:
    return frozenset(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def free_by_node() -> dict[str, dict[str, float]]:
    """Node id -> its free resources, for every live node (Ray's developer API; a failure reads as
    "nothing free", which only delays a grow)."""
    try:
        from ray._private.state import available_resources_per_node

        return available_resources_per_node()
    except Exception as exc:
        logger.debug("available_resources_per_node: %s", exc)
        return {}


def draining_nodes() -> dict[str, float | None]:
    """Nodes Ray is draining now (a preemption notice, the autoscaler, ``ray drain-node``): node id ->
    seconds until the drain deadline, None when it has none. Ray Train's PreemptionWatcher reads the
    same GCS list; the accessor is private (a Ray upgrade may move it), so a failure here reads as
    "none": nothing is then placed away from, or evicted off, a draining node ahead of time."""
    try:
        from ray._private.state import state

        raw = state.get_draining_nodes()
    except Exception as exc:
        logger.debug("get_draining_nodes: %s", exc)
        return {}
    now_ms = time.time() * 1000.0
    return {node: (deadline - now_ms) / 1000.0 if deadline else None for node, deadline in raw.items()}


class Placements:
    """actor id -> the placement group it holds (its own, or a bundle of a reserved one)."""

    def __init__(self, bundle: Mapping[str, float], *, reserved: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bundle = dict(bundle)
        self.clock = clock
        self.own: dict[int, Any] = {}  # actor id -> its own one-bundle group
        self.nodes: dict[int, str] = {}  # actor id -> the node its actor answered from
        self.lost: set[int] = set()  # actors whose node died: their group is removed already
        self.reserved = reserved
        self.reserved_free: list[Slot] = [(reserved, i) for i in range(reserved.bundle_count)] if reserved else []
        self.reserved_held: dict[int, Slot] = {}
        self._alive: frozenset[str] | None = None
        self._next_watch = 0.0
        self._retry_at = 0.0
        self._backoff = RETRY_FIRST_S

    # -- asking ----------------------------------------------------------------------------------
    def room(self, draining: Collection[str] = ()) -> dict[str, int]:
        """Node id -> bundles that fit there now, live non-draining nodes only."""
        return {node: fits(self.bundle, free) for node, free in free_by_node().items() if node not in draining}

    def free_slots(self, draining: Collection[str] = ()) -> int:
        """Bundles a new actor could have now: unused reserved ones, plus what fits the live nodes'
        free resources (none while the backoff after a withdrawn request runs)."""
        fresh = 0 if self.clock() < self._retry_at else sum(self.room(draining).values())
        return len(self.reserved_free) + fresh

    def slots(self, count: int, strategy: str, draining: Collection[str], wait_s: float | None) -> list[Slot]:
        """``count`` bundles: unused reserved ones, then one new group each, on the nodes
        ``target_nodes`` picks. ``wait_s``: wait that long for all to be placed, else remove them and
        raise WorkerGroupStartupError (None: return at once, the actors queue until placed)."""
        slots = []
        while self.reserved_free and len(slots) < count:
            slots.append(self.reserved_free.pop(0))
        fresh = count - len(slots)
        if not fresh:
            return slots
        targets = target_nodes(fresh, self.room(draining), strategy, Counter(self.nodes.values()))
        groups = [placement_group([self.bundle], strategy="STRICT_PACK", _soft_target_node_id=node)
                  for node in targets]
        if wait_s is not None and not self._wait_placed(groups, wait_s):
            for pg in groups:
                remove_placement_group(pg)
            raise WorkerGroupStartupError(self._unplaceable(fresh, wait_s))
        return slots + [(pg, 0) for pg in groups]

    def assign(self, actor_id: int, slot: Slot) -> None:
        """The actor was created in ``slot`` (one that ``slots`` returned)."""
        if self.reserved is not None and slot[0] is self.reserved:
            self.reserved_held[actor_id] = slot
        else:
            self.own[actor_id] = slot[0]

    def placed(self, actor_id: int, node_id: str) -> None:
        """The actor answered from ``node_id``."""
        self.nodes[actor_id] = node_id

    # -- giving back -----------------------------------------------------------------------------
    def release(self, actor_id: int) -> None:
        """The actor is gone: remove its own group (a reserved bundle is used again while its node
        lives)."""
        self.nodes.pop(actor_id, None)
        pg = self.own.pop(actor_id, None)
        if pg is not None and actor_id not in self.lost:
            _remove(pg)
        self.lost.discard(actor_id)
        slot = self.reserved_held.pop(actor_id, None)
        if slot is not None and bundle_node(*slot) in alive_nodes():
            self.reserved_free.append(slot)

    def gave_up(self) -> None:
        """A background start did not answer by its deadline (its group is released): back off."""
        self._retry_at = self.clock() + self._backoff
        logger.info("a requested actor was not placed in time: its placement group is withdrawn; new "
                    "capacity is asked for again in %.0fs", self._backoff)
        self._backoff = min(2 * self._backoff, RETRY_MAX_S)

    def answered(self) -> None:
        """A background start answered: the capacity was real, no backoff."""
        self._backoff = RETRY_FIRST_S

    def watch(self) -> set[int]:
        """At most every ``WATCH_S``: when the GCS declared a node dead, remove our groups on it (and
        any of ours it is re-placing, for actors that had not answered yet). Returns the actors
        newly found lost (their processes are gone with the node)."""
        now = self.clock()
        if now < self._next_watch or not self.own:
            return set()
        self._next_watch = now + WATCH_S
        try:
            alive = alive_nodes()
        except Exception as exc:  # the GCS is unreachable now: look again next time
            logger.debug("ray.nodes: %s", exc)
            return set()
        if alive == self._alive:
            return set()
        self._alive = alive
        found = set()
        for actor_id, pg in self.own.items():
            if actor_id in self.lost:
                continue
            if self._on_dead_node(actor_id, pg, alive):
                _remove(pg)
                found.add(actor_id)
        if found:
            logger.info("actors %s were on a node that died: their placement groups are removed",
                        sorted(found))
        self.lost |= found
        return found

    def _on_dead_node(self, actor_id: int, pg: Any, alive: frozenset[str]) -> bool:
        """The actor's node (where it answered from; for one that has not answered yet, where its
        group was placed) is not alive, or Ray is re-placing its group."""
        node = self.nodes.get(actor_id)
        if node:
            return node not in alive
        table = placement_group_table(pg)
        placed = set(table.get("bundles_to_node_id", {}).values()) - {""}
        return table.get("state") == "RESCHEDULING" or bool(placed - alive)

    def shutdown(self) -> None:
        for actor_id in list(self.own):
            self.release(actor_id)

    # -- waiting ---------------------------------------------------------------------------------
    def _wait_placed(self, groups: list, wait_s: float) -> bool:
        """Wait up to ``wait_s`` for the groups. A long wait (minutes while an autoscaler boots a cold
        GPU node) is normal: say so now and then."""
        deadline = time.monotonic() + wait_s
        pending = [pg.ready() for pg in groups]
        while True:
            left = deadline - time.monotonic()
            try:
                ray.get(pending, timeout=max(0.0, min(left, LOG_WAIT_EVERY_S)))
                return True
            except GetTimeoutError:
                if time.monotonic() >= deadline:
                    return False
                logger.info("waiting for %d workers of %s to be placed (cluster has %s; %.0fs left of "
                            "resources.placement_timeout_s)", len(groups), self.bundle,
                            self._cluster_summary(), deadline - time.monotonic())

    def _cluster_summary(self) -> str:
        total = ray.cluster_resources()
        return ", ".join(f"{key} {total.get(key, 0):g}" for key in self.bundle)

    def _unplaceable(self, count: int, wait_s: float) -> str:
        """One line: what could not be placed, what the cluster has, and the fix that fits."""
        if self.bundle.get("GPU") and ray.cluster_resources().get("GPU", 0) == 0:
            fix = ("no node has a GPU: set resources.use_gpu=false (or \"auto\") for a CPU-only cluster, "
                   "or add GPU nodes (an autoscaler needs a GPU node type and a larger "
                   "resources.placement_timeout_s to boot one)")
        else:
            fix = ("lower mesh.dp/pp/tp or resources.cpus_per_worker, add nodes, or raise "
                   "resources.placement_timeout_s while an autoscaler adds them")
        return (f"could not place {count} workers of {self.bundle} within "
                f"resources.placement_timeout_s={wait_s:g}s (cluster has {self._cluster_summary()}): {fix}")


def _remove(pg: Any) -> None:
    try:
        remove_placement_group(pg)
    except Exception as exc:  # the cluster may already be gone
        logger.debug("remove_placement_group: %s", exc)
