"""Loading a snapshot whose layout is this rank's own: its pieces copied into place, no DCP (worker
side; torch, no Ray; docs/design.md, In-memory snapshots).

DCP's load (``checkpoints.reader.load_training_state``) plans every read collectively, and before it
can read the optimizer's state it makes that state: ``get_optimizer_state_dict`` on a fresh optimizer
runs a zero-lr ``optimizer.step()`` (``_init_optim_state``), through DTensor's sharding propagation
for every foreach op, uncached on a new generation's mesh: 0.85 s of a 1.34 s snapshot load under
cProfile (bench/chaos.py's model), 2.0 s of 2.65 s on the tiny dp=4 model at load ~5.

Often there is nothing to reshard: a spare promoted into a lost rank's mesh slot, the survivors of a
rebuild at the same mesh, every rank of a replicated axis (ZeRO-0, HSDP's replicas) after any dp
change. Then each of this rank's tensors is exactly one chunk of one old rank's snapshot — the same
fully qualified name, global shape, dtype, offsets and sizes — and the load is a copy. ``plan_direct``
checks that against one old rank's snapshot metadata, from the rank's own state (the model's
state-dict keys and each optimizer parameter's name, as ``checkpoints.state`` saves them), and lists
the pieces to read; ``DirectPlan.install`` copies them into the parameters and gives the optimizers
their state through ``Optimizer.load_state_dict`` (the call DCP's ``set_optimizer_state_dict`` ends
in, with the same values: the state tensors as DTensors of their parameter's layout, the step as
saved, the param groups' hyperparameters from each group's first parameter, as DCP unflattens them).
Anything else — another shape, dtype or chunk, a state entry that is neither a tensor of its
parameter's shape, a scalar nor an object, a parameter under two names — returns None, and the
caller loads through DCP. tests/distributed/test_direct_load.py holds the two equal, bit for bit.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor

from checkpoints.reader import EXTRA, _set_path
from checkpoints.state import ResumePoint, _clean_fqn, restore_extras

_OPTIM_STATE = "optim.state."
_OPTIM_GROUPS = "optim.param_groups."


@dataclass
class _Pieces:
    """One old rank's snapshot metadata, indexed for the checks (chunk sizes by fqn and offsets)."""

    tensors: dict[str, TensorStorageMetadata]
    chunks: dict[str, dict[tuple, tuple]]
    objects: set[str]
    states: dict[str, dict[str, Any]]  # optimizer parameter fqn -> state name -> its metadata
    extras: list[tuple[str, tuple]]  # (fqn, path in the state) of the "extra" items

    @classmethod
    def of(cls, metadata: Metadata) -> _Pieces:
        tensors, chunks, objects, states = {}, {}, set(), {}
        for fqn, item in metadata.state_dict_metadata.items():
            if isinstance(item, BytesStorageMetadata):
                objects.add(fqn)
            else:
                tensors[fqn] = item
                chunks[fqn] = {tuple(c.offsets): tuple(c.sizes) for c in item.chunks}
            if fqn.startswith(_OPTIM_STATE):
                param, _, name = fqn[len(_OPTIM_STATE):].rpartition(".")
                states.setdefault(param, {})[name] = item
        paths = metadata.planner_data or {}
        extras = [(fqn, tuple(paths[fqn])) for fqn in metadata.state_dict_metadata
                  if fqn in paths and paths[fqn] and paths[fqn][0] == EXTRA]
        return cls(tensors, chunks, objects, states, extras)

    def piece(self, fqn: str, target: torch.Tensor) -> MetadataIndex | None | bool:
        """The index of the one chunk that is ``target``'s local piece; True when that piece is empty
        (nothing to copy); None when the snapshot does not hold it as one chunk."""
        md = self.tensors.get(fqn)
        if md is None or tuple(md.size) != tuple(target.shape) or md.properties.dtype != target.dtype:
            return None
        chunks = target.__create_chunk_list__() if isinstance(target, DTensor) else None
        if chunks is not None and len(chunks) != 1:
            return None
        offsets = tuple(chunks[0].offsets) if chunks else (0,) * target.dim()
        sizes = tuple(chunks[0].sizes) if chunks else tuple(target.shape)
        if 0 in sizes:
            return True
        if self.chunks[fqn].get(offsets) != sizes:
            return None
        return MetadataIndex(fqn, offsets)


