"""Taking one rank's in-memory snapshots into reused host buffers, the copies off the training thread
(worker side; torch, no Ray; docs/design.md, In-memory snapshots).

DCP plans every save from scratch: flattening and planning ~600 items took ~30 ms of a 32 ms take
on a 20-layer MLP (cProfile), the copies 1.6 ms. The items, their metadata and where each sits in
the state do not change within a generation, so after the first take (through ``dcp.save`` into a
``checkpoints.memory.MemoryWriter``) later ones look the same items up directly (DCP's
``find_state_dict_object``, as its planner's ``resolve_data`` does) and reuse the metadata. A state
whose keys or tensor shapes differ from the planned ones goes through ``dcp.save`` again.

A planned take is two halves. ``SnapshotTaker.plan`` runs on the training thread at the step
boundary: it finds each local piece, picks the host buffer it goes into — one buffer per piece in
each buffer set (``slot``: the caller's, one per snapshot it keeps, ``checkpoint.memory_keep``),
allocated at the set's first use and reused (pinned when the pieces are on CUDA, so the
device-to-host copies run at full speed) — and deep-copies the few non-tensor items (their bytes are
made later, ``MemorySnapshot.serialize``). ``PlannedSnapshot.copy`` then copies every piece, on any
thread; on CUDA on a stream of its own after an event recorded at the boundary, so the copies see the
parameters as the step left them and overlap the next step's kernels. The caller must not let the
optimizer write the state before ``copy`` returned (``workers/snapshots.py`` fences the next
optimizer step on it). Before, each take allocated fresh pageable memory and copied tensor by tensor,
blocking, on the training thread (issue 26, item 6).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.utils import find_state_dict_object

from checkpoints.memory import Deferred, MemorySnapshot, take_snapshot
from checkpoints.reader import _set_path


@dataclass
class PlannedSnapshot:
    """A take whose copies have not run yet: (index, source piece, its buffer) per tensor item."""

    step: int
    rank: int
    metadata: Metadata
    slot: int
    pieces: list[tuple[MetadataIndex, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    objects: dict[MetadataIndex, Deferred] = field(default_factory=dict)
    ready: Any = None  # CUDA: an event recorded at the step boundary, what the copies wait for
    stream: Any = None  # CUDA: the copies' own stream

    def copy(self) -> MemorySnapshot:
        """Copy every piece into its buffer (any thread); the snapshot, whose tensors are the buffers."""
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self.ready)
                for _, src, dst in self.pieces:
                    dst.copy_(src, non_blocking=True)
            self.stream.synchronize()
        else:
            for _, src, dst in self.pieces:
                dst.copy_(src)
        blobs: dict[MetadataIndex, Any] = {index: dst for index, _, dst in self.pieces}
        blobs.update(self.objects)
        return MemorySnapshot(step=self.step, rank=self.rank, metadata=self.metadata, blobs=blobs)


class SnapshotTaker:
    """Takes one rank's snapshots of one generation (see the module docstring)."""

    def __init__(self) -> None:
        self._metadata: Metadata | None = None
        self._items: list[tuple[MetadataIndex, bool, tuple]] = []  # (index, is bytes, path in state)
        self._signature: frozenset = frozenset()
        self._shapes: dict[MetadataIndex, tuple] = {}
        # slot -> that buffer set's tensors; a set is made at its slot's first planned take
        self._buffers: dict[int, dict[MetadataIndex, torch.Tensor]] = {}
        self._stream = None

    def seed(self, metadata: Metadata) -> bool:
        """Plan the takes from ``metadata`` instead of a first ``dcp.save``: the snapshot metadata of
        an old rank whose every piece this rank's state now holds at the same place (a restore in
        place: checkpoints/direct_load.py), which is what this rank's own first take would plan. The
        first take after a rebuild ran ``dcp.save`` on the training thread right after the
        generation's first step, before its result went back: 0.16-0.35 s against 0.03 s for the
        takes after it (4 spawned ranks at load ~5, the tiny and the bench/chaos.py model). A state
        whose keys or shapes differ from the seed's is planned through ``dcp.save`` all the same
        (``plan``). False, and nothing seeded, when the metadata lacks a piece's place in the state."""
        paths = metadata.planner_data or {}
        items: list[tuple[MetadataIndex, bool, tuple]] = []
        shapes: dict[MetadataIndex, tuple] = {}
        skeleton: dict[str, Any] = {}  # the state's keys, for the signature a state is held to
        for fqn, item in metadata.state_dict_metadata.items():
            if not paths.get(fqn):
                return False
            path = tuple(paths[fqn])
            _set_path(skeleton, path, None)
            if isinstance(item, BytesStorageMetadata):
                items.append((MetadataIndex(fqn), True, path))
                continue
            for chunk in item.chunks:
                index = MetadataIndex(fqn, chunk.offsets)
                items.append((index, False, path))
                shapes[index] = tuple(chunk.sizes)
        self._plan_as(metadata, _signature(skeleton), items, shapes)
        return True

    def take(self, state: dict[str, Any], *, step: int, rank: int, slot: int = 0) -> MemorySnapshot:
        """Plan and copy at once (on this thread)."""
        planned = self.plan(state, step=step, rank=rank, slot=slot)
        return planned.copy() if isinstance(planned, PlannedSnapshot) else planned

    def plan(self, state: dict[str, Any], *, step: int, rank: int, slot: int) -> PlannedSnapshot | MemorySnapshot:
        """On the training thread: the planned take into buffer set ``slot`` (copies left to
        ``PlannedSnapshot.copy``), or — the first take, or a state that changed — a complete snapshot
        taken now through ``dcp.save`` (fresh memory, not a buffer set)."""
        plain = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}
        signature = _signature(plain)
        if self._metadata is not None and signature == self._signature:
            planned = self._direct(plain, step, rank, slot)
            if planned is not None:
                return planned
        snap = take_snapshot(plain, step=step, rank=rank)
        paths = snap.metadata.planner_data or {}
        if all(index.fqn in paths for index in snap.blobs):
            self._plan_as(snap.metadata, signature,
                          [(i, isinstance(b, Deferred), tuple(paths[i.fqn])) for i, b in snap.blobs.items()],
                          {i: tuple(b.shape) for i, b in snap.blobs.items() if isinstance(b, torch.Tensor)})
        return snap

    def _plan_as(self, metadata: Metadata, signature: frozenset, items: list[tuple[MetadataIndex, bool, tuple]],
                 shapes: dict[MetadataIndex, tuple]) -> None:
        """Later takes of a state of ``signature`` copy ``items`` (shapes ``shapes``) straight into
        buffers laid out as ``metadata``: from a first ``dcp.save`` (``plan``) or a seed (``seed``)."""
        self._metadata, self._signature, self._items, self._shapes = metadata, signature, items, shapes
        self._buffers.clear()

    def _direct(self, plain: dict[str, Any], step: int, rank: int, slot: int) -> PlannedSnapshot | None:
        planned = PlannedSnapshot(step=step, rank=rank, metadata=self._metadata, slot=slot)
        buffers = self._buffers.setdefault(slot, {})
        for index, is_bytes, path in self._items:
            obj = plain
            for part in path:
                obj = obj[part]
            if is_bytes:
                planned.objects[index] = Deferred(copy.deepcopy(obj))
                continue
            local = find_state_dict_object({index.fqn: obj}, index).detach()
            if tuple(local.shape) != self._shapes[index]:
                return None
            buf = buffers.get(index)
            if buf is None or buf.dtype != local.dtype:
                buf = buffers[index] = torch.empty(local.shape, dtype=local.dtype,
                                                   pin_memory=local.is_cuda)
            planned.pieces.append((index, local, buf))
        if any(src.is_cuda for _, src, _ in planned.pieces):
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            planned.stream = self._stream
            planned.ready = torch.cuda.Event()
            planned.ready.record()
        return planned


def _signature(plain: dict[str, Any]) -> frozenset:
    """The keys of the state's sections, two levels down (what DCP's plan depends on besides shapes),
    in any order (the official state dicts and the fast ones order them differently)."""
    out = set()
    for key, value in plain.items():
        if isinstance(value, dict):
            out.add((key, frozenset((k, frozenset(v) if isinstance(v, dict) else None) for k, v in value.items())))
        else:
            out.add((key, None))
    return frozenset(out)
