"""In-memory snapshots: one rank's DCP write captured as blobs, and a DCP reader over a set of them
(worker side; torch, no Ray).

A snapshot is exactly what this rank would write into a storage checkpoint (``checkpoints.state``'s
model / optimizer / extras), saved with ``dcp.save(..., no_dist=True)`` into a ``MemoryWriter``: DCP
plans the rank's own pieces — DTensor shards keep their offsets in the *global* tensor — and the
writer keeps each piece as a CPU tensor (a fresh copy: the snapshot must not change when training
updates the parameters) or bytes (the extras). No collective runs, so a snapshot can be taken while
a storage checkpoint writes on the checkpoint group's thread.

Recovery merges the snapshots of every rank of the old mesh (``merge``) into one DCP ``Metadata``
and loads it through ``MemoryReader`` with the same reshard-on-load path the storage checkpoints use
(``checkpoints.reader.load_training_state``), so a snapshot of any mesh loads into any other.
Hand-written only because DCP has no in-memory storage layer; planning and resharding stay DCP's.

Taking them at every step, into reused buffers and off the training thread, is
``checkpoints/snapshot_taker.py``'s. A non-tensor item (the optimizer's per-parameter
hyperparameters, the extras: hundreds of small objects) is kept as a deep copy and turned into the
bytes DCP expects (``torch.save``, as DCP's own planner does) by ``MemorySnapshot.serialize``, which
the actor runs on another thread before the snapshot leaves the process. Serialized at the take,
they cost 0.2 s of a 0.26 s take on a 20-layer MLP (cProfile); equal objects (every parameter's
``lr``, ``betas``...) share one ``torch.save`` (``Deferred.to_bytes``).

Replicated pieces (a tensor every dp replica holds in full, the extras every rank saves) appear once
per rank; ``merge`` keeps the first copy of each (fqn, offset), as DCP's save-plan dedup does.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import (
    StorageReader,
    StorageWriter,
    WriteResult,
)
from torch.futures import Future

from checkpoints.errors import CheckpointError

# A snapshot is a one-process DCP save on purpose (no collectives), which DCP warns about at every
# save: once per step per rank. Only that save's message is silenced.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized, "
                        "assuming the intent is to save in a single process")


class Deferred:
    """A non-tensor item not serialized yet (see the module docstring)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def to_bytes(self) -> bytes:
        key = pickle.dumps(self.obj, protocol=pickle.HIGHEST_PROTOCOL)
        out = _SAVED.get(key)
        if out is None:
            buf = io.BytesIO()
            torch.save(self.obj, buf)  # what DefaultSavePlanner.transform_object does for BYTE_IO items
            out = buf.getvalue()
            if len(_SAVED) >= 4096:
                _SAVED.clear()
            _SAVED[key] = out
        return out


# torch.save output of equal small objects, by their pickle: the hyperparameters repeat for every
# parameter and every step, so a snapshot's hundreds of items cost a few torch.save calls.
_SAVED: dict[bytes, bytes] = {}


