"""What a rank puts into a checkpoint and how it is put back (worker side; torch).

A rank may hold several pipeline stages (``model_parts``), each with its own optimizer. Stages keep
the full model's FQNs (``layers.3.attention.wq.weight``), so the parts' state dicts are disjoint and
are merged into one flat dict per kind: ``{"model": {...}, "optim": {...}}``. The helpers from
``torch.distributed.checkpoint.state_dict`` produce DTensor shards for FSDP2/TP parameters, which
DCP saves as global-tensor pieces and reshards into whatever mesh loads them.

``flatten_optimizer_state_dict=True`` is required, not cosmetic: without it every pipeline stage
saves its ``param_groups`` under the same keys and a PP-layout load fails with ``KeyError: 'betas'``
(docs/design.md, "Pipeline layouts need flatten_optimizer_state_dict=True"). Flattened, every optimizer
entry is keyed by parameter FQN (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``), so any regrouping of parts loads.

The small ``"extra"`` state (step, data cursor, LR scheduler, RNG) must be identical on every rank:
DCP deduplicates equal keys across ranks and stores one copy. Ints, floats and lists are saved by
DCP as pickled byte items, the RNG state as a plain (replicated) tensor; the reader rebuilds the
template for them from the checkpoint's own metadata, so loading needs no knowledge of their shape.

Saving is on the training step's critical path (the async stall), and the helpers re-derive every
parameter's FQN on each call: ~1.5 ms each for model and optimizer on a 3-layer GPT, most of a 4 ms
stall (measured, bench/checkpoint_stall.py). So a ``ModelState``/``OptimizerState`` kept across saves
builds the same flat dict directly (``module.state_dict()``, ``optimizer.state``) once its first
official result has shown that the shortcut yields exactly the same keys and the very same tensor
objects; any difference, or an optimizer without state yet, keeps the official helpers. Loading
always goes through the helpers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(frozen=True)
class ResumePoint:
    """Where training continues after a load: the next step is ``step + 1``."""

    step: int
    data_cursor: int
    loss_scale: dict | None = None  # fp16's dynamic loss scale state, when the run had one


class ModelState:
    """DCP ``Stateful`` over the model parts a rank holds: one flat dict of all their parameters."""

    def __init__(self, model_parts: nn.Module | Sequence[nn.Module]) -> None:
        self.parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
        self._keys: list[set[str]] | None = None
        self.shortcut: bool | None = None
        """None until the first save; then whether later saves take ``module.state_dict()``."""

    def state_dict(self) -> dict[str, Any]:
        if self.shortcut:
            return _merge([part.state_dict() for part in self.parts], "model")
        dicts = [get_model_state_dict(part, options=STATE_DICT_OPTIONS) for part in self.parts]
        self._keys = [set(d) for d in dicts]
        if self.shortcut is None:
            self.shortcut = all(_same_entries(d, part.state_dict()) for d, part in zip(dicts, self.parts))
        return _merge(dicts, "model")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        keys = self._keys if self._keys is not None else [set(d) for d in self._part_dicts()]
        for part, part_keys in zip(self.parts, keys, strict=True):
            set_model_state_dict(part, {k: state_dict[k] for k in part_keys}, options=STATE_DICT_OPTIONS)

    def _part_dicts(self) -> list[dict[str, Any]]:
        return [get_model_state_dict(part, options=STATE_DICT_OPTIONS) for part in self.parts]


class OptimizerState:
    """DCP ``Stateful`` over one optimizer per model part, flattened and merged by parameter FQN."""

    def __init__(self, model_parts: nn.Module | Sequence[nn.Module],
                 optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> None:
        self.parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
        self.optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        if len(self.parts) != len(self.optimizers):
            raise ValueError(f"need one optimizer per model part, got {len(self.optimizers)} "
                             f"optimizers for {len(self.parts)} parts")
        self._keys: list[set[str]] | None = None
        self.shortcut: bool | None = None
        """None until a save found state for every parameter; then whether later saves build the
        flat dict from ``optimizer.state`` directly."""
        self._fqns: list[dict[torch.Tensor, str]] = []

    def _part_dicts(self) -> list[dict[str, Any]]:
        # For an optimizer that never stepped this creates its state (zeros) so there is a template.
        pairs = zip(self.parts, self.optimizers, strict=True)
        return [get_optimizer_state_dict(p, o, options=STATE_DICT_OPTIONS) for p, o in pairs]

    def state_dict(self) -> dict[str, Any]:
        if self.shortcut:
            fast = [_flat_optimizer_state(o, fqns) for o, fqns in zip(self.optimizers, self._fqns)]
            if all(d is not None for d in fast):
                return _merge(fast, "optimizer")
        dicts = self._part_dicts()
        self._keys = [set(d) for d in dicts]
        if self.shortcut is None:
            self._fqns = [{p: _clean_fqn(n) for n, p in part.named_parameters()} for part in self.parts]
            fast = [_flat_optimizer_state(o, fqns) for o, fqns in zip(self.optimizers, self._fqns)]
            if all(d is not None for d in fast):  # else: no state yet; decide at a later save
                self.shortcut = all(_same_entries(d, f) for d, f in zip(dicts, fast))
        return _merge(dicts, "optimizer")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        keys = self._keys if self._keys is not None else [set(d) for d in self._part_dicts()]
        for part, opt, part_keys in zip(self.parts, self.optimizers, keys, strict=True):
            set_optimizer_state_dict(part, opt, {k: state_dict[k] for k in part_keys}, options=STATE_DICT_OPTIONS)


def capture_extras(step: int, data_cursor: int, lr_scheduler: Any | None = None, *, rng: bool = True,
                   loss_scale: dict | None = None) -> dict[str, Any]:
    """The small state saved under ``"extra"``; must be the same on every rank.

    Args:
        step: optimizer steps completed.
        data_cursor: samples of the global order consumed (``step * global_batch_size``).
        lr_scheduler: an LR scheduler (anything with ``state_dict()``); with several parts, pass
            one of them: they follow the same schedule.
        rng: also save the torch CPU (and current CUDA device) RNG state.
        loss_scale: fp16's loss scale state (``workers.loss_scale``), the same on every rank.
    """
    extra: dict[str, Any] = {"step": int(step), "data_cursor": int(data_cursor)}
    if loss_scale is not None:
        extra["loss_scale"] = dict(loss_scale)
    if lr_scheduler is not None:
        extra["lr_scheduler"] = lr_scheduler.state_dict()
    if rng:
        extra["rng"] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            extra["rng"]["cuda"] = torch.cuda.get_rng_state()
    return extra


def restore_extras(extra: dict[str, Any], lr_schedulers: Any | Sequence[Any] | None = (), *,
                   rng: bool = True) -> ResumePoint:
    """Apply loaded extras: scheduler state into every given scheduler, RNG state if present.

    Returns:
        The step and data cursor to resume from.
    """
    if lr_schedulers is None:
        lr_schedulers = ()
    schedulers: list[Any] = list(lr_schedulers) if isinstance(lr_schedulers, (list, tuple)) else [lr_schedulers]
    if schedulers and "lr_scheduler" in extra:
        for sched in schedulers:
            sched.load_state_dict(extra["lr_scheduler"])
    rng_state = extra.get("rng") or {}
    if rng and "cpu" in rng_state:
        torch.set_rng_state(rng_state["cpu"].to(torch.uint8))
    if rng and "cuda" in rng_state and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng_state["cuda"].to(torch.uint8))
    scale = extra.get("loss_scale")
    return ResumePoint(step=int(extra["step"]), data_cursor=int(extra["data_cursor"]),
                       loss_scale=dict(scale) if scale else None)


def training_state(model_parts: nn.Module | Sequence[nn.Module],
                   optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], *,
                   step: int, data_cursor: int, lr_scheduler: Any | None = None, rng: bool = True) -> dict[str, Any]:
    """Everything one rank saves: ``{"model": ModelState, "optim": OptimizerState, "extra": {...}}``.

    Pass it to :meth:`checkpoints.writer.AsyncCheckpointWriter.save`; DCP calls the ``Stateful``
    objects while staging, so the tensors are captured at that moment. A rank that saves repeatedly
    keeps a :class:`TrainingState` instead, so that later saves take the verified shortcut.
    """
    return TrainingState(model_parts, optimizers).snapshot(step=step, data_cursor=data_cursor,
                                                           lr_scheduler=lr_scheduler, rng=rng)


class TrainingState:
    """The ``Stateful`` objects one rank keeps across the saves of one process-group generation."""

    def __init__(self, model_parts: nn.Module | Sequence[nn.Module],
                 optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> None:
        self.model = ModelState(model_parts)
        self.optim = OptimizerState(model_parts, optimizers)

    def snapshot(self, *, step: int, data_cursor: int, lr_scheduler: Any | None = None,
                 rng: bool = True, loss_scale: dict | None = None) -> dict[str, Any]:
        """What :func:`training_state` returns, with this object's model and optimizer state."""
        return {"model": self.model, "optim": self.optim,
                "extra": capture_extras(step, data_cursor, lr_scheduler, rng=rng, loss_scale=loss_scale)}


