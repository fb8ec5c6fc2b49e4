"""In-memory snapshots, driver side: who backs up whom, when a set of snapshots can restore a run,
and the one function that restores a new generation from the best source (no Ray, no torch).

Every ``checkpoint.memory_every`` steps (with ``checkpoint.dir`` set) each rank takes a snapshot of
its shard — model, optimizer, step — into its own memory (``RankActor.snapshot``: the copy to host
is all the step pays, see ``checkpoints/memory.py``). The driver then relays it to the rank's
*holder*, the next rank of a ring that prefers another node (``backup_ring``): it hands the ref of
the owner's ``snapshot_blob`` answer to the holder's ``keep_snapshot``, so Ray moves the bytes
between nodes and the holder copies them into its own heap. The holder must own its copy: a Ray
object dies with the process that owns it, and ownership cannot be handed to another actor. The
ranks never reach into each other; the driver only relays refs.

A step's snapshot is *complete* once every holder acked. Each actor keeps the newest complete set
and the one in flight (the driver says which: ``keep``), and a new one is started only when the
previous one settled, so the newest complete set is always still held.

After a failure, ``restore_best`` restores from the newest complete set when every shard of it has a
live copy (``covered``: its owner or its holder survived), else from the newest storage checkpoint
(``choose_source``), and says which (``restored_from`` in the ``rebuild`` event). The snapshot is
loaded resharded into the new mesh by every new member through DCP (``RankActor.load_snapshot``).
Every snapshot of the new generation is keyed by its generation number, so the old set stays
restorable until the new generation completed one of its own.

Training never waits for a relay: a snapshot step that comes while the previous relay still runs is
skipped. So a failure re-runs at most ``memory_every`` steps when relays keep up with the steps and
the newest one reached its holders before the failure; else it falls back to the newest complete
set. On one node the holders are other processes of that node: a node loss is not covered (one
warning).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from orchestrator.saves.checkpointing import RestoreFailed

logger = logging.getLogger(__name__)

SnapKey = tuple[int, int]  # (generation, step)


# -- pure decisions ---------------------------------------------------------------------------------
def backup_ring(members: dict[int, int], node_of: dict[int, str]) -> dict[int, int]:
    """World rank -> the rank that holds its snapshot: the next rank in a ring that visits the nodes
    in turn (round-robin), so a holder is on another node whenever the mesh spans several. Empty for
    a single rank (there is nobody to hold a copy)."""
    if len(members) < 2:
        return {}
    by_node: dict[str, list[int]] = {}
    for rank in sorted(members):
        by_node.setdefault(node_of.get(members[rank], ""), []).append(rank)
    columns = list(by_node.values())
    ring = [col[i] for i in range(max(map(len, columns))) for col in columns if i < len(col)]
    return {ring[i]: ring[(i + 1) % len(ring)] for i in range(len(ring))}


def covered(members: dict[int, int], holders: dict[int, int], live: set[int]) -> bool:
    """Whether every rank's shard has a live copy: its owner's actor or its holder's is alive."""
    return bool(holders) and all(
        actor in live or members[holders[rank]] in live for rank, actor in members.items())


def providers(members: dict[int, int], holders: dict[int, int], live: set[int]) -> dict[int, int]:
    """World rank -> the live actor that gives its snapshot (its owner, else its holder)."""
    return {rank: actor if actor in live else members[holders[rank]] for rank, actor in members.items()}


def choose_source(snapshot_step: int | None, storage_step: int) -> str:
    """"snapshot" when a covered snapshot set is at least as new as the newest checkpoint, else
    "storage" (which may be no checkpoint at all: step 0)."""
    return "snapshot" if snapshot_step is not None and snapshot_step >= storage_step else "storage"


def host_bytes_per_rank(shard_bytes: int) -> int:
    """Host memory snapshots take on one rank: its own newest complete and in-flight snapshots and
    the same two of the peer it holds (model + optimizer shard each)."""
    return 4 * shard_bytes


@dataclass
class SnapshotSet:
    """The snapshots of one step of one generation: who took them and who holds a copy."""

    generation: int
    step: int
    members: dict[int, int]  # world rank -> actor id, of that generation
    holders: dict[int, int]  # world rank -> holder's world rank
    refs: dict = field(default_factory=dict)  # keep_snapshot call -> holder actor (while in flight)
    takes: dict = field(default_factory=dict)  # snapshot call -> owner actor (while in flight)

    @property
    def key(self) -> SnapKey:
        return (self.generation, self.step)


@dataclass(frozen=True)
class Restored:
    step: int  # 0: nothing to restore, start from the beginning
    source: str  # "snapshot" | "storage"
    load_s: float = 0.0  # the members' load calls, submit to the last answer