@dataclass
class _OptimPlan:
    """One optimizer's state as pieces: per parameter (in param-group order) its entries, per group
    the hyperparameters' byte items."""

    optimizer: torch.optim.Optimizer
    params: list[tuple[torch.Tensor, list[tuple[str, str, Any]]]] = field(default_factory=list)
    groups: list[dict[str, MetadataIndex]] = field(default_factory=list)


@dataclass
class DirectPlan:
    """What one rank copies from one old rank's snapshot (``owner``) to load it in place."""

    owner: int
    metadata: Metadata  # the old rank's snapshot metadata
    model: list[tuple[MetadataIndex, torch.Tensor]] = field(default_factory=list)  # piece -> local target
    optims: list[_OptimPlan] = field(default_factory=list)
    extras: list[tuple[MetadataIndex, tuple]] = field(default_factory=list)

    def indices(self) -> list[MetadataIndex]:
        """Every piece to read, each once."""
        wanted = [index for index, _ in self.model] + [index for index, _ in self.extras]
        for plan in self.optims:
            wanted += [index for _, entries in plan.params for _, kind, index in entries if kind != "empty"]
            wanted += [index for hyper in plan.groups for index in hyper.values()]
        return list(dict.fromkeys(wanted))

    def requests(self) -> list[tuple]:
        """The pieces as ``MemorySnapshot.pieces`` requests: (index, offsets, lengths), whole chunks."""
        out = []
        for index in self.indices():
            item = self.metadata.state_dict_metadata[index.fqn]
            if isinstance(item, BytesStorageMetadata):
                out.append((index, (), ()))
                continue
            sizes = next(tuple(c.sizes) for c in item.chunks if tuple(c.offsets) == tuple(index.offset))
            out.append((index, tuple(index.offset), sizes))
        return out

    def install(self, pieces: dict[MetadataIndex, Any]) -> ResumePoint:
        """Copy ``pieces`` (index -> tensor, or bytes for an object) into the model and the optimizers;
        the step and data cursor the snapshot continues from."""
        objects = _Objects(pieces)
        with torch.no_grad():
            for index, target in self.model:
                target.copy_(pieces[index])
            for plan in self.optims:
                _install_optimizer(plan, pieces, objects)
        extra: dict[str, Any] = {}
        for index, path in self.extras:
            _set_path(extra, path, objects.get(index))
        return restore_extras(extra.get(EXTRA, {}), rng=False)


class _Objects:
    """Byte items as DCP's ``SafeLoadPlanner`` loads them (``torch.load``, weights only), each once."""

    def __init__(self, pieces: dict[MetadataIndex, Any]) -> None:
        self.pieces, self._loaded = pieces, {}

    def get(self, index: MetadataIndex) -> Any:
        if index not in self._loaded:
            self._loaded[index] = torch.load(io.BytesIO(_as_bytes(self.pieces[index])), weights_only=True)
        return self._loaded[index]


def _as_bytes(blob: Any) -> bytes:
    return blob.to_bytes() if hasattr(blob, "to_bytes") else bytes(blob)


def plan_direct(model_parts: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                metadata: Metadata, owner: int) -> DirectPlan | None:
    """The in-place load of old rank ``owner``'s snapshot (``metadata``) into this rank's
    ``model_parts`` and their ``optimizers`` (one per part), or None when some tensor of this rank is
    not exactly one of its chunks (see the module docstring)."""
    pieces = _Pieces.of(metadata)
    plan = DirectPlan(owner, metadata)
    model = _model_entries(model_parts)
    if {f"model.{key}" for key in model} != {fqn for fqn in pieces.tensors if fqn.startswith("model.")}:
        return None  # not the old rank's stages (another pipeline position), or other names
    for key, value in model.items():
        index = pieces.piece(f"model.{key}", value)
        if index is None:
            return None
        if index is not True:
            plan.model.append((index, value.to_local() if isinstance(value, DTensor) else value))
    for part, optimizer in zip(model_parts, optimizers, strict=True):
        optim_plan = _plan_optimizer(part, optimizer, pieces)
        if optim_plan is None:
            return None
        plan.optims.append(optim_plan)
    plan.extras = [(MetadataIndex(fqn), path) for fqn, path in pieces.extras]
    if any(index.fqn not in pieces.objects for index, _ in plan.extras):
        return None  # a tensor among the extras (an RNG state): not saved by snapshots
    return plan


