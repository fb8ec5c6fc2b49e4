"""``elastimesh export CKPT_DIR --out DIR``: a committed checkpoint -> a Hugging Face model directory.

Works from any mesh's checkpoint (DCP stores global tensors, so the saving layout does not matter)
and from a URI ``checkpoint.dir``. Writes ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors``
and ``model.safetensors.index.json`` past ``max_shard_bytes``), ``config.json`` and
``generation_config.json``, so that ``transformers.AutoModelForCausalLM.from_pretrained(DIR)`` loads
it with no missing or unexpected keys.

The architecture comes from the checkpoint itself: every save records the family and, for a family
with a Hugging Face map, the ``config.json`` of the trained shape (``extra.model``, written by
``workers/runtime.py``), so the export needs neither the job config nor the original model directory.
A checkpoint directory is data, never code (README, Trust boundary): its pickled ``.metadata`` and
byte items are read through ``checkpoints.reader``'s restricted readers; a family recorded there is
imported only when it is a built-in one or the user names it (``--family pkg.mod:Name``); and the
tokenizer files are copied from the recorded data path only when that is a local path (a recorded
URI is never contacted: ``--tokenizer-from`` names where to copy them from).
Tensors are read one output file at a time (DCP loads only the keys asked for), so the exporter's
memory is one output file, not the model. DCP's own ``HuggingFaceStorageWriter`` would want the whole
state dict in one ``save``; ``safetensors.torch.save_file`` per output file avoids that. A tied
embedding is one tensor in the checkpoint and one in the export (no ``lm_head.weight``).
"""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace
from typing import Any

from checkpoints.errors import CheckpointError
from meshspeak.schema import ConfigError

DTYPES = ("float32", "bfloat16")
DEFAULT_MAX_SHARD_BYTES = 4 * 2**30  # transformers' default max_shard_size is "50GB"; 4 GiB suits object stores


def find_checkpoint(path: str) -> tuple[str, Any]:
    """(DCP directory, manifest) of the committed checkpoint at ``path``, or of the newest under a root
    (the DCP directory: the step directory, or the attempt subdirectory its manifest names).

    Raises:
        CheckpointError: neither a committed checkpoint nor a root holding one.
    """
    from checkpoints.catalog import check_checkpoint, dcp_path, latest_valid

    valid, reason, manifest = check_checkpoint(path)
    if valid:
        return dcp_path(path, manifest), manifest
    if manifest is None:
        info = latest_valid(path)
        if info is not None:
            return info.dcp_path, info.manifest
    raise CheckpointError(f"not a committed checkpoint ({reason}): pass a step-N directory holding "
                          "manifest.json, or a checkpoint.dir holding one (see `elastimesh ckpt list`)", path)


def model_of(step_dir: str, manifest: Any, family: str = "") -> tuple[Any, Any, dict[str, Any]]:
    """(family, shape, config.json dict) recorded in the checkpoint (``family``: see ``_recorded``)."""
    family_obj, shape, config, _ = _recorded(step_dir, manifest, family)
    return family_obj, shape, config


def _recorded(step_dir: str, manifest: Any, family: str = "") -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    """(family, shape, config.json dict, the whole record) from the checkpoint's ``extra.model``.

    ``family``: the ``--family`` the user named; without it only a built-in family is imported.
    """
    from checkpoints.reader import load
    from meshmodels.family import BUILTIN, load_family

    extra = load({}, step_dir)
    record = json.loads(extra.get("model") or "{}")
    family_ref = family or record.get("family") or manifest.model_config.get("family") or "gpt"
    if not family and family_ref not in BUILTIN and family_ref not in BUILTIN.values():
        raise CheckpointError(f"the checkpoint records model family {str(family_ref)[:200]!r}, which is code "
                              "outside elastimesh: export imports it only when you name it, e.g. "
                              f"--family {str(family_ref)[:200]}", step_dir)
    config = record.get("hf_config")
    if not config:
        raise CheckpointError(f"model family {family_ref!r} has no Hugging Face export (only families with an "
                              "HF name map, e.g. llama, export)", step_dir)
    family = load_family(family_ref)
    stub = SimpleNamespace(seq_len=int(manifest.model_config.get("seq_len", 2048)),
                           init_std=float(manifest.model_config.get("init_std", 0.02)))
    shape = family.shape_from_hf(config, stub, f"{step_dir} (recorded config)")
    return family, shape, config, record


def tokenizer_source(recorded: str, tokenizer_from: str = "") -> str:
    """Where to copy tokenizer files from: ``--tokenizer-from`` when given, else the data path the
    checkpoint records if it is a local path; a recorded URI is not contacted ("")."""
    from meshspeak.locations import local_path

    if tokenizer_from:
        return tokenizer_from
    return recorded if recorded and local_path(recorded) is not None else ""


def copy_tokenizer_files(data_path: str, out: str) -> list[str]:
    """Copy the tokenizer files ``data prepare`` put beside the shards (meshdata/tokenizer.py) into
    ``out``, so the exported directory loads with its tokenizer; returns the names copied. Byte-token
    data (the built-in corpus, shards without a tokenizer) has none: nothing is copied."""
    import fsspec

    from meshdata.tokenizer import CONFIG_FILES, TOKENIZER_FILE

    if not data_path or data_path == "builtin":
        return []
    fs, root = fsspec.core.url_to_fs(data_path)
    if not fs.exists(f"{root.rstrip('/')}/{TOKENIZER_FILE}"):
        return []
    copied = []
    for name in (TOKENIZER_FILE, *CONFIG_FILES):
        src = f"{root.rstrip('/')}/{name}"
        if fs.exists(src):
            with fs.open(src, "rb") as fh, open(os.path.join(out, name), "wb") as dst:
                shutil.copyfileobj(fh, dst)
            copied.append(name)
    return copied


