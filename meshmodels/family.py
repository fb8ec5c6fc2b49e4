"""The ``ModelFamily`` protocol, the built-in families, and loading a user's family (``model.family``).

A family is everything the trainer needs to know about an architecture; nothing else in the trainer
names a model's modules (``workers/parallelize.py``, ``runtime.py``, ``pipeline.py`` and
``reference.py`` all go through it). What a family provides:

- its *shape* (a picklable object with at least ``n_layers``, ``d_model``, ``vocab_size`` and
  ``seq_len``) from the ``[model]`` section, or from a Hugging Face ``config.json`` (``model.from_hf``);
  ``check_mesh`` for what its shape needs from a mesh (e.g. tp dividing the heads); ``param_counts``
  for ``elastimesh plan`` and the stage split. These run on the driver: keep them free of torch.
- ``build_stage``: one pipeline stage, a contiguous range of layers, with the *global* parameter names
  in every split (``layers.3.attention.wq.weight``), so any pipeline layout loads any checkpoint. It
  is called under ``torch.device("meta")`` and must create parameters only (compute tables such as
  RoPE lazily, not as buffers); ``init_tensor`` then gives each parameter's full value as a function
  of (seed, name) alone, so every mesh builds exactly the weights one process builds
  (``meshmodels/build.py`` materialises only the local shard of it; an optional
  ``init_slice(shape, name, size, seed, slices)`` lets a family draw just that shard).
- ``tp_plan`` (tensor/sequence parallel styles by module path), ``blocks`` (the modules FSDP may
  shard as units), ``loss_sum`` (summed token loss of the last stage's output).
- the Hugging Face map: ``hf_tensors`` (HF name -> global shape), ``to_hf`` / ``from_hf`` (renaming
  only), ``hf_config`` (the ``config.json`` an export writes) and ``tied_parameters`` (names that
  the first and the last stage both hold, kept equal by summing their gradients).

Built-in: ``gpt`` (the default) and ``llama`` (the default with ``model.from_hf``). A user's family is
``model.family = "package.module:Name"`` (a class, instantiated with no arguments, or an instance);
subclassing ``FamilyBase`` gives the optional parts. The driver imports that module to plan the run.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Protocol

from meshspeak.schema import ConfigError

BUILTIN = {"gpt": "meshmodels.gpt:GPTFamily", "llama": "meshmodels.llama:LlamaFamily"}

# Every member a family must have (FamilyBase supplies the optional ones).
REQUIRED = (
    "name", "shape", "shape_from_hf", "check_mesh", "param_counts", "build_stage", "init_tensor",
    "tp_plan", "blocks", "loss_sum", "hf_tensors", "to_hf", "from_hf", "hf_config", "tied_parameters",
)  # fmt: skip


class ModelFamily(Protocol):
    name: str

    def shape(self, model_cfg: Any) -> Any: ...
    def shape_from_hf(self, config: dict[str, Any], model_cfg: Any, source: str) -> Any: ...
    def check_mesh(self, shape: Any, tp: int) -> None: ...
    def param_counts(self, shape: Any) -> dict[str, int]: ...
    def build_stage(self, shape: Any, layers: range, *, activation_checkpointing: bool = False) -> Any: ...
    def init_tensor(self, shape: Any, name: str, size: tuple[int, ...], seed: int) -> Any: ...
    def tp_plan(self, stage: Any) -> dict[str, Any]: ...
    def blocks(self, stage: Any) -> list[Any]: ...
    def loss_sum(self, logits: Any, targets: Any) -> Any: ...
    def hf_tensors(self, shape: Any) -> dict[str, tuple[int, ...]]: ...
    def to_hf(self, name: str) -> str: ...
    def from_hf(self, hf_name: str) -> str: ...
    def hf_config(self, shape: Any) -> dict[str, Any]: ...
    def tied_parameters(self, shape: Any) -> tuple[str, ...]: ...


class FamilyBase:
    """Defaults for the optional parts of a family: no Hugging Face support, nothing tied, every
    ``stage.layers`` entry a block, token cross-entropy loss, parameter counts from a meta build."""

    name = "custom"

    def shape_from_hf(self, config: dict[str, Any], model_cfg: Any, source: str) -> Any:
        raise ConfigError("model.from_hf", f"model.from_hf: model.family {self.name!r} cannot read a Hugging "
                                           "Face config.json: unset model.from_hf or use model.family = \"llama\"")

    def check_mesh(self, shape: Any, tp: int) -> None:
        for key, size in (("model.vocab_size", shape.vocab_size), ("model.n_heads", getattr(shape, "n_heads", tp))):
            if size % tp:
                raise ConfigError(key, f"{key}={size} is not divisible by mesh.tp={tp}: choose a tp that "
                                       f"divides {size}")

    def param_counts(self, shape: Any) -> dict[str, int]:
        import torch

        with torch.device("meta"):
            model = self.build_stage(shape, range(shape.n_layers))
        per = {n: p.numel() for n, p in model.named_parameters()}
        layer = sum(v for n, v in per.items() if n.startswith("layers.0."))
        embed = sum(v for n, v in per.items() if not n.startswith("layers.") and "emb" in n)
        total = sum(per.values())
        return {"embed": embed, "layer": layer, "head": total - embed - shape.n_layers * layer, "total": total}

    def blocks(self, stage: Any) -> list[Any]:
        return list(stage.layers.values())

    def loss_sum(self, logits: Any, targets: Any) -> Any:
        import torch.nn.functional as F

        # fp32 summed token cross-entropy; callers divide by the *global* token count.
        from meshmodels.gpt_model import upcast

        return F.cross_entropy(upcast(logits).reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")

    def hf_tensors(self, shape: Any) -> dict[str, tuple[int, ...]]:
        return {}

    def to_hf(self, name: str) -> str:
        raise NotImplementedError(f"model.family {self.name!r} has no Hugging Face name map")

    def from_hf(self, hf_name: str) -> str:
        raise NotImplementedError(f"model.family {self.name!r} has no Hugging Face name map")

    def hf_config(self, shape: Any) -> dict[str, Any]:
        raise NotImplementedError(f"model.family {self.name!r} cannot write a Hugging Face config.json")

    def tied_parameters(self, shape: Any) -> tuple[str, ...]:
        return ()


def family_ref(model_cfg: Any) -> str:
    """``model.family``, or the default: ``llama`` with ``model.from_hf``, else ``gpt``."""
    ref = getattr(model_cfg, "family", "") or ""
    if ref:
        return ref
    return "llama" if getattr(model_cfg, "from_hf", "") else "gpt"


@functools.lru_cache(maxsize=None)
def load_family(ref: str) -> ModelFamily:
    """The family named by ``ref`` ("gpt", "llama" or "package.module:Name").

    Raises:
        ConfigError: (key ``model.family``) it cannot be imported or lacks part of the protocol.
    """
    target = BUILTIN.get(ref, ref)
    module_name, sep, attr = target.partition(":")
    fix = 'use "gpt", "llama" or "package.module:Name" (a ModelFamily class or instance)'
    if not sep or not module_name or not attr:
        raise ConfigError("model.family", f"model.family = {ref!r} is not a family: {fix}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or anything the module raised while importing
        raise ConfigError("model.family", f"model.family = {ref!r}: cannot import {module_name!r} "
                                          f"({type(exc).__name__}: {exc}); put it on PYTHONPATH or {fix}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise ConfigError("model.family", f"model.family = {ref!r}: module {module_name!r} has no {attr!r}: {fix}")
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as exc:
            raise ConfigError("model.family", f"model.family = {ref!r}: {attr}() failed ({type(exc).__name__}: "
                                              f"{exc}); it must build with no arguments") from None
    missing = [m for m in REQUIRED if not hasattr(obj, m) or (m != "name" and not callable(getattr(obj, m)))]
    if missing:
        raise ConfigError("model.family", f"model.family = {ref!r} does not satisfy the ModelFamily protocol: "
                                          f"missing {', '.join(missing)} (subclass meshmodels.family.FamilyBase "
                                          "for the optional ones)")
    return obj


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A family and the shape it trains: what the driver plans with and ships to the ranks."""

    ref: str
    family: Any
    shape: Any


