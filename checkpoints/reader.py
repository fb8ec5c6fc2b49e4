"""Load a checkpoint into the current mesh, whatever mesh saved it (worker side; torch).

The model must already be built, TP-parallelised and ``fully_shard``-ed on the *new* mesh: the
template state dict then holds DTensors with the new placements, and DCP reads exactly the slices
each rank needs from the saved pieces (resharding across dp/tp/pp changes, even or uneven shards).
Every rank of the new mesh calls :func:`load` collectively.

Before the first byte is read the template is checked against the checkpoint's metadata, so a
checkpoint from another model fails with :class:`CheckpointMismatchError` listing the keys, instead
of a DCP error from deep inside a collective.

Elastic rebuilds: clear DTensor's sharding caches before rebuilding the model on a re-formed world
(docs/design.md, Generations, and "DTensor caches outlive a re-form"); otherwise a same-size, permuted
world silently loads shards at the wrong offsets. That is the caller's rebuild step, not this module's.

Nothing in a checkpoint directory runs code (README, Trust boundary): DCP's readers unpickle
``.metadata`` with ``pickle.load`` and its default planner loads byte items (ints, lists, the
optimizer's hyperparameters) with ``torch.load(weights_only=False)``. The readers here read the
metadata through ``checkpoints.safe_pickle`` and the planner loads byte items with
``weights_only=True``; every load in the project goes through them.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from checkpoints.errors import CheckpointError, CheckpointMismatchError, summarize_failure
from checkpoints.safe_pickle import UnsafeCheckpointError, restricted_loads
from checkpoints.state import ModelState, OptimizerState, ResumePoint, restore_extras
from meshspeak.locations import local_path

EXTRA = "extra"


class _SafeMetadata:
    """``read_metadata`` of DCP's ``FileSystemReader`` (torch 2.13: ``filesystem.py``) with the pickle
    restricted (``checkpoints.safe_pickle``); the rest of the body is DCP's own."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = restricted_loads(metadata_file.read(), str(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadata, dcp.FileSystemReader):
    pass


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but byte items load with ``torch.load(weights_only=True)``
    (what we save there — ints, floats, strings, lists and dicts of them — all load so).

    Equal items are loaded once: the optimizer's hyperparameters are saved per parameter (every
    parameter's ``lr``, ``betas``...), and each ``torch.load`` costs ~0.5 ms: 431 of them were 0.2 s of
    a 1.0 s snapshot load under cProfile (tiny model, dp=4). Each item still gets its own object (a
    deep copy of the one loaded), as before."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loaded: dict[bytes, Any] = {}

    def load_bytes(self, read_item, value) -> None:  # DefaultLoadPlanner.load_bytes, weights_only=True
        raw = value.read()
        if raw not in self._loaded:
            self._loaded[raw] = torch.load(io.BytesIO(raw), weights_only=True)
        loaded = copy.deepcopy(self._loaded[raw])
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def dcp_reader(path: str) -> dcp.StorageReader:
    """DCP reader for a local/shared path or any fsspec URI (its metadata read safely)."""
    lp = local_path(path)
    if lp is not None:
        return SafeFileSystemReader(lp)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # not exported in 2.13

    class SafeFsspecReader(_SafeMetadata, FsspecReader):
        pass

    return SafeFsspecReader(path)


def read_metadata(path: str) -> Metadata:
    """DCP's global metadata of a checkpoint (tensor shapes, dtypes, where each piece is stored).

    Raises:
        UnsafeCheckpointError: ``.metadata`` imports something DCP metadata never does.
        CheckpointError: ``.metadata`` is missing or unreadable.
    """
    try:
        return dcp_reader(path).read_metadata()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(e.message, path) from None
    except Exception as e:
        raise CheckpointError(f"cannot read DCP .metadata ({summarize_failure(e)}); the checkpoint "
                              "is incomplete or damaged: resume from an older one", path) from e


def extras_template(metadata: Metadata, key: str = EXTRA) -> dict[str, Any]:
    """A template for the ``key`` subtree rebuilt from the checkpoint's own metadata.

    Tensors get empty tensors of the saved shape and dtype, byte items (ints, lists, dicts of the
    scheduler state) get None, which DCP replaces with the saved object. So loading the extras needs
    no knowledge of what the saving side put there.
    """
    mappings = metadata.planner_data
    if not isinstance(mappings, Mapping):
        raise CheckpointError("checkpoint metadata has no key paths (saved without flatten_state_dict?)")
    root: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        obj_path = mappings.get(fqn)
        if not obj_path or obj_path[0] != key:
            continue
        if isinstance(md, TensorStorageMetadata):
            value: Any = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            value = None
        _set_path(root, tuple(obj_path), value)
    return root.get(key, {})


