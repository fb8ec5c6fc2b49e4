"""The in-memory snapshots one rank actor keeps: its own, and the copies it holds for a peer
(worker side; no Ray: the pushing is workers/snapshot_push.py's).

They belong to the actor, not to the generation's ``RankRuntime``: a rebuild throws the runtime away,
and the snapshots are exactly what it restores from. Keys are ``messages.SnapKey`` — (generation,
life, step), ``life`` counting the loads done in that generation, so a step re-trained after an
in-place rollback is never mistaken for the one before it. Keys order by recency.

Retention: the driver names, with every step, the newest *complete* set it knows (``keep``: every
rank's copy acknowledged by its holder). Kept are that set and the ``checkpoint.memory_keep`` - 1
newest after it (``SnapshotStore(keep=...)``; default 3: the two newest) — of this rank's own, and
of each peer it holds — everything older is dropped. So the newest complete set is never dropped
before a newer one completed, and with the default the two newest sets survive even though ``keep``
lags the steps by the window (a rank that dies before its newest push landed is restored from the
set before, one step older, not from ``keep``). An actor holds at most ``keep`` own snapshots and
``keep`` per peer it backs up (the ring gives it one peer); every copy of host memory snapshots and
staging take is counted in ``orchestrator.plan.host_memory.host_copies``. Own snapshots live in the
taker's ``keep`` reused buffer sets (``checkpoints/snapshot_taker.py``): ``slot_for`` picks the set
the next take may overwrite; a held copy is written over the one it replaces.

Threads: takes are planned on the training thread and copied and pushed on the snapshot worker's
(workers/snapshot_push.py); ``keep`` (a peer's push), ``inventory``, ``meta`` and ``pieces`` (a
restore's reads) run on the actor's snapshot thread, and ``keep`` also on the training thread before
a load (the shard fetched as the rank joined: ``snapshot_push.keep_asked``). The lock guards the maps;
a copy written over (``keep``'s reuse) is always older than the set being restored.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from meshspeak.messages import SnapKey, SnapshotInventory

if TYPE_CHECKING:  # torch-free at import: the driver imports workers.actor (tests/unit/test_driver_torch_free.py)
    from checkpoints.memory import MemorySnapshot

DEFAULT_KEEP = 3  # checkpoint.memory_keep's default: the kept set and the two newest after it


class SnapshotStore:
    def __init__(self, keep: int = DEFAULT_KEEP) -> None:
        if keep < 2:  # the complete set, and a buffer set the next take may overwrite
            raise ValueError(f"checkpoint.memory_keep must be >= 2, got {keep}")
        self.slots = keep  # own snapshots (the taker's buffer sets) and held copies per peer
        self.newest = keep - 1  # kept per owner besides the kept set
        self._lock = threading.Lock()
        self.own: dict[SnapKey, tuple[MemorySnapshot, int | None]] = {}  # key -> (snapshot, buffer set)
        self.held: dict[tuple[SnapKey, int], MemorySnapshot] = {}  # (key, owner's world rank) -> copy
        self.keep_key: SnapKey | None = None

    # -- retention --------------------------------------------------------------------------------
    def retain(self, keep: SnapKey | tuple | None) -> None:
        """The driver's newest complete set is ``keep`` (None or () when there is none yet)."""
        with self._lock:
            self.keep_key = tuple(keep) if keep else None
            self.own = _kept(self.own, self.keep_key, lambda k: 0, newest=self.newest)
            self.held = _kept(self.held, self.keep_key, lambda k: k[1], key_of=lambda k: k[0], newest=self.newest)

    def slot_for(self) -> int:
        """The buffer set the next take may overwrite: not the kept set's, else the oldest own."""
        with self._lock:
            used = {slot: key for key, (_, slot) in self.own.items() if slot is not None}
        pinned = next((slot for slot, key in used.items() if key == self.keep_key), None)
        free = [s for s in range(self.slots) if s != pinned]
        return min(free, key=lambda s: used.get(s, (-1, -1, -1)))

    def put_own(self, key: SnapKey, snap: MemorySnapshot, slot: int | None) -> None:
        """A take finished: the snapshot in that buffer set before is gone (it is written over)."""
        with self._lock:
            if slot is not None:
                self.own = {k: v for k, v in self.own.items() if v[1] != slot}
            self.own[key] = (snap, slot)
            self.own = _kept(self.own, self.keep_key, lambda k: 0, newest=self.newest)

    def drop_own_slot(self, slot: int) -> None:
        """Buffer set ``slot`` is about to be written: its snapshot stops being one."""
        with self._lock:
            self.own = {k: v for k, v in self.own.items() if v[1] != slot}

    # -- holding a peer's copy ----------------------------------------------------------------------
    def keep(self, key: SnapKey, owner: int, snap: MemorySnapshot) -> int:
        """Hold a copy of ``owner``'s snapshot in this process's memory (ours: never a view of memory
        another process owns: a Ray object dies with its owner), written over the copy it replaces."""
        with self._lock:
            mine = sorted(k for k in self.held if k[1] == owner and k[0] != self.keep_key)
            reuse = self.held.pop(mine[0]) if len(mine) >= self.newest else None  # the one it displaces
        copy = snap.copy(reuse)
        with self._lock:
            self.held[(key, owner)] = copy
            self.held = _kept(self.held, self.keep_key, lambda k: k[1], key_of=lambda k: k[0], newest=self.newest)
        return copy.nbytes

    # -- restoring --------------------------------------------------------------------------------
    def inventory(self) -> SnapshotInventory:
        with self._lock:
            return SnapshotInventory(own=tuple((k, snap.rank) for k, (snap, _) in self.own.items()),
                                     held=tuple(self.held))

    def find(self, key: SnapKey, owner: int) -> MemorySnapshot:
        """The snapshot of ``owner``'s shard at ``key``: this actor's own or a held copy."""
        key = tuple(key)
        with self._lock:
            mine = self.own.get(key)
            if mine is not None and mine[0].rank == owner:
                return mine[0]
            held = self.held.get((key, owner))
        if held is None:
            raise KeyError(f"no snapshot of rank {owner} at {key} here")
        return held

    def holds(self, key: SnapKey, owner: int) -> bool:
        """Whether ``find`` has ``owner``'s snapshot at ``key``."""
        try:
            self.find(key, owner)
        except KeyError:
            return False
        return True

    def forget_all(self) -> int:
        """Drop every snapshot, own and held, and the kept set's key (another run's: see
        ``RankActor._enter_run``); returns how many there were."""
        with self._lock:
            count = len(self.own) + len(self.held)
            self.own, self.held, self.keep_key = {}, {}, None
        return count

    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s, _ in self.own.values()) + sum(s.nbytes for s in self.held.values())


def _kept(entries: dict, keep: SnapKey | None, group_of, key_of=lambda k: k, newest: int = 1) -> dict:
    """Of ``entries`` (by snapshot key, grouped by ``group_of``: the owner), keep ``keep``'s and the
    ``newest`` newest after it in each group; drop everything older than ``keep``."""
    after: dict = {}
    for entry in entries:
        key = key_of(entry)
        if keep is None or key > keep:
            after.setdefault(group_of(entry), []).append(entry)
    kept = {e for group in after.values() for e in sorted(group, key=key_of)[-newest:]}
    return {e: v for e, v in entries.items() if (keep is not None and key_of(e) == keep) or e in kept}