@dataclass
class MemorySnapshot:
    """One rank's shard of step ``step``: DCP metadata of its own pieces and the pieces themselves."""

    step: int
    rank: int  # world rank in the generation that took it
    metadata: Metadata
    blobs: dict[MetadataIndex, Any] = field(default_factory=dict)  # CPU tensor or bytes

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() if isinstance(b, torch.Tensor) else
                   len(b) if isinstance(b, bytes) else 0 for b in self.blobs.values())

    def serialize(self) -> MemorySnapshot:
        """Turn the deferred non-tensor items into DCP's bytes (in place; idempotent)."""
        for key, blob in list(self.blobs.items()):
            if isinstance(blob, Deferred):
                self.blobs[key] = blob.to_bytes()
        return self

    # Pickled (by Ray) with every tensor as a flat uint8 numpy array: Ray then ships the bytes as
    # out-of-band buffers and a receiver maps them without a copy (torch's own pickling copies each
    # storage into the pickle stream and out again). A received snapshot's tensors may be read-only
    # views of Ray's object store: ``copy`` (what a holder keeps) and loading only read them.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["blobs"] = {k: _Packed.of(v) if isinstance(v, torch.Tensor) else v for k, v in self.blobs.items()}
        return state

    def __setstate__(self, state: dict) -> None:
        state["blobs"] = {k: v.tensor() if isinstance(v, _Packed) else v for k, v in state["blobs"].items()}
        self.__dict__.update(state)

    def copy(self, reuse: MemorySnapshot | None = None) -> MemorySnapshot:
        """A copy in this process's own memory (what a holder keeps of a peer's snapshot); the tensors
        of ``reuse`` (a copy this one replaces) are written over where they fit."""
        self.serialize()
        old = reuse.blobs if reuse is not None else {}
        blobs = {}
        for k, v in self.blobs.items():
            if not isinstance(v, torch.Tensor):
                blobs[k] = bytes(v)
                continue
            buf = old.get(k)
            fits = isinstance(buf, torch.Tensor) and buf.shape == v.shape and buf.dtype == v.dtype
            blobs[k] = buf.copy_(v) if fits else v.clone()
        return dataclasses.replace(self, blobs=blobs)

    def pieces(self, requests: Sequence[tuple]) -> list[Any]:
        """The slices a reader asked for: per (storage index, offsets, lengths) a tensor (a copy of
        just that slice) or, for a byte item, its bytes."""
        self.serialize()
        out = []
        for index, offsets, lengths in requests:
            piece = self.view(index, offsets, lengths)
            out.append(piece.contiguous().clone() if isinstance(piece, torch.Tensor) else piece)
        return out

    def view(self, index: MetadataIndex, offsets: tuple, lengths: tuple) -> Any:
        """One slice as it is held, not copied (its reader copies from it at once): a tensor's
        ``lengths`` from ``offsets`` (the blob itself when that is all of it), a byte item whole."""
        blob = self.blobs[index]
        if not isinstance(blob, torch.Tensor) or tuple(blob.shape) == tuple(lengths):
            return blob
        return narrow_tensor_by_index(blob, offsets, lengths)


class _Packed:
    """A tensor as (dtype, shape, its bytes as a uint8 numpy array), for pickling (see above)."""

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype: str, shape: tuple, data) -> None:
        self.dtype, self.shape, self.data = dtype, shape, data

    @classmethod
    def of(cls, t: torch.Tensor) -> _Packed:
        flat = t.detach().contiguous().reshape(-1)
        return cls(str(t.dtype).removeprefix("torch."), tuple(t.shape), flat.view(torch.uint8).numpy())

    def __getstate__(self):
        return (self.dtype, self.shape, self.data)

    def __setstate__(self, state) -> None:
        self.dtype, self.shape, self.data = state

    def tensor(self) -> torch.Tensor:
        with warnings.catch_warnings():  # a read-only view of Ray's object store: only ever read
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(self.data)
        return raw.view(getattr(torch, self.dtype)).reshape(self.shape)


def pack_piece(piece: Any) -> Any:
    """A piece to send to another process: tensors as ``_Packed`` (Ray ships the bytes out of band)."""
    return _Packed.of(piece) if isinstance(piece, torch.Tensor) else piece


def unpack_piece(piece: Any) -> Any:
    return piece.tensor() if isinstance(piece, _Packed) else piece


class MemoryWriter(StorageWriter):
    """A DCP storage layer that keeps the written pieces in memory (one rank, ``no_dist``)."""

    def __init__(self) -> None:
        self.blobs: dict[MetadataIndex, Any] = {}
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id=None) -> None:
        self.blobs = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                # DefaultSavePlanner's lookup; the bytes come later, off the training thread.
                blob: Any = Deferred(copy.deepcopy(planner.lookup_object(item.index)))
                size = 0
            else:
                # A copy of the local piece on the host (a DTensor's shard arrives as its local tensor).
                blob = planner.resolve_data(item).detach().to("cpu", copy=True).contiguous()
                size = blob.numel() * blob.element_size()
            self.blobs[item.index] = blob
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=item.index))
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.metadata = metadata

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


def take_snapshot(state: dict[str, Any], *, step: int, rank: int) -> MemorySnapshot:
    """DCP-save ``state`` (as ``AsyncCheckpointWriter.save`` would) into memory, no collectives."""
    writer = MemoryWriter()
    dcp.save(state, storage_writer=writer, no_dist=True)
    return MemorySnapshot(step=step, rank=rank, metadata=writer.metadata, blobs=writer.blobs)