def load(state_like: dict[str, Any], path: str, process_group: dist.ProcessGroup | None = None, *,
         reader: dcp.StorageReader | None = None) -> dict[str, Any]:
    """Load ``path`` into ``state_like`` in place (collective over ``process_group``).

    Args:
        state_like: top-level keys as saved (``"model"``, ``"optim"``...); values are dicts or DCP
            ``Stateful`` objects (their ``load_state_dict`` is called afterwards). ``"extra"`` may be
            omitted: it is then rebuilt from the checkpoint and returned.
        path: the ``step-N`` directory (local path or URI).
        process_group: group for DCP's collectives (default: the default group; ignored when
            torch.distributed is not initialised, e.g. consolidating in one process).
        reader: read through this DCP storage reader instead of ``path``'s (in-memory snapshots,
            ``checkpoints.memory.MemoryReader``); ``path`` then only names it in errors.

    Returns:
        The loaded ``"extra"`` dict (empty if the checkpoint has none).

    Raises:
        CheckpointMismatchError: template keys missing from the checkpoint, or shapes differ.
        CheckpointError: anything else, naming the path.
    """
    metadata = read_metadata(path) if reader is None else reader.read_metadata()
    plain = {k: (v.state_dict() if _is_stateful(v) else v) for k, v in state_like.items()}
    if EXTRA not in plain and any(m and m[0] == EXTRA for m in (metadata.planner_data or {}).values()):
        plain[EXTRA] = extras_template(metadata)
    _check_template(plain, metadata, path)
    distributed = dist.is_available() and dist.is_initialized()
    try:
        dcp.load(plain, storage_reader=reader or dcp_reader(path), planner=SafeLoadPlanner(),
                 process_group=process_group if distributed else None, no_dist=not distributed)
        for k, v in state_like.items():
            if _is_stateful(v):
                v.load_state_dict(plain[k])
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"loading the checkpoint failed: {summarize_failure(e)}", path) from e
    return plain.get(EXTRA, {})


def load_training_state(path: str, model_parts: nn.Module | Sequence[nn.Module],
                        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], *,
                        lr_schedulers: Any | Sequence[Any] = (), restore_rng: bool = True,
                        process_group: dist.ProcessGroup | None = None,
                        reader: dcp.StorageReader | None = None) -> ResumePoint:
    """Load model, optimizer and extras saved by :func:`checkpoints.state.training_state` (from
    ``path``, or through ``reader``: see :func:`load`).

    Returns:
        The step and data cursor to continue from.
    """
    state: dict[str, Any] = {"model": ModelState(model_parts)}
    if optimizers:
        state["optim"] = OptimizerState(model_parts, optimizers)
    extra = load(state, path, process_group, reader=reader)
    if "step" not in extra or "data_cursor" not in extra:
        raise CheckpointError("checkpoint has no extra.step / extra.data_cursor: not an elastimesh "
                              "training checkpoint", path)
    return restore_extras(extra, lr_schedulers, rng=restore_rng)


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _set_path(root: Any, path: tuple[Any, ...], value: Any) -> None:
    # Mirror of DCP's set_element: str keys make dicts, int keys make lists.
    node = root
    for here, nxt in zip(path[:-1], path[1:], strict=True):
        if isinstance(node, list):
            node.extend([None] * (here + 1 - len(node)))
            if node[here] is None:
                node[here] = [] if isinstance(nxt, int) else {}
            node = node[here]
        else:
            node = node.setdefault(here, [] if isinstance(nxt, int) else {})
    last = path[-1]
    if isinstance(node, list):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value


def _is_terminal(value: Any) -> bool:
    # DCP's rule (_traverse.traverse_state_dict): mappings are walked; a list is walked only when
    # it holds a tensor or a non-terminal container; anything else is one item.
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return not any(isinstance(v, torch.Tensor) or (isinstance(v, (Mapping, list)) and not _is_terminal(v))
                   for v in value)


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif not _is_terminal(value):
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}.{i}", out)
    else:
        out[prefix] = value


def _check_template(plain: dict[str, Any], metadata: Metadata, path: str) -> None:
    flat: dict[str, Any] = {}
    _flatten(plain, "", flat)
    saved = metadata.state_dict_metadata
    missing = sorted(k for k in flat if k not in saved)
    wrong: list[str] = []
    details: list[str] = []
    for key, value in flat.items():
        md = saved.get(key)
        if md is None or not isinstance(value, torch.Tensor):
            continue
        if not isinstance(md, TensorStorageMetadata):
            wrong.append(key)
            details.append(f"{key}: saved as an object, expected a tensor")
        elif tuple(md.size) != tuple(value.shape):  # DTensor.shape is the global shape
            wrong.append(key)
            details.append(f"{key}: saved {tuple(md.size)}, model has {tuple(value.shape)}")
    if missing or wrong:
        raise CheckpointMismatchError(missing + wrong, path, "; ".join(details[:4]))