# -- the coordinator ----------------------------------------------------------------------------------
class SnapshotCoordinator:
    """Takes, relays and restores snapshots through the worker group (tests use a fake group)."""

    def __init__(self, cfg, metrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.every = cfg.checkpoint.memory_every if cfg.checkpoint.dir else 0
        self.newest: SnapshotSet | None = None  # the newest complete set
        self._pending: SnapshotSet | None = None
        self._holders: dict[int, int] = {}  # of the current generation
        self._warned_one_node = False
        self._loose: list = []  # calls nobody collects (snapshot_blob), drained once they end
        self.stall_s: float | None = None  # the newest complete snapshot's slowest take
        self.skipped = 0  # snapshot steps skipped since the last complete set: its relay still ran

    @property
    def active(self) -> bool:
        return self.every > 0

    def begin_generation(self, group, gen) -> None:
        """A new generation formed: its ring; snapshots of it start with its next step."""
        if self._pending is not None:  # relays of the old generation still running: read once they end
            self._loose.extend(self._pending.refs)
            self._loose.extend(self._pending.takes)
        self._pending = None
        if not self.active:
            return
        node_of = {actor: group.node_ids.get(actor, "") for actor in gen.members.values()}
        self._holders = backup_ring(gen.members, node_of)
        nodes = set(node_of.values())
        if self._holders and len(nodes) == 1 and not self._warned_one_node:
            self._warned_one_node = True
            logger.warning("checkpoint.memory_every: every rank is on one node, so in-memory snapshots are "
                           "held by other processes there: they cover a lost process, not a lost node "
                           "(that falls back to the newest checkpoint in checkpoint.dir)")
        if not self._holders:
            logger.warning("checkpoint.memory_every: a single rank has no peer to hold its snapshot; "
                           "failures resume from checkpoint.dir")

    def after_step(self, group, gen, step: int) -> None:
        """Poll the relay in flight; every ``every`` steps start the next snapshot, unless the
        previous relay is still running: then this step is skipped (counted in the next ``snapshot``
        event), so training never waits for a relay and the newest complete set is never dropped."""
        if not self.active or not self._holders:
            return
        self._loose = group.drain(self._loose)
        self._settle(group, block=False)
        if step % self.every:
            return
        if self._pending is not None:
            self.skipped += 1
            return
        snap = SnapshotSet(gen.number, step, dict(gen.members), dict(self._holders))
        keep = (self.newest.key,) if self.newest is not None else ()
        actors = list(gen.members.values())
        snap.takes = group.submit(actors, "snapshot", (gen.number, step, keep))
        blobs = group.submit(actors, "snapshot_blob", (gen.number, step))
        self._loose.extend(blobs)  # read by the holders; drained so Ray never reports them unread
        ref_of = {actor: ref for ref, actor in blobs.items()}
        args = {gen.members[self._holders[rank]]: (gen.number, step, rank, ref_of[actor], keep)
                for rank, actor in gen.members.items()}
        snap.refs = group.submit(list(args), "keep_snapshot", args)
        self._pending = snap

    def settle(self, group) -> None:
        """After a failure (dead and hung actors already killed): let the relay in flight end, so
        a set whose holders all acked counts."""
        if self._pending is not None:
            self._settle(group, block=True)

    def _settle(self, group, *, block: bool) -> None:
        snap = self._pending
        if snap is None or (not block and not group.all_done(snap.refs)):
            return
        outcome = group.collect(dict(snap.refs), self.cfg.elastic.step_timeout_s)
        takes = group.collect(dict(snap.takes), 5.0)  # answered before the relay could end
        self._pending = None
        self._loose.extend(takes.pending_refs)
        if outcome.ok and takes.ok:
            self.newest = snap
            self.stall_s = max(float(t) for t in takes.results.values())
            self.metrics.event("snapshot", step=snap.step, generation=snap.generation, stall_s=self.stall_s,
                               bytes=sum(int(b) for b in outcome.results.values()), skipped=self.skipped)
            self.skipped = 0
        else:
            logger.warning("snapshot of step %d not complete: %s", snap.step,
                           outcome.failed or outcome.dead or f"no ack from actors {outcome.pending}")

    # -- restoring --------------------------------------------------------------------------------
    def usable(self, live: set[int]) -> SnapshotSet | None:
        """The newest complete snapshot set if every shard of it has a live copy, else None."""
        snap = self.newest
        if snap is None or not covered(snap.members, snap.holders, live):
            return None
        return snap

    def restore_best(self, group, gen, ckpt) -> Restored:
        """Load the newest state into every member of ``gen``: the snapshots when a covered set is at
        least as new as the newest storage checkpoint, else that checkpoint (``ckpt.restore``).

        The one entry point for resuming a generation (a rebuild after a failure, a resize, a
        rollback). Raises ``RestoreFailed`` when a member died or failed while loading.
        """
        self.settle(group)  # a planned resize right after a step: that step's set may still be relaying
        live = set(group.live_ids)
        snap = self.usable(live) if self.active else None
        info = ckpt.resume_point()
        storage_step = info.step if info is not None else 0
        if choose_source(snap.step if snap else None, storage_step) == "storage":
            if self.newest is not None:
                logger.warning("in-memory snapshot of step %d has no live copy of some shard (or is older "
                               "than checkpoint step %d): restoring from storage", self.newest.step, storage_step)
            self.newest = None  # not restorable any more; the new generation's replace it
            t0 = time.perf_counter()
            step = ckpt.restore(group, gen)
            return Restored(step, "storage", time.perf_counter() - t0)
        t0 = time.perf_counter()
        give = providers(snap.members, snap.holders, live)
        blobs = {}
        for rank in sorted(give):
            blobs.update(group.submit([give[rank]], "give_snapshot", (snap.generation, snap.step, rank)))
        refs_in_rank_order = tuple(blobs)
        refs = group.submit(list(gen.members.values()), "load_snapshot", refs_in_rank_order)
        outcome = group.collect(refs, self.cfg.elastic.rebuild_timeout_s, stop_early=lambda o: bool(o.dead or o.failed))
        if not outcome.ok:
            raise RestoreFailed(f"loading the in-memory snapshot of step {snap.step} failed: "
                                f"{outcome.failed or outcome.dead or outcome.pending}", outcome)
        return Restored(snap.step, "snapshot", time.perf_counter() - t0)