def _merge(dicts: list[dict[str, Any]], what: str) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for d in dicts:
        clash = merged.keys() & d.keys()
        if clash:
            raise ValueError(f"model parts share {what} keys {sorted(clash)[:4]}: each stage must keep "
                             "distinct full-model FQNs")
        merged.update(d)
    return merged


# Wrappers the state-dict helpers strip from FQNs (activation checkpointing, torch.compile).
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _clean_fqn(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _flat_optimizer_state(opt: torch.optim.Optimizer, fqns: dict[torch.Tensor, str]) -> dict[str, Any] | None:
    """``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` for one optimizer whose
    parameters all have state, built from ``opt.state``; None when some parameter has none yet."""
    out: dict[str, Any] = {}
    for group in opt.param_groups:
        hyper = [(k, v) for k, v in group.items() if k != "params"]
        for param in group["params"]:
            state, fqn = opt.state.get(param), fqns.get(param)
            if not state or fqn is None or any(isinstance(v, dict) for v in state.values()):
                return None
            for k, v in state.items():
                out[f"state.{fqn}.{k}"] = v
            for k, v in hyper:
                out[f"param_groups.{fqn}.{k}"] = v
    return out


def _same_entries(official: dict[str, Any], shortcut: dict[str, Any]) -> bool:
    """Same keys, the same tensor objects (or views of the same memory), equal other values."""
    if official.keys() != shortcut.keys():
        return False
    for key, a in official.items():
        b = shortcut[key]
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if not (a is b or _same_tensor(a, b)):
                return False
        elif a != b:
            return False
    return True


def _same_tensor(a: Any, b: Any) -> bool:
    from torch.distributed.tensor import DTensor

    if type(a) is not type(b) or not isinstance(a, torch.Tensor):
        return False
    if isinstance(a, DTensor):
        if a.placements != b.placements or a.device_mesh != b.device_mesh:
            return False
        a, b = a.to_local(), b.to_local()
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)