def _model_entries(model_parts: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's model state by the names checkpoints save it under: ``module.state_dict()`` with
    the wrappers' prefixes dropped (``checkpoints.state._clean_fqn``), what ``get_model_state_dict``
    gives without its checks (0.07 s of a 0.1 s plan under cProfile). The caller holds the names to
    the snapshot's, which the official helper made."""
    out: dict[str, torch.Tensor] = {}
    for part in model_parts:
        for key, value in part.state_dict().items():
            out[_clean_fqn(key)] = value
    return out


def _plan_optimizer(part: nn.Module, optimizer: torch.optim.Optimizer, pieces: _Pieces) -> _OptimPlan | None:
    """One optimizer's entries (see ``_OptimPlan``), or None when one is not a plain copy."""
    names: dict[int, list[str]] = {}
    for name, param in part.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(_clean_fqn(name))
    plan = _OptimPlan(optimizer)
    for group in optimizer.param_groups:
        fqns = [names.get(id(p), []) for p in group["params"]]
        if not fqns or any(len(f) != 1 for f in fqns):
            return None  # a parameter under two names (tied in one module) or none: DCP's rules
        for param, (fqn,) in zip(group["params"], fqns, strict=True):
            entries = _state_entries(param, fqn, pieces) if param.requires_grad else []
            if entries is None:
                return None
            plan.params.append((param, entries))
        hyper = {k: MetadataIndex(f"{_OPTIM_GROUPS}{fqns[0][0]}.{k}") for k in group if k != "params"}
        if any(index.fqn not in pieces.objects for index in hyper.values()):
            return None
        plan.groups.append(hyper)
    return plan


def _state_entries(param: torch.Tensor, fqn: str, pieces: _Pieces) -> list[tuple[str, str, Any]] | None:
    """A parameter's optimizer state as (name, kind, piece): "param" a tensor of the parameter's
    layout (its piece; "empty" when that is empty here), "tensor" a whole one (the step), "object"."""
    entries = []
    for name, item in pieces.states.get(fqn, {}).items():
        key = f"{_OPTIM_STATE}{fqn}.{name}"
        if "." in name:
            return None  # a nested state entry: DCP rebuilds those
        if isinstance(item, BytesStorageMetadata):
            entries.append((name, "object", MetadataIndex(key)))
        elif tuple(item.size) == tuple(param.shape):
            index = pieces.piece(key, param)  # the parameter's shape, dtype and local chunk
            if index is None:
                return None
            entries.append((name, "empty", item) if index is True else (name, "param", index))
        elif len(item.size) == 0 and () in pieces.chunks[key]:
            entries.append((name, "tensor", MetadataIndex(key, ())))
        else:
            return None
    return entries


def _install_optimizer(plan: _OptimPlan, pieces: dict[MetadataIndex, Any], objects: _Objects) -> None:
    """``plan.optimizer.load_state_dict`` with the state read from ``pieces``: parameters numbered in
    param-group order, as ``Optimizer.load_state_dict`` pairs them with its own."""
    state: dict[int, dict[str, Any]] = {}
    for number, (param, entries) in enumerate(plan.params):
        values = {}
        for name, kind, piece in entries:
            if kind == "object":
                values[name] = objects.get(piece)
            elif kind == "tensor":
                values[name] = pieces[piece].detach().clone()
            else:
                values[name] = _like(param, None if kind == "empty" else pieces[piece])
        if values:
            state[number] = values
    groups, numbered = [], iter(range(len(plan.params)))
    for group, hyper in zip(plan.optimizer.param_groups, plan.groups, strict=True):
        loaded = {k: objects.get(index) for k, index in hyper.items()}
        groups.append({**loaded, "params": [next(numbered) for _ in group["params"]]})
    plan.optimizer.load_state_dict({"state": state, "param_groups": groups})


def _like(param: torch.Tensor, piece: torch.Tensor | None) -> torch.Tensor:
    """A new tensor of ``param``'s layout (a DTensor on its mesh and placements) holding ``piece``,
    its local part (None: an empty local part), as DCP fills ``zeros_like(param)``."""
    local_param = param.to_local() if isinstance(param, DTensor) else param
    local = torch.empty(local_param.shape, dtype=param.dtype, device=local_param.device)
    if piece is not None:
        local.copy_(piece)
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())
