"""Typed job configuration: the TOML sections, loading with `--set` overrides, and helpers.

This module owns the config *schema* (one frozen dataclass per TOML section, every key
defaulted so that the defaults are a tiny dp=2, tp=2 CPU job), turning a TOML file plus
`--set SECTION.KEY=VALUE` overrides into a `JobConfig`, and the canonical dict checkpoint manifests
store. The semantic rules live in `config_validate.py`, the model fingerprint that decides whether
a checkpoint can be resumed in `config_fingerprint.py`; every problem surfaces as one `ConfigError`
naming the key and the fix.

Pure stdlib (no ray, no torch): frozen dataclasses pickle cleanly to actors, and each component
should receive only its own section.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.config_validate import (
    ConfigError,
    check_mesh,
    dp_bounds,
    microbatches_per_replica,
    validate_job,
)

__all__ = [
    "ALL_KEYS", "CheckpointConfig", "ConfigError", "DataConfig", "ElasticConfig", "JobConfig",
    "MeshConfig", "MetricsConfig", "ModelConfig", "PipelineConfig", "ResourcesConfig", "SECTIONS",
    "TrainConfig", "check_mesh", "config_to_dict", "dp_bounds", "load_config",
    "microbatches_per_replica", "model_diff", "model_fingerprint", "replace_mesh",
]  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshConfig:
    dp: int = 2  # data-parallel replicas: the axis that shrinks and grows
    pp: int = 1  # pipeline stages
    tp: int = 2  # tensor-parallel shards (with sequence parallelism)
    zero: int = 3  # 3: params+grads+optimizer sharded over dp; 2: params gathered for the step
    # Consecutive blocks share one FSDP unit (one all-gather / reduce-scatter) until it holds this many
    # MB of fp32 parameters per tp shard; 0 = one unit per block. See orchestrator.mesh.fsdp_units.
    fsdp_unit_mb: float = 25.0

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    n_layers: int = 4
    d_model: int = 64
    n_heads: int = 4
    vocab_size: int = 256  # >= 256 for the built-in corpus (byte tokens)
    seq_len: int = 64
    ffn_hidden: int = 0  # 0 means 4 * d_model
    norm_eps: float = 1e-5
    init_std: float = 0.02
    rope_theta: float = 10000.0
    # Model families (workers/models/family.py). "" = "llama" with from_hf, else the built-in "gpt";
    # or "package.module:Name" for a user's family.
    family: str = ""
    from_hf: str = ""  # a Hugging Face model directory: the shape comes from its config.json

    @property
    def ffn_dim(self) -> int:
        return self.ffn_hidden or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    steps: int = 20
    global_batch_size: int = 8  # sequences per optimizer step, whatever the mesh
    micro_batch_size: int = 2  # sequences per microbatch per DP replica
    lr: float = 3e-3  # peak learning rate after warmup
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 2
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # global grad-norm clip; 0 = off
    seed: int = 0  # fixes init and the global sample order
    dtype: str = "float32"  # "float32" or "bfloat16"
    activation_checkpointing: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig:
    schedule: str = "1f1b"  # "1f1b", "gpipe" or "interleaved_1f1b"
    virtual_stages: int = 1  # model chunks per pp rank; >= 2 only for interleaved_1f1b
    # Layers per stage in stage order (pp * virtual_stages entries), overriding the balanced
    # split. TOML has no null, so an empty list also means "balanced".
    layers: tuple[int, ...] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    path: str = "builtin"  # "builtin" (shipped corpus, byte tokens) or a Parquet shard directory


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    dir: str = ""  # empty = checkpoints off
    every: int = 0  # save every N steps; 0 = off
    async_write: bool = True  # TOML key `async` (a Python keyword): write in the background
    keep: int = 3  # keep the last K committed checkpoints
    resume: bool = True  # resume from the latest committed checkpoint in `dir`
    init_from: str = ""  # Hugging Face safetensors directory loaded at step 0 when `dir` has nothing to resume


@dataclass(frozen=True, kw_only=True, slots=True)
class ElasticConfig:
    min_dp: int = 1  # fail rather than shrink below this many replicas
    max_dp: int = 0  # grow no higher than this; 0 means mesh.dp
    collective_timeout_s: float = 60.0  # process-group timeout: bounds a blocked collective
    step_timeout_s: float = 120.0  # a step slower than this counts as a hang
    max_restarts: int = 3  # rebuilds allowed before the job fails
    rebuild_timeout_s: float = 120.0
    grow_check_s: float = 5.0  # how often to look for capacity to grow back


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricsConfig:
    path: str = "metrics.jsonl"
    tensorboard_dir: str = ""  # empty = no TensorBoard
    timeline: str = ""  # empty = no timeline export
    log_every: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class ResourcesConfig:
    use_gpu: str | bool = "auto"  # true, false or "auto" (GPUs when the cluster has them)
    cpus_per_worker: float = 1.0
    placement_timeout_s: float = 60.0


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    mesh: MeshConfig = field(default_factory=MeshConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)


# Section name -> dataclass, in JobConfig order (the JobConfig field names are the section names).
SECTIONS: dict[str, type] = {
    f.name: f.default_factory for f in dataclasses.fields(JobConfig)  # type: ignore[misc]
}

# Field names that differ from their TOML key, per section: Python keywords cannot be fields.
_TOML_ALIASES: dict[str, dict[str, str]] = {"checkpoint": {"async_write": "async"}}


def _toml_key(section: str, field_name: str) -> str:
    return _TOML_ALIASES.get(section, {}).get(field_name, field_name)


# section -> {toml key -> dataclass field}
_FIELDS: dict[str, dict[str, dataclasses.Field[Any]]] = {
    name: {_toml_key(name, f.name): f for f in dataclasses.fields(cls)}
    for name, cls in SECTIONS.items()
}

ALL_KEYS: list[str] = [f"{section}.{key}" for section, keys in _FIELDS.items() for key in keys]


# --- type coercion: one checker per annotation spelling used above ------------------------


def _type_error(key: str, expected: str, value: object) -> ConfigError:
    return ConfigError(key, f"{key}: expected {expected}, got {value!r} ({type(value).__name__})")


def _as_int(key: str, v: object) -> int:
    # bool is a subclass of int; `dp = true` is a mistake, not 1.
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise _type_error(key, "an integer", v)


def _as_float(key: str, v: object) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        # Store ints as floats so the fingerprint of `rope_theta = 10000` equals `10000.0`.
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        # Timeouts of `inf` would disable failure detection; `nan` defeats every range check.
        if not math.isfinite(f):
            raise ConfigError(key, f"{key}: expected a finite number, got {v!r}")
        return f
    raise _type_error(key, "a number", v)


def _as_str(key: str, v: object) -> str:
    if isinstance(v, str):
        return v
    raise _type_error(key, "a string", v)


def _as_bool(key: str, v: object) -> bool:
    if isinstance(v, bool):
        return v
    raise _type_error(key, "true or false", v)


def _as_str_or_bool(key: str, v: object) -> str | bool:
    if isinstance(v, (str, bool)):
        return v
    raise _type_error(key, 'true, false or "auto"', v)


def _as_int_tuple(key: str, v: object) -> tuple[int, ...] | None:
    if isinstance(v, (list, tuple)) and all(type(x) is int for x in v):  # bool is not int here
        return tuple(v) or None
    raise _type_error(key, "a list of integers", v)


_COERCE: dict[str, Callable[[str, object], Any]] = {
    "int": _as_int,
    "float": _as_float,
    "str": _as_str,
    "bool": _as_bool,
    "str | bool": _as_str_or_bool,
    "tuple[int, ...] | None": _as_int_tuple,
}


# --- loading -------------------------------------------------------------------------------


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> JobConfig:
    """Load, override and validate a job configuration.

    Args:
        path: a TOML file with one `[section]` per config class, or None for the defaults.
        overrides: `SECTION.KEY=VALUE` strings applied after the file; VALUE is read as a TOML
            literal (`1e-3`, `true`, `[1, 3]`, `"x"`) and as a bare string if it is not one.

    Returns:
        The validated `JobConfig`.

    Raises:
        ConfigError: for an unreadable file, invalid TOML, an unknown section or key, a value
            of the wrong type, a malformed override, or any rule in `config_validate`.
    """
    raw: dict[str, dict[str, object]] = {}
    if path is not None:
        _merge_file(raw, _read_toml(str(path)), str(path))
    for text in overrides:
        section, key, value = _parse_override(text)
        raw.setdefault(section, {})[key] = value

    sections = {}
    for name, cls in SECTIONS.items():
        kwargs = {}
        for key, value in raw.get(name, {}).items():
            f = _FIELDS[name][key]
            kwargs[f.name] = _COERCE[str(f.type)](f"{name}.{key}", value)
        sections[name] = cls(**kwargs)
    cfg = JobConfig(**sections)
    _check_from_hf_conflicts(raw.get("model", {}))
    validate_job(cfg)
    return cfg


# [model] keys that describe the architecture: with model.from_hf, config.json decides them.
HF_SIZE_KEYS = ("n_layers", "d_model", "n_heads", "vocab_size", "ffn_hidden", "norm_eps", "rope_theta")


def _check_from_hf_conflicts(model_raw: Mapping[str, object]) -> None:
    if not model_raw.get("from_hf"):
        return
    clash = [k for k in HF_SIZE_KEYS if k in model_raw]
    if clash:
        raise ConfigError(f"model.{clash[0]}", f"model.{clash[0]} and model.from_hf are both set: the shape comes "
                                                f"from {model_raw['from_hf']}/config.json; remove model.{clash[0]}")


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(path, f"{path}: no such config file: check the path, or omit it to run "
                                f"the built-in tiny job") from None  # fmt: skip
    except tomllib.TOMLDecodeError as exc:
        # tomllib (3.11) puts the position in the message: "Invalid value (at line 3, column 5)".
        msg = str(exc)
        m = re.search(r"\s*\(at line (\d+), column \d+\)$", msg)
        where = f" at line {m.group(1)}" if m else ""
        reason = msg[: m.start()] if m else msg
        raise ConfigError(path, f"{path}: invalid TOML{where}: {reason}") from None
    except UnicodeDecodeError:
        raise ConfigError(path, f"{path}: invalid TOML: the file is not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(path, f"{path}: cannot read config file: {exc.strerror or exc}") from None


def _merge_file(raw: dict[str, dict[str, object]], doc: Mapping[str, Any], path: str) -> None:
    for section, table in doc.items():
        if section not in SECTIONS:
            raise ConfigError(section, f"{path}: {_unknown_section(section)}")
        if not isinstance(table, dict):
            raise ConfigError(section, f"{path}: '{section}' must be a table: write it as "
                                       f"[{section}] followed by key = value lines")  # fmt: skip
        for key, value in table.items():
            _check_key(section, key, prefix=f"{path}: ")
            raw.setdefault(section, {})[key] = value


def _parse_override(text: str) -> tuple[str, str, object]:
    if "=" not in text:
        raise ConfigError(text, f"--set {text!r}: expected SECTION.KEY=VALUE")
    dotted, _, value_text = text.partition("=")
    dotted, value_text = dotted.strip(), value_text.strip()
    section, dot, key = dotted.partition(".")
    if not dot:
        homes = [k for k in ALL_KEYS if k.split(".", 1)[1] == dotted]
        hint = f", e.g. '{homes[0]}={value_text}'" if homes else ""
        raise ConfigError(dotted, f"--set {text!r}: the key needs a section: expected "
                                  f"SECTION.KEY=VALUE{hint}")  # fmt: skip
    if section not in SECTIONS:
        raise ConfigError(dotted, f"--set: {_unknown_section(section)}")
    _check_key(section, key, prefix="--set: ")
    f = _FIELDS[section][key]
    try:
        value: object = tomllib.loads("v = " + value_text)["v"]
    except tomllib.TOMLDecodeError:
        value = value_text  # a bare word such as /data/shards or auto
    if str(f.type) == "str" and not isinstance(value, str):
        value = value_text  # `--set data.path=2024` means the string, not the integer
    return section, key, value


def _unknown_section(section: str) -> str:
    close = difflib.get_close_matches(section, list(SECTIONS), n=1)
    hint = f"did you mean '[{close[0]}]'?" if close else f"sections are {', '.join(SECTIONS)}"
    return f"unknown section '[{section}]': {hint}"


def _check_key(section: str, key: str, prefix: str) -> None:
    if key in _FIELDS[section]:
        return
    full = f"{section}.{key}"
    # A key that exists under another section is the likeliest mistake; then near spellings.
    moved = [k for k in ALL_KEYS if k.split(".", 1)[1] == key]
    close = moved or difflib.get_close_matches(full, ALL_KEYS, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else f"keys are {', '.join(_FIELDS[section])}"
    raise ConfigError(full, f"{prefix}unknown key '{full}': {hint}")


# --- derived views -------------------------------------------------------------------------


def replace_mesh(cfg: JobConfig, **changes: int) -> JobConfig:
    """Return `cfg` with mesh fields replaced, e.g. `replace_mesh(cfg, dp=3)`; not re-validated."""
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, **changes))


def config_to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """The config as {section: {toml_key: value}}, JSON/TOML-ready.

    Tuples become lists; None values are left out (TOML has no null, and a missing key loads
    as its default), so `load_config` of this dict written as TOML gives back `cfg`.
    """
    out: dict[str, dict[str, Any]] = {}
    for name in SECTIONS:
        section = getattr(cfg, name)
        out[name] = {}
        for key, f in _FIELDS[name].items():
            value = getattr(section, f.name)
            if value is not None:
                out[name][key] = list(value) if isinstance(value, tuple) else value
    return out