@functools.lru_cache(maxsize=64)
def resolve_model(model_cfg: Any) -> ResolvedModel:
    """The family and shape of a ``[model]`` section (reads ``model.from_hf``'s config.json).

    Raises:
        ConfigError: an unknown family, an unreadable or unsupported config.json (naming the field).
    """
    ref = family_ref(model_cfg)
    family = load_family(ref)
    if getattr(model_cfg, "from_hf", ""):
        from meshmodels.hf import read_config

        config, source = read_config(model_cfg.from_hf)
        shape = family.shape_from_hf(config, model_cfg, source)
    else:
        shape = family.shape(model_cfg)
    return ResolvedModel(ref, family, shape)


def runtime_family(spec: Any) -> tuple[Any, Any]:
    """(family, shape) on a rank: the shape the driver resolved, else resolved here from ``spec.model``."""
    ref = getattr(spec, "family", "") or family_ref(spec.model)
    shape = getattr(spec, "shape", None)
    if shape is None:
        resolved = resolve_model(spec.model)
        return resolved.family, resolved.shape
    return load_family(ref), shape


def check_init_from(cfg: Any) -> Any:
    """Validate ``checkpoint.init_from`` against the model before anything loads it (driver side).

    Returns:
        ``hf.WeightsInfo`` (files, tensors, bytes), or None when ``init_from`` is unset.

    Raises:
        ConfigError: naming ``checkpoint.init_from`` and the file or tensor at fault.
    """
    directory = cfg.checkpoint.init_from
    if not directory:
        return None
    from meshmodels.hf import check_weights

    resolved = resolve_model(cfg.model)
    expected = resolved.family.hf_tensors(resolved.shape)
    if not expected:
        raise ConfigError("checkpoint.init_from", f"checkpoint.init_from: model.family {resolved.family.name!r} has "
                                                  "no Hugging Face name map: set model.from_hf (the llama family) "
                                                  "or unset checkpoint.init_from")
    ignorable = getattr(resolved.family, "hf_ignorable", lambda shape: frozenset())(resolved.shape)
    return check_weights(directory, expected, ignorable=ignorable)