def plan_files(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive tensors grouped into output files of at most ``max_shard_bytes`` (one tensor may exceed it)."""
    files: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if files[-1] and used + size > max_shard_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += size
    return files


def export_checkpoint(path: str, out: str, dtype: str = "float32",
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, *, family: str = "",
                      tokenizer_from: str = "") -> dict[str, Any]:
    """Export the checkpoint at ``path`` into the new directory ``out``; returns a summary.

    ``family`` (``--family``): the model family to import when the checkpoint records one that is
    not built in. ``tokenizer_from`` (``--tokenizer-from``): where the tokenizer files are (default:
    the recorded data path, if local). See the module docstring.

    Raises:
        CheckpointError: not a committed checkpoint, or one the family cannot export.
        ConfigError: ``out`` exists and is not empty, or a bad ``dtype``.
    """
    from checkpoints.safe_pickle import check_metadata_file

    step_dir, manifest = find_checkpoint(path)
    check_metadata_file(step_dir)  # a crafted .metadata is refused before torch is even imported

    import warnings

    import torch

    # DCP says once per load that it assumes one process: that is the point here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    _check_output_arguments(out, dtype)
    family_obj, shape, _, record = _recorded(step_dir, manifest, family)
    saved, expected = _matched_tensors(step_dir, family_obj, shape)
    target = torch.float32 if dtype == "float32" else torch.bfloat16
    sizes = {hf: _numel(expected[hf]) * target.itemsize for hf in expected}
    groups = plan_files(sizes, max_shard_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    recorded_data = str(record.get("data_path", ""))
    tmp = f"{out.rstrip('/')}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        weight_map = _write_weight_files(tmp, step_dir, family_obj, saved, dict(zip(names, groups, strict=True)),
                                         target)
        if len(groups) > 1:
            _write_json(os.path.join(tmp, "model.safetensors.index.json"),
                        {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})
        _write_model_configs(tmp, family_obj.hf_config(shape), dtype)
        tokenizer = copy_tokenizer_files(tokenizer_source(recorded_data, tokenizer_from), tmp)
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"step": manifest.step, "checkpoint": step_dir, "out": out, "files": names, "tensors": len(weight_map),
            "bytes": sum(sizes.values()), "dtype": dtype, "tokenizer_files": tokenizer,
            "tokenizer_skipped": recorded_data if not tokenizer_from and not tokenizer_source(recorded_data) else ""}


def _check_output_arguments(out: str, dtype: str) -> None:
    """Refuse a ``--dtype`` export cannot write and an ``--out`` that holds anything (never overwritten)."""
    if dtype not in DTYPES:
        raise ConfigError("--dtype", f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError("--out", f"--out {out} exists and is not empty: choose a new directory (nothing was "
                                   "overwritten)")


def _matched_tensors(step_dir: str, family: Any, shape: Any) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """(the checkpoint's model tensors by our name -> DCP metadata, the family's HF tensors by HF name ->
    shape), after checking that the two name the same tensors.

    Raises:
        CheckpointError: the checkpoint lacks a tensor the recorded model has, or holds one it has not.
    """
    from checkpoints.reader import read_metadata

    saved = {k[len("model."):]: md for k, md in read_metadata(step_dir).state_dict_metadata.items()
             if k.startswith("model.")}
    expected = family.hf_tensors(shape)
    ours = {family.from_hf(hf) for hf in expected}
    if set(saved) != ours:
        missing, extra = sorted(ours - set(saved)), sorted(set(saved) - ours)
        raise CheckpointError(f"the checkpoint's tensors do not match its recorded model (missing {missing[:3]}, "
                              f"unexpected {extra[:3]})", step_dir)
    return saved, expected


def _write_weight_files(tmp: str, step_dir: str, family: Any, saved: dict[str, Any],
                        files: dict[str, list[str]], target: Any) -> dict[str, str]:
    """Write each output file (name -> its HF tensor names) into ``tmp``, loading from DCP only that file's
    tensors so that memory holds one file, not the model; returns the weight map (HF name -> file)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from checkpoints.reader import SafeLoadPlanner, dcp_reader

    weight_map: dict[str, str] = {}
    for file, group in files.items():
        template = {"model": {ours_name: torch.empty(tuple(saved[ours_name].size),
                                                     dtype=saved[ours_name].properties.dtype)
                              for ours_name in (family.from_hf(hf) for hf in group)}}
        dcp.load(template, storage_reader=dcp_reader(step_dir), planner=SafeLoadPlanner(), no_dist=True)
        tensors = {hf: template["model"][family.from_hf(hf)].to(target).contiguous() for hf in group}
        save_file(tensors, os.path.join(tmp, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
        del template, tensors
    return weight_map


def _write_model_configs(tmp: str, config: dict[str, Any], dtype: str) -> None:
    """``config.json`` (the family's, with the exported dtype) and ``generation_config.json``."""
    config["dtype"] = dtype
    _write_json(os.path.join(tmp, "config.json"), config)
    _write_json(os.path.join(tmp, "generation_config.json"), generation_config(config))


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """What ``save_pretrained`` writes for a model with no generation settings of its own."""
    out: dict[str, Any] = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            out[key] = config[key]
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.write("\n")