def merge(snapshots: Sequence[MemorySnapshot]) -> Metadata:
    """One DCP ``Metadata`` over the pieces of every rank's snapshot of one step; each piece's
    ``storage_data`` entry says which snapshot holds it (its position in ``snapshots``).

    Raises:
        CheckpointError: the snapshots are of different steps, or a tensor's pieces do not cover it
            (a rank's snapshot is missing).
    """
    if not snapshots:
        raise CheckpointError("no snapshots to restore from")
    steps = {s.step for s in snapshots}
    if len(steps) != 1:
        raise CheckpointError(f"snapshots of different steps {sorted(steps)} cannot be merged")
    return merge_metadata([s.metadata for s in snapshots], steps.pop())


def merge_metadata(metadatas: Sequence[Metadata], step: int) -> Metadata:
    """``merge`` over the snapshots' metadata alone (the pieces may live in other processes)."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, int] = {}
    planner_data: dict[str, Any] = {}
    for which, md in enumerate(metadatas):
        planner_data.update(md.planner_data or {})
        for fqn, item in md.state_dict_metadata.items():
            if isinstance(item, BytesStorageMetadata):
                state.setdefault(fqn, item)
                storage.setdefault(MetadataIndex(fqn), which)
                continue
            have = state.setdefault(fqn, TensorStorageMetadata(item.properties, item.size, []))
            seen = {tuple(c.offsets) for c in have.chunks}
            for chunk in item.chunks:
                if tuple(chunk.offsets) not in seen:
                    have.chunks.append(chunk)
                    storage[MetadataIndex(fqn, chunk.offsets)] = which
    for fqn, item in state.items():
        if isinstance(item, TensorStorageMetadata):
            covered = sum(_volume(c.sizes) for c in item.chunks)
            if covered != _volume(item.size):
                raise CheckpointError(f"snapshots of step {step} do not cover {fqn} "
                                      f"({covered} of {_volume(item.size)} elements): a rank's snapshot is missing")
    return Metadata(state_dict_metadata=state, planner_data=planner_data, storage_data=storage)


class MemoryReader(StorageReader):
    """DCP reads from a set of snapshots of one step (every rank of the mesh that took them)."""

    def __init__(self, snapshots: Sequence[MemorySnapshot]) -> None:
        self.snapshots = list(snapshots)
        self.metadata = merge(self.snapshots)

    @property
    def step(self) -> int:
        return self.snapshots[0].step

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        where = self.metadata.storage_data
        for req in plan.items:
            blob = self.snapshots[where[req.storage_index]].blobs[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(blob.to_bytes() if isinstance(blob, Deferred) else blob))
                continue
            piece = narrow_tensor_by_index(blob, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            target.copy_(piece)
            planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


Fetch = Callable[[dict[int, list[tuple]]], dict[int, list[Any]]]


class RemoteReader(MemoryReader):
    """DCP reads a set of snapshots that live in other processes (one per rank of the mesh that took
    them): the metadata is merged from each one's (``metadatas``, in old-rank order), and each read
    asks ``fetch({old rank: [(storage index, offsets, lengths), ...]})`` for exactly the slices this
    rank's load plan needs — one request per old rank that holds any, all at once — so a new rank
    moves its own share of the state, not the old shards (``fetched_bytes`` counts it)."""

    def __init__(self, metadatas: Sequence[Metadata], step: int, fetch: Fetch) -> None:
        self.snapshots = []
        self._step = step
        self.metadata = merge_metadata(metadatas, step)
        self.fetch = fetch
        self.fetched_bytes = 0

    @property
    def step(self) -> int:
        return self._step

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        where = self.metadata.storage_data
        wanted: dict[int, list] = {}
        for req in plan.items:
            wanted.setdefault(where[req.storage_index], []).append(req)
        answers = self.fetch({owner: [(r.storage_index, tuple(r.storage_offsets), tuple(r.lengths)) for r in reqs]
                              for owner, reqs in wanted.items()})
        for owner, reqs in wanted.items():
            # Equal byte items (the optimizer's hyperparameters, one per parameter) are one object on
            # the provider (``Deferred.to_bytes``), and one answer is pickled once: each crosses once.
            sent: set[int] = set()
            for req, piece in zip(reqs, answers[owner], strict=True):
                if req.type == LoadItemType.BYTE_IO:
                    self.fetched_bytes += 0 if id(piece) in sent else len(piece)
                    sent.add(id(piece))
                    planner.load_bytes(req, io.BytesIO(piece))
                    continue
                self.fetched_bytes += piece.numel() * piece.element_size()
                target = planner.resolve_tensor(req).detach()
                target.copy_(piece)
                planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut


def _volume(sizes) -> int:
    out = 1
    for s in sizes:
        out *= int(s)
    return out
