"""The in-memory snapshots one rank actor keeps: its own, and the copies it holds for a peer
(worker side; no Ray, so the actor's methods stay thin).

They belong to the actor, not to the generation's ``RankRuntime``: a rebuild throws the runtime away,
and the snapshots are exactly what it restores from. Keys are ``(generation, step)``; the driver
says with every call which other keys to keep (``orchestrator/saves/snapshots.py``), everything else is
dropped, so an actor holds at most the newest complete set and the one in flight, of itself and of
the one peer it backs up.

Threads: ``take`` runs on the training thread (the copy to host is the step's only cost); ``blob``,
``keep`` and ``give`` run on the actor's other threads, while training goes on. ``blob`` waits for the
``take`` of the same key, which the driver submitted first but which may still be queued behind work
on the training thread.
"""

from __future__ import annotations

import threading
import time

from checkpoints.memory import MemorySnapshot

SnapKey = tuple[int, int]  # (generation, step)


class SnapshotStore:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.own: dict[SnapKey, MemorySnapshot] = {}
        self.held: dict[tuple[SnapKey, int], MemorySnapshot] = {}  # (key, owner's world rank) -> copy
        self._failed: dict[SnapKey, str] = {}

    def put_own(self, key: SnapKey, snap: MemorySnapshot | None, keep: tuple, error: str = "") -> None:
        with self._cond:
            keep_keys = {tuple(k) for k in keep} | {key}
            self.own = {k: v for k, v in self.own.items() if k in keep_keys}
            self._failed = {}
            if snap is None:
                self._failed[key] = error
            else:
                self.own[key] = snap
            self._cond.notify_all()

    def blob(self, key: SnapKey, timeout_s: float) -> MemorySnapshot:
        """This actor's own snapshot of ``key``, once taken (waits up to ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while key not in self.own:
                if key in self._failed:
                    raise RuntimeError(f"snapshot {key} failed: {self._failed[key]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"snapshot {key} not taken after {timeout_s:.0f}s")
                self._cond.wait(left)
            snap = self.own[key]
        return snap.serialize()  # on this (non-training) thread, before Ray pickles it

    def keep(self, key: SnapKey, owner: int, snap: MemorySnapshot, keep: tuple) -> int:
        """Hold a copy of ``owner``'s snapshot in this process's memory; drop what is not kept."""
        copy = snap.copy()  # ours: never a view of memory another process owns
        keep_keys = {tuple(k) for k in keep} | {key}
        with self._cond:
            self.held = {k: v for k, v in self.held.items() if k[0] in keep_keys}
            self.held[(key, owner)] = copy
        return copy.nbytes

    def give(self, key: SnapKey, owner: int) -> MemorySnapshot:
        """The snapshot of ``owner``'s shard at ``key``: this actor's own or a held copy."""
        with self._cond:
            mine = self.own.get(key)
            if mine is not None and mine.rank == owner:
                return mine.serialize()
            held = self.held.get((key, owner))
        if held is None:
            raise KeyError(f"no snapshot of rank {owner} at generation {key[0]} step {key[1]} here")
        return held

    def nbytes(self) -> int:
        with self._cond:
            return sum(s.nbytes for s in self.own.values()) + sum(s.nbytes for s in self.held.values())
