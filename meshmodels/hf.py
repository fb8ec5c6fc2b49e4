"""Hugging Face model directories, read without torch: ``config.json`` and safetensors headers.

``read_config`` is what ``model.from_hf`` shapes a model from. ``check_weights`` validates a
``checkpoint.init_from`` directory against the tensors a family expects *before* anything is loaded,
because torch's ``HuggingFaceStorageReader`` trusts the directory: it loads every ``*.safetensors``
file it finds and ignores ``model.safetensors.index.json``, so a stray copy of a tensor in another
file is loaded silently and may win. Here the index's ``weight_map`` must name exactly the files
present, each file must hold exactly the tensors the map assigns to it, and every expected tensor
must be there with the expected shape and a floating dtype; anything else is one ``ConfigError``
naming the file or tensor (exit 2). A safetensors header is 8 bytes of little-endian length and
then JSON, so reading it needs no torch and no tensor data.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from meshspeak.schema import ConfigError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SUFFIX = ".safetensors"
FLOAT_DTYPES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8}
MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


def read_config(directory: str, key: str = "model.from_hf") -> tuple[dict[str, Any], str]:
    """``directory/config.json`` as a dict, and its path (for messages).

    Raises:
        ConfigError: (key ``key``) no such file, or not a JSON object.
    """
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise ConfigError(key, f"{key}: {path} not found: point {key} at a Hugging Face model directory "
                               "(the one holding config.json and *.safetensors)")
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(key, f"{key}: cannot read {path} ({exc}): fix or replace the file") from None
    if not isinstance(config, dict):
        raise ConfigError(key, f"{key}: {path} is not a JSON object: fix or replace the file")
    return config, path


def read_header(path: str) -> dict[str, dict[str, Any]]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} of one safetensors file (no tensor data read)."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", raw)
        if size > MAX_HEADER:
            raise ValueError(f"header length {size} is implausible")
        header = json.loads(fh.read(size))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header.pop("__metadata__", None)
    return header


@dataclass
class WeightsInfo:
    """What ``check_weights`` found: files, tensor -> (file, dtype, shape), total bytes."""

    files: list[str]
    tensors: dict[str, tuple[str, str, tuple[int, ...]]] = field(default_factory=dict)
    total_bytes: int = 0


def check_weights(
    directory: str,
    expected: dict[str, tuple[int, ...]],
    *,
    ignorable: frozenset[str] | set[str] = frozenset(),
    key: str = "checkpoint.init_from",
) -> WeightsInfo:
    """Validate a Hugging Face weights directory against ``expected`` (HF name -> global shape).

    ``ignorable`` names may be present without being expected (e.g. ``lm_head.weight`` of a model
    whose head is tied to its embedding); any other unexpected tensor is refused.

    Raises:
        ConfigError: (key ``key``) naming the file or tensor, and the fix.
    """
    if not os.path.isdir(directory):
        raise ConfigError(key, f"{key}: {directory} is not a directory: point it at a Hugging Face model "
                               "directory holding *.safetensors")
    present = sorted(f for f in os.listdir(directory) if f.endswith(SUFFIX))
    assigned = _tensors_by_file(directory, present, key)
    info = WeightsInfo(files=present)
    for file in present:
        _read_file_tensors(info, directory, file, None if assigned is None else assigned[file], key)
    _check_against_model(info, directory, expected, ignorable, key)
    return info


def _tensors_by_file(directory: str, present: list[str], key: str) -> dict[str, set[str]] | None:
    """The tensor names the index maps to each file (None: a single file and no index), after checking
    that the index and the ``*.safetensors`` files in ``directory`` name the same files."""
    index_path = os.path.join(directory, INDEX)
    weight_map = _read_weight_map(index_path, key) if os.path.exists(index_path) else None
    if weight_map is None:
        if not present:
            raise ConfigError(key, f"{key}: no *.safetensors file in {directory}: export the model with "
                                   "safe_serialization (save_pretrained does by default)")
        if len(present) > 1:
            raise ConfigError(key, f"{key}: {len(present)} *.safetensors files in {directory} but no {INDEX}: "
                                   f"remove the extra files or add the index (files: {', '.join(present)})")
        return None
    assigned: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        assigned.setdefault(file, set()).add(name)
    for file in sorted(assigned):
        if file not in present:
            raise ConfigError(key, f"{key}: {INDEX} maps tensors to {file}, which is not in {directory}: "
                                   "copy the missing file or fix the index")
    for file in present:
        if file not in assigned:
            raise ConfigError(key, f"{key}: stray file {os.path.join(directory, file)}: {INDEX} does not "
                                   "name it, and the loader would read it too; move it out of the directory")
    return assigned


def _read_file_tensors(info: WeightsInfo, directory: str, file: str, indexed: set[str] | None, key: str) -> None:
    """Add the tensors of ``file``'s header to ``info``; ``indexed``: the names the index maps to this
    file (None: no index), which must be exactly the header's names."""
    path = os.path.join(directory, file)
    try:
        header = read_header(path)
    except (OSError, ValueError, struct.error) as exc:
        raise ConfigError(key, f"{key}: {path} is not a readable safetensors file ({exc}): replace it") from None
    for name, meta in header.items():
        if indexed is not None and name not in indexed:
            raise ConfigError(key, f"{key}: tensor {name!r} is in {path} but {INDEX} does not map it there; "
                                   "the loader would read it anyway: fix the index or the file")
        if name in info.tensors:
            raise ConfigError(key, f"{key}: tensor {name!r} is in both {info.tensors[name][0]} and {file}: "
                                   "keep one copy")
        info.tensors[name] = (file, meta.get("dtype", "?"), tuple(meta.get("shape", ())))
        info.total_bytes += int(meta.get("data_offsets", [0, 0])[1]) - int(meta.get("data_offsets", [0, 0])[0])
    if indexed is not None:
        absent = sorted(indexed - set(header))
        if absent:
            raise ConfigError(key, f"{key}: {INDEX} maps tensor {absent[0]!r} to {path}, which does not "
                                   "hold it: fix the index or re-export the model")


def _check_against_model(info: WeightsInfo, directory: str, expected: dict[str, tuple[int, ...]],
                         ignorable: frozenset[str] | set[str], key: str) -> None:
    """Every expected tensor present with its shape and a floating dtype; nothing else but ``ignorable``."""
    for name, shape in expected.items():
        if name not in info.tensors:
            raise ConfigError(key, f"{key}: tensor {name!r} is missing from {directory}: the model "
                                   "(model.from_hf config.json) expects it; use weights of the same architecture")
        file, dtype, got = info.tensors[name]
        if tuple(got) != tuple(shape):
            raise ConfigError(key, f"{key}: tensor {name!r} in {file} has shape {list(got)}, the model expects "
                                   f"{list(shape)}: the weights and config.json describe different models")
        if dtype not in FLOAT_DTYPES:
            raise ConfigError(key, f"{key}: tensor {name!r} in {file} has dtype {dtype}: only floating point "
                                   f"weights ({', '.join(FLOAT_DTYPES)}) can be trained; use unquantized weights")
    for name in sorted(info.tensors):
        if name not in expected and name not in ignorable:
            raise ConfigError(key, f"{key}: unexpected tensor {name!r} in {info.tensors[name][0]}: the model "
                                   "has no such parameter; use weights of the architecture config.json describes")


def _read_weight_map(path: str, key: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as fh:
            index = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(key, f"{key}: cannot read {path} ({exc}): fix or remove it") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(key, f"{key}: {path} has no weight_map of tensor -> file: fix or remove it")
    return weight_map
