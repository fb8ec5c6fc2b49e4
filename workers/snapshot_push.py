"""A rank's snapshots leave it by its own hand: copied off the training thread, pushed to the holder
the driver named, and read back piece by piece when a new generation restores (worker side; Ray).

``SnapshotWorker`` (one thread per actor) takes a planned snapshot from the training thread, copies it
into its buffer set (``checkpoints/snapshot_taker.py``), files it as the rank's own
(``workers/snapshots.py``) and pushes it to the holder: ``holder.keep_snapshot.remote(key, rank,
snap)`` — Ray puts the bytes into this node's object store and the holder fetches them straight from
there, so they never touch the driver's node; the holder copies them into its own memory (a Ray
object dies with its owner: the holder must own its replica). The worker waits for the holder's
answer and reports it with the rank's next step result (``StepResult.snapshots``), from which the
driver counts complete sets. The holder's handle is given by the driver once per generation, for
exactly this call (``messages.GenerationOrders``): the one call a rank makes on another actor
besides a restore's reads below.

One push at a time: a snapshot step that comes while the last push is still under way is skipped
(counted), so pushes never pile up behind a slow holder. The training thread waits for the *copy*
only, and only before the next optimizer step writes the state (``fence``).

``fetch_pieces`` serves a restore (``RankActor.load_snapshot``, workers/snapshot_restore.py): the
pieces of the old shards this rank's load plan needs, from the actors the driver named as providers,
all requests at once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from meshspeak.messages import RestoreSource, SnapKey, SnapshotAck
from meshspeak.rank_calls import RankCalls, call_name
from workers.snapshots import SnapshotStore

if TYPE_CHECKING:  # torch is imported where a snapshot is handled, never when the driver imports workers.actor
    from checkpoints.memory import MemorySnapshot
    from checkpoints.snapshot_taker import PlannedSnapshot

logger = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 600.0
Providers = dict[int, tuple[int, object]]  # old world rank -> (actor id, actor handle)


class SnapshotWorker:
    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self._cond = threading.Condition()
        self._job: tuple | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._busy = False
        self._acks: list[SnapshotAck] = []
        self.skipped = 0
        self._fence_wait: dict[SnapKey, float] = {}
        self._current: SnapKey | None = None  # the take being copied or pushed
        threading.Thread(target=self._run, name="snapshots", daemon=True).start()

    # -- training thread --------------------------------------------------------------------------
    def idle(self) -> bool:
        with self._cond:
            return not self._busy

    def submit(self, key: SnapKey, planned: PlannedSnapshot | MemorySnapshot, holder, rank: int,
               plan_s: float) -> None:
        """Copy (if planned) and push ``planned`` as this rank's snapshot ``key``; the caller checked
        ``idle()``."""
        with self._cond:
            self._busy = True
            self._copied.clear()
            self._job, self._current = (key, planned, holder, rank, plan_s), key
            self._cond.notify_all()

    def fence(self) -> None:
        """Before the state is written (the next optimizer step, a load, leaving): the copy is done."""
        if self._copied.is_set():
            return
        key, t0 = self._current, time.perf_counter()
        self._copied.wait()
        with self._cond:
            self._fence_wait[key] = time.perf_counter() - t0

    def take_acks(self) -> tuple[SnapshotAck, ...]:
        with self._cond:
            acks, self._acks = tuple(self._acks), []
        return acks

    # -- any thread -------------------------------------------------------------------------------
    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    # -- the worker's thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while self._job is None:
                    self._cond.wait()
                key, planned, holder, rank, plan_s = self._job
                self._job = None
            try:
                self._take(key, planned, holder, rank, plan_s)
            except Exception as exc:  # best effort: a lost snapshot costs re-run steps, not the run
                logger.warning("snapshot %s not kept by the holder: %s: %s", key, type(exc).__name__, exc)
            finally:
                self._copied.set()
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _take(self, key: SnapKey, planned, holder, rank: int, plan_s: float) -> None:
        from checkpoints.snapshot_taker import PlannedSnapshot

        if isinstance(planned, PlannedSnapshot):
            self.store.drop_own_slot(planned.slot)
            snap, slot = planned.copy(), planned.slot
        else:
            snap, slot = planned, None
        self.store.put_own(key, snap, slot)
        self._copied.set()  # the training thread may write the state again
        if holder is None:
            return
        snap.serialize()  # the few non-tensor items' bytes, here rather than on the training thread
        nbytes = ray.get(getattr(holder, call_name(RankCalls.keep_snapshot)).remote(key, rank, snap),
                         timeout=PUSH_TIMEOUT_S)
        with self._cond:
            stall = plan_s + self._fence_wait.pop(key, 0.0)
            self._acks.append(SnapshotAck(key=key, stall_s=stall, nbytes=int(nbytes)))


def fetch_pieces(store: SnapshotStore, key: SnapKey, providers: Providers, me: int,
                 wanted: dict[int, list[tuple]]) -> dict[int, list]:
    """The pieces ``wanted`` (old rank -> [(storage index, offsets, lengths)]) of snapshot set
    ``key``: from this actor's own store when it is the provider, else from the provider's actor
    (``providers``: old rank -> (actor id, handle)), every remote request issued before any is read."""
    from checkpoints.memory import unpack_piece

    refs, out = {}, {}
    for owner, requests in wanted.items():
        actor, handle = providers[owner]
        if actor == me:
            out[owner] = store.find(key, owner).pieces(requests)
        else:
            refs[owner] = getattr(handle, call_name(RankCalls.snapshot_pieces)).remote(key, owner, requests)
    for owner, ref in refs.items():
        out[owner] = [unpack_piece(p) for p in ray.get(ref, timeout=PUSH_TIMEOUT_S)]
    return out


def serve_pieces(store: SnapshotStore, key: SnapKey, owner: int, requests: list) -> list:
    from checkpoints.memory import pack_piece

    return [pack_piece(p) for p in store.find(key, owner).pieces(requests)]


def providers_of(source: RestoreSource) -> Providers:
    """``source.providers`` (old world rank, actor id, handle) by old world rank."""
    return {rank: (actor, handle) for rank, actor, handle in source.providers}


def ask_metadata(store: SnapshotStore, key: SnapKey, providers: Providers,
                 me: int) -> dict[int, object]:
    """Ask now for the snapshot metadata of set ``key`` that a restore will read from other actors:
    old rank -> the pending answer (a Ray reference), for each old rank this actor neither holds nor
    provides. Asked as the rank joins the generation that loads it (``GenerationOrders.restore``), so
    the answers come while its groups and model are built; ``fetch_metadata`` reads them."""
    return {owner: getattr(handle, call_name(RankCalls.snapshot_meta)).remote(key, owner)
            for owner, (actor, handle) in providers.items()
            if actor != me and not store.holds(key, owner)}


@dataclass
class AskedAhead:
    """What a joining rank asked the providers for, ahead of the snapshot load that follows its join
    (``GenerationOrders.restore``; answered while it builds its groups and model): ``ask_ahead``."""

    key: SnapKey
    metadata: dict[int, object]  # old rank -> its pending metadata (``fetch_metadata``'s ``asked``)
    shard: tuple[int, object] | None = None  # (old rank, its pending whole snapshot), to keep before the load


def ask_ahead(store: SnapshotStore, source: RestoreSource, new_rank: int, new_world: int, me: int) -> AskedAhead:
    """Ask now for what the load of ``source`` as rank ``new_rank`` of ``new_world`` will read from other
    actors. A mesh of the old one's size lays out rank r's shard as old rank r's, so where this actor
    holds no copy of old rank ``new_rank``'s snapshot, the whole of it is asked for (``give_snapshot``)
    and kept before the load (``keep_asked``), which then copies it in place from this actor's own
    store: a promoted spare, or a survivor numbered anew, fetches while it joins, not while every
    rank waits in the load (the fetch was most of a spare's 0.19 s restore on bench/recovery.py).
    Besides, the metadata of every other old rank it neither holds nor provides (``ask_metadata``;
    a changed size assembles its pieces from many)."""
    key = tuple(source.key)
    providers = providers_of(source)
    shard = None
    if (new_world == source.world and new_rank in providers and providers[new_rank][0] != me
            and not store.holds(key, new_rank)):
        handle = providers[new_rank][1]
        shard = (new_rank, getattr(handle, call_name(RankCalls.give_snapshot)).remote(key, new_rank))
    others = {rank: p for rank, p in providers.items() if shard is None or rank != new_rank}
    return AskedAhead(key, ask_metadata(store, key, others, me), shard)


def keep_asked(store: SnapshotStore, asked: AskedAhead) -> int:
    """Keep the whole shard ``ask_ahead`` asked for, once it came (waiting for it if it has not); the
    bytes kept. Not read when a copy is here by now: the driver's second copy of a lone shard goes to
    the rank that loads it (orchestrator/saves/snapshots.py ``second_homes``), and lands as it joins.
    The reference is dropped either way (it pins the shard in Ray's object store). A provider that
    failed to give it leaves the load to read what it needs as before (whose error then names what is
    missing)."""
    if asked.shard is None:
        return 0
    (owner, ref), asked.shard = asked.shard, None
    if store.holds(asked.key, owner):
        return 0
    try:
        return store.keep(asked.key, owner, ray.get(ref, timeout=PUSH_TIMEOUT_S))
    except Exception as exc:  # the load reads from the providers instead
        logger.warning("snapshot %s of old rank %d asked for ahead did not come: %s: %s", asked.key, owner,
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return 0


def fetch_metadata(store: SnapshotStore, key: SnapKey, providers: Providers, me: int,
                   owners: list[int] | None = None, asked: dict[int, object] | None = None) -> list:
    """The snapshot metadata of every old rank in old-rank order, or of ``owners`` in their order (a
    restore's first read): this actor's own store answers for the ranks it provides, the others'
    actors for theirs (``asked``: answers already asked for, ``ask_metadata``), every remote request
    issued before any is read."""
    owners = sorted(providers) if owners is None else list(owners)
    asked = asked or {}
    refs = {}
    out = {}
    for owner in owners:
        actor, handle = providers[owner]
        if actor == me:
            out[owner] = store.find(key, owner).metadata
        elif owner in asked:
            refs[owner] = asked[owner]
        else:
            refs[owner] = getattr(handle, call_name(RankCalls.snapshot_meta)).remote(key, owner)
    for owner, ref in refs.items():
        out[owner] = ray.get(ref, timeout=PUSH_TIMEOUT_S)
    return [out[owner] for owner in owners]
