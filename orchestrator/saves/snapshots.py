"""In-memory snapshots, driver side: who backs up whom, which sets are complete, and the one function
that restores a new generation from the best source (no Ray, no torch).

Every ``checkpoint.memory_every`` steps (with ``checkpoint.dir`` set) each rank takes a snapshot of
its shard — model, optimizer, step — into reused host buffers, off its training thread, and pushes it
itself to its *holder*, the next rank of a ring that prefers another node (``backup_ring``)
(workers/snapshot_push.py). The driver only names the holders, once per generation
(``GenerationOrders``: the holder's actor handle): **no snapshot byte passes through the driver's
node**, and no call per step is made for them. Each rank reports in its step results the snapshots
its holder acknowledged (``StepResult.snapshots``); a step's set is *complete* once every rank's was
(``after_results``: a ``snapshot`` event). The newest complete set's key goes back to the ranks with
every step (``keep``): each actor keeps that set and the newest snapshots after it, of its own shard
and of the peer it holds (workers/snapshots.py), so the newest complete set is never dropped before a
newer one completed. A rank pushes one snapshot at a time and skips a snapshot step while its last push
still runs, so training never waits for a holder.

After a failure, ``restore_best`` asks every live actor what it holds (``snapshot_inventory``), takes
the newest set of which every old rank's shard has a live copy (its owner's or its holder's), if it is
at least as new as the newest committed checkpoint, else that checkpoint (``choose_source``), and says
which (``restored_from`` in the ``rebuild`` event). A shard of that set left with one live copy gets a
second one before the new generation joins (``second_copies``), so a second loss during the rebuild
does not send the run back to storage. Every new member loads it resharded into the new
mesh through DCP, fetching from the providers only the pieces of the old shards its own shard needs
(``RankActor.load_snapshot``: bytes moved per new rank ~ its own shard, whatever the two meshes).
Snapshots of a generation are keyed by it, so the old set stays restorable until the new generation
completed one of its own. On one node the holders are other processes there: a node loss is not
covered (one warning).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from meshspeak.mesh import same_shard_ranks
from meshspeak.messages import RestoreSource, SnapKey, StepResult
from meshspeak.rank_calls import RankCalls
from meshspeak.sections import CheckpointConfig, ElasticConfig
from orchestrator.recovery.hang_watch import collect_while_alive, probe
from orchestrator.saves.checkpointing import RestoreFailed

logger = logging.getLogger(__name__)

INVENTORY_TIMEOUT_S = 10.0
COVER_SETTLE_S = 10.0  # a planned re-form waits this long for the last pushes before saving instead
GIVE_WAIT_S = 1.0  # how long a wait for second copies' gives lasts before their silent holders are probed
MAX_GIVE_WAITS = 1000  # such waits at most (holders that answer probes are waited for: never reached on a clock)


# -- pure decisions ---------------------------------------------------------------------------------
def backup_ring(members: dict[int, int], node_of: dict[int, str]) -> dict[int, int]:
    """World rank -> the rank that holds its snapshot: the next rank in a ring in which no two
    neighbours share a node whenever no node holds more than half the ranks, so that losing a node
    loses no shard's both copies. Empty for a single rank (there is nobody to hold a copy).

    The ranks, the largest node's first, fill every other place of the ring, then the places between
    (the way to seat a cycle with no two neighbours alike). Visiting the nodes in turn instead wraps
    within a node when they hold unequal counts: ranks on nodes A, A, B, C made the ring A B C A, and
    bench/chaos.py's node losses (node_removal, a drain past its deadline) then took both copies of a
    shard and went back to storage (2 of 14 rebuilds of one campaign)."""
    if len(members) < 2:
        return {}
    by_node: dict[str, list[int]] = {}
    for rank in sorted(members):
        by_node.setdefault(node_of.get(members[rank], ""), []).append(rank)
    order = [rank for column in sorted(by_node.values(), key=len, reverse=True) for rank in column]
    places = [*range(0, len(order), 2), *range(1, len(order), 2)]
    ring = [0] * len(order)
    for place, rank in zip(places, order, strict=True):
        ring[place] = rank
    return {ring[i]: ring[(i + 1) % len(ring)] for i in range(len(ring))}


def covered(members: dict[int, int], holders: dict[int, int], live: set[int],
            same: list[int] | None = None) -> bool:
    """Whether every rank's shard has a live copy: its owner's actor or its holder's is alive, or
    those of a rank holding the same shard (``same``: rank -> its class, ``meshspeak.mesh.same_shard_ranks``;
    HSDP's replicas, ZeRO-0's ranks)."""
    if not holders:
        return False
    alive = {rank for rank, actor in members.items() if actor in live or members[holders[rank]] in live}
    classes = same or list(range(len(members)))
    return {classes[rank] for rank in alive} >= {classes[rank] for rank in members}


def newest_covered(inventories: dict[int, object], worlds: dict[int, int],
                   at_most: int | None = None,
                   same: dict[int, list[int]] | None = None) -> tuple[SnapKey, dict[int, int]] | None:
    """The newest snapshot set of which every rank's shard is held by one of the answering actors,
    and who gives each (old world rank -> actor id: the owner's own copy first, else a held one).
    ``inventories``: actor id -> its ``SnapshotInventory``; ``worlds``: generation -> its rank count;
    ``at_most``: no set of a later step (one the driver never recorded: see ``restore_best``);
    ``same``: generation -> each rank's class of ranks holding the same shard (HSDP's replicas:
    ``meshspeak.mesh.same_shard_ranks``): a shard whose every copy is gone is covered by another rank
    of its class, and the givers then name only the old ranks that have a copy."""
    givers: dict[SnapKey, dict[int, int]] = {}
    for actor, inv in sorted(inventories.items()):
        for key, rank in inv.own:
            givers.setdefault(tuple(key), {})[rank] = actor  # own copies win
    for actor, inv in sorted(inventories.items()):
        for key, rank in inv.held:
            givers.setdefault(tuple(key), {}).setdefault(rank, actor)
    for key in sorted(givers, reverse=True):
        if at_most is not None and key[2] > at_most:
            continue
        world = worlds.get(key[0])
        classes = (same or {}).get(key[0]) or list(range(world or 0))
        if world and {classes[rank] for rank in givers[key] if rank < world} >= set(classes):
            return key, {rank: givers[key][rank] for rank in range(world) if rank in givers[key]}
    return None


def copies_of(inventories: dict[int, object], key: SnapKey) -> dict[int, set[int]]:
    """Old world rank -> the answering actors that hold a copy of its shard of set ``key`` (own or held)."""
    out: dict[int, set[int]] = {}
    for actor, inv in inventories.items():
        for k, rank in (*inv.own, *inv.held):
            if tuple(k) == tuple(key):
                out.setdefault(rank, set()).add(actor)
    return out


def second_homes(copies: dict[int, set[int]], classes: list[int], candidates: list[int],
                 node_of: dict[int, str], loaders: dict[int, int] | None = None) -> dict[int, tuple[int, int]]:
    """For each class of ranks holding the same shard (``classes``: rank -> class) whose shard has
    exactly one live copy: rank -> (the actor holding it, the actor to give a second copy). That is
    the actor that will load the shard in place (``loaders``: old rank -> actor, where the new mesh
    has the old size) unless it is on the holder's node and another node has a candidate: the copy
    then also saves that rank's fetch in the load (a promoted spare's). Else it is chosen among
    ``candidates`` (in order of preference) on another node than the holder where there is one, each
    candidate given as few copies as can be. Classes with no copy or two are left out."""
    by_class: dict[int, set[tuple[int, int]]] = {}
    for rank, actors in copies.items():
        by_class.setdefault(classes[rank], set()).update((rank, actor) for actor in actors)
    given: dict[int, int] = dict.fromkeys(candidates, 0)
    out = {}
    for cls in sorted(by_class):
        if len({actor for _, actor in by_class[cls]}) != 1:
            continue
        rank, holder = min(by_class[cls])
        choices = [a for a in candidates if a != holder]
        if not choices:
            continue
        # Fewest copies given first, then another node than the holder's, then the caller's order.
        target = min(choices, key=lambda a: (given[a], node_of.get(a, "") == node_of.get(holder, ""),
                                             candidates.index(a)))
        loader = (loaders or {}).get(rank)
        if loader in given and loader != holder and (node_of.get(loader, "") != node_of.get(holder, "")
                                                      or node_of.get(target, "") == node_of.get(holder, "")):
            target = loader
        given[target] += 1
        out[rank] = (holder, target)
    return out


def choose_source(snapshot_step: int | None, storage_step: int) -> str:
    """"snapshot" when a covered snapshot set is at least as new as the newest checkpoint, else
    "storage" (which may be no checkpoint at all: step 0)."""
    return "snapshot" if snapshot_step is not None and snapshot_step >= storage_step else "storage"


@dataclass
class SnapshotSet:
    """The snapshots of one step of one generation: who took them, who holds a copy, what arrived."""

    key: SnapKey
    members: dict[int, int]  # world rank -> actor id, of that generation
    holders: dict[int, int]  # world rank -> holder's world rank
    acked: set[int] = field(default_factory=set)  # world ranks whose holder acknowledged
    same: list[int] | None = None  # world rank -> its class of ranks holding the same shard (covered)
    stall_s: float = 0.0
    nbytes: int = 0

    @property
    def step(self) -> int:
        return self.key[2]


@dataclass(frozen=True)
class Restored:
    step: int  # 0: nothing to restore, start from the beginning
    source: str  # "snapshot" | "storage"
    load_s: float = 0.0  # the members' load calls, submit to the last answer
    fetched_bytes: int = 0  # snapshot pieces the members fetched, all of them together
    fetched_ahead_bytes: int = 0  # of those: whole shards fetched as the members joined (RestoreAck.fetched_ahead)
    shard_bytes: int = 0  # the members' own states after the load, all together
    direct: bool = False  # every member copied an old rank's shard in place (no resharding: RestoreAck.direct)


@dataclass(frozen=True)
class RestorePlan:
    """What a new generation resumes from, decided before its members join: they are told whether a
    load follows (``RuntimeSpec.load_follows``: built uninitialised, a step before the load refuses),
    so the join and the load must follow the same decision."""

    found: tuple[SnapKey, dict[int, int]] | None  # the newest covered snapshot set and its givers
    storage_step: int | None  # the newest committed checkpoint's step (None: none)
    copies: dict[int, set[int]] = field(default_factory=dict)  # found's old rank -> live actors with a copy

    @property
    def source(self) -> str:
        return choose_source(self.found[0][2] if self.found else None, self.storage_step or 0)

    @property
    def loads(self) -> bool:
        """Whether restoring loads anything (else the generation starts from its random init)."""
        return self.source == "snapshot" or self.storage_step is not None


# -- the coordinator ----------------------------------------------------------------------------------
class SnapshotCoordinator:
    """Counts complete sets from the step results and restores through the worker group."""

    def __init__(self, checkpoint: CheckpointConfig, elastic: ElasticConfig, metrics, run_id: str = "") -> None:
        self.elastic = elastic  # rebuild_timeout_s: how often the members of a snapshot load are probed
        self.metrics = metrics
        self.run_id = run_id  # the inventories asked are of this run's snapshots only (RankActor._enter_run)
        self.every = checkpoint.memory_every if checkpoint.dir else 0
        self.newest: SnapshotSet | None = None  # the newest complete set
        self._sets: dict[SnapKey, SnapshotSet] = {}  # sets of the current generation not complete yet
        self._holders: dict[int, int] = {}  # world rank -> holder rank, of the current generation
        self._generation = None  # the current GenerationRecord
        self._worlds: dict[int, int] = {}  # generation -> rank count (for restores)
        self._same: dict[int, list[int]] = {}  # generation -> each rank's class of ranks holding its shard
        self._warned_one_node = False
        self._last_complete = 0  # step of the last complete set (for ``skipped``)

    @property
    def active(self) -> bool:
        return self.every > 0

    @property
    def keep(self) -> SnapKey | tuple:
        """The newest complete set's key, which every rank keeps (``RankCalls.train_step``)."""
        return self.newest.key if self.newest is not None else ()

    def holders_for(self, gen, node_of: dict[int, str]) -> dict[int, int]:
        """Before generation ``gen`` forms: its ring (world rank -> holder rank); empty when off."""
        if not self.active:
            return {}
        holders = backup_ring(gen.members, node_of)
        if holders and len(set(node_of.values())) == 1 and not self._warned_one_node:
            self._warned_one_node = True
            logger.warning("checkpoint.memory_every: every rank is on one node, so in-memory snapshots are "
                           "held by other processes there: they cover a lost process, not a lost node "
                           "(that falls back to the newest checkpoint in checkpoint.dir)")
        if not holders:
            logger.warning("checkpoint.memory_every: a single rank has no peer to hold its snapshot; "
                           "failures resume from checkpoint.dir")
        return holders

    def begin_generation(self, gen, holders: dict[int, int]) -> None:
        """Generation ``gen`` formed: its snapshots are counted from now."""
        self._generation, self._holders = gen, dict(holders)
        self._worlds[gen.number] = gen.shape.world
        self._same[gen.number] = same_shard_ranks(gen.shape, gen.plan.dp.replicate)
        self._sets = {}

    def after_results(self, results: list[StepResult]) -> None:
        """Count the holders' acknowledgements a step's results carry; a set is complete when every
        rank's arrived (a ``snapshot`` event, and the key the ranks keep from now on)."""
        if not self.active or not self._holders:
            return
        gen = self._generation
        for result in results:
            for ack in result.snapshots:
                key = tuple(ack.key)
                if key[0] != gen.number or (self.newest is not None and key <= self.newest.key):
                    continue  # a push from before this generation formed, or of a set already superseded
                snap = self._sets.get(key)
                if snap is None:
                    snap = self._sets[key] = SnapshotSet(key, dict(gen.members), dict(self._holders),
                                                         same=self._same.get(gen.number))
                snap.acked.add(result.world_rank)
                snap.stall_s = max(snap.stall_s, ack.stall_s)
                snap.nbytes += ack.nbytes
        done = [s for s in self._sets.values() if len(s.acked) == gen.shape.world]
        if done:
            self._complete(max(done, key=lambda s: s.key))

    def _complete(self, snap: SnapshotSet) -> None:
        skipped = max(0, (snap.step - self._last_complete) // self.every - 1) if self._last_complete else 0
        self.newest, self._last_complete = snap, snap.step
        self._sets = {k: v for k, v in self._sets.items() if k > snap.key}
        self.metrics.event("snapshot", step=snap.step, generation=snap.key[0], stall_s=snap.stall_s,
                           bytes=snap.nbytes, skipped=skipped)

    def settle(self, group, gen=None, timeout_s: float = 30.0) -> None:
        """Wait (up to ``timeout_s``) until every member's newest snapshot was pushed and acknowledged:
        after a failure, so a push under way still counts; in tests' hooks. (The acknowledgements
        themselves arrive with the next step results; a restore asks the actors what they hold.)"""
        gen = gen or self._generation
        if self.active and self._holders and gen is not None:
            live = set(group.live_ids)
            actors = [a for a in gen.members.values() if a in live]
            group.call(actors, RankCalls.wait_snapshots, (timeout_s,), timeout_s=timeout_s + 5)

    def covers(self, group, gen, step: int, without: frozenset[int] = frozenset()) -> bool:
        """Whether the snapshot set of ``step`` (pushes under way waited for) has a copy of every shard
        on a live actor outside ``without``: a planned re-form that loses no state resumes from it as
        exactly as from a checkpoint of ``step``, without writing one (the chaos bench's grows and
        evictions spent 0.3-0.7 s each in that save)."""
        if not self.active or not self._holders or gen is None:
            return False
        self.settle(group, gen, timeout_s=COVER_SETTLE_S)
        found = self._find(group, step, without=without)
        return found is not None and found[0][2] == step

    # -- restoring --------------------------------------------------------------------------------
    def usable(self, live: set[int]) -> SnapshotSet | None:
        """The newest complete set if every shard of it has a live copy, else None."""
        snap = self.newest
        if snap is None or not covered(snap.members, snap.holders, live, snap.same):
            return None
        return snap

    def plan_restore(self, group, ckpt, *, at_most: int) -> RestorePlan:
        """Where a restore would resume from now: the newest snapshot set of which the live actors hold
        every shard (``at_most``: see ``restore_best``), and the newest committed checkpoint."""
        inventories = self._poll(group) if self.active else {}
        found = newest_covered(inventories, self._worlds, at_most, self._same) if self.active else None
        info = ckpt.resume_point(vet_metadata=False)  # only the step: restore() vets what it loads
        return RestorePlan(found, info.step if info is not None else None,
                           copies_of(inventories, found[0]) if found else {})

    def second_copies(self, group, plan: RestorePlan, candidates: list[int], node_of: dict[int, str],
                      members: dict[int, int] | None = None) -> dict:
        """Before a new generation joins: every shard of the set ``plan`` restores that a loss left with
        one live copy is given a second one, on another of the live ``candidates`` (in order of
        preference: the new members first; in a mesh of the old size the member of the shard's rank
        number in ``members``, which loads it: ``second_homes``). A second loss while the generation
        joins or loads (a member dying as it joins) then still finds the set covered: with one copy,
        losing the actor that held it sent the run back to the newest checkpoint, and bench/chaos.py's
        kill_rebuild re-ran 4 steps that way.

        In two halves, so that only the first is waited for before the join: each holder gives the
        shard (``give_snapshot``: its answer lands in Ray's object store, owned by the driver, so it
        outlives the holder's process, not its node), then its new home keeps it (``keep_snapshot``,
        handed that answer) while the members join; ``wait_copies`` waits for the keeps. Done in one
        call and waited for whole, the copies took 0.06-0.14 s of bench/recovery.py's recovery and
        0.2-0.6 s of the chaos campaign's (26 MB shards). Returns the keeps under way (ref -> actor)."""
        if plan.source != "snapshot":
            return {}
        key = plan.found[0]
        classes = self._same.get(key[0]) or list(range(self._worlds.get(key[0], 0)))
        loaders = members if members and len(members) == len(classes) else None
        homes = second_homes(plan.copies, classes, candidates, node_of, loaders)
        gives = {rank: next(iter(group.submit([holder], RankCalls.give_snapshot, {holder: (key, rank)})))
                 for rank, (holder, _) in homes.items()}
        given = self._wait_given(group, gives, {rank: holder for rank, (holder, _) in homes.items()})
        keeps: dict = {}
        for rank in given:
            target = homes[rank][1]
            keeps.update(group.submit([target], RankCalls.keep_snapshot, {target: (key, rank, gives[rank])}))
        return keeps

    def _wait_given(self, group, gives: dict, holders: dict[int, int]) -> list[int]:
        """Wait until the holders answered their ``give_snapshot`` calls (rank -> ref), without reading
        the answers (torch objects); the ranks whose keep is to be asked for: all, but those whose
        holder answers no liveness probe while its give is still out (that shard keeps one copy). A
        give that failed still counts: its keep fails with it, and ``wait_copies`` says so. (A loop of
        its own, not ``collect_while_alive``: that reads the answers.)"""
        pending = dict(gives)
        for _ in range(MAX_GIVE_WAITS):  # bounded by rounds, not by a clock (a slow holder is waited for)
            if not pending or group.all_done(list(pending.values()), wait_s=GIVE_WAIT_S):
                return list(gives)
            pending = {rank: ref for rank, ref in pending.items() if not group.all_done([ref])}
            polled, _ = probe(group, sorted({holders[rank] for rank in pending}), time.monotonic)
            silent = set(polled.pending) | set(polled.dead)
            if silent:
                logger.warning("second copies: holders %s answer no probe: their shards keep one copy", sorted(silent))
                return [rank for rank in gives if holders[rank] not in silent]
        return [rank for rank in gives if rank not in pending]

    def wait_copies(self, group, keeps: dict) -> None:
        """Wait for every one of the second copies' keeps (``second_copies``) while their actors are
        alive: a keep that failed (its actor died, or the give it was handed) leaves that shard with
        one copy, and the others are still waited for (the next plan must see the copies made)."""
        pending, missed = dict(keeps), {}
        while pending:
            outcome = collect_while_alive(group, pending, self.elastic.rebuild_timeout_s,
                                          f"keeping {len(pending)} second snapshot cop(ies)")
            missed.update(outcome.failed)
            missed.update(outcome.dead)
            if outcome.hung:  # silent: not waited for any more
                missed.update(outcome.hung)
                break
            pending = outcome.pending_refs
        if missed:  # the join or the load finds who died; the copies made still count
            logger.warning("second copies of snapshot shards: not all made (%s)", missed)

    def restore_best(self, group, gen, ckpt, *, at_most: int, plan: RestorePlan | None = None) -> Restored:
        """Load the newest state into every member of ``gen``: the snapshots when a covered set is at
        least as new as the newest storage checkpoint, else that checkpoint (``ckpt.restore``).
        ``at_most``: the last step the driver recorded. With steps in flight the ranks may have taken
        (and pushed) snapshots of steps after it that were never recorded: a rollback's bad steps
        are replayed from before them, and a broken step's successors are not counted. ``plan``: the
        decision the members joined under (``plan_restore``), else taken now (an in-place rollback).

        The one entry point for resuming a generation (a rebuild after a failure, a resize, a
        rollback). Raises ``RestoreFailed`` when a member died or failed while loading.
        """
        plan = plan or self.plan_restore(group, ckpt, at_most=at_most)
        if plan.source == "storage":
            if self.newest is not None:
                logger.warning("in-memory snapshot of step %d has no live copy of some shard (or is older "
                               "than checkpoint step %d): restoring from storage", self.newest.step,
                               plan.storage_step or 0)
            self.newest = None  # not restorable any more; the new generation's replace it
            t0 = time.perf_counter()
            step = ckpt.restore(group, gen)
            return Restored(step, "storage", time.perf_counter() - t0)
        source = self.source_of(group, plan)
        key = source.key
        t0 = time.perf_counter()
        refs = group.submit(list(gen.members.values()), RankCalls.load_snapshot, (source,))
        # Waited for while the loaders answer liveness probes: rebuild_timeout_s is the probe interval.
        outcome = collect_while_alive(group, refs, self.elastic.rebuild_timeout_s,
                                      f"loading the in-memory snapshot of step {key[2]}",
                                      stop_early=lambda o: bool(o.dead or o.failed))
        if not outcome.ok:
            raise RestoreFailed(f"loading the in-memory snapshot of step {key[2]} failed: "
                                f"{outcome.failed or outcome.dead or outcome.pending}", outcome)
        acks = list(outcome.results.values())
        return Restored(key[2], "snapshot", time.perf_counter() - t0,
                        fetched_bytes=sum(a.fetched_bytes for a in acks), shard_bytes=sum(a.shard_bytes for a in acks),
                        fetched_ahead_bytes=sum(a.fetched_ahead for a in acks),
                        direct=bool(acks) and all(a.direct for a in acks))

    def source_of(self, group, plan: RestorePlan) -> RestoreSource | None:
        """What the members load when ``plan`` restores snapshots (None when it does not): the set
        and, for each old rank, the actor that provides its pieces."""
        if plan.source != "snapshot":
            return None
        key, givers = plan.found
        return RestoreSource(key=key, world=self._worlds.get(key[0], len(givers)),
                             providers=tuple((rank, actor, group.handle(actor)) for rank, actor in givers.items()))

    def _find(self, group, at_most: int,
              without: frozenset[int] = frozenset()) -> tuple[SnapKey, dict[int, int]] | None:
        return newest_covered(self._poll(group, without), self._worlds, at_most, self._same)

    def _poll(self, group, without: frozenset[int] = frozenset()) -> dict[int, object]:
        """Live actor (outside ``without``) -> its ``SnapshotInventory``."""
        live = [a for a in group.live_ids if a not in without]
        # Waited for while they answer liveness probes (time alone never fails a live run): a fixed
        # 10 s wait, which a loaded host's answer can miss, left a live holder's copies out, so a
        # covered set read as lost and the run went back to storage (step 0 when none was committed).
        # An actor silent to a probe is left out (its copies with it); the join or the load finds it.
        refs = group.submit(live, RankCalls.snapshot_inventory, (self.run_id,))
        polled = collect_while_alive(group, refs, INVENTORY_TIMEOUT_S, "asking the live actors for their snapshots")
        return polled.results
