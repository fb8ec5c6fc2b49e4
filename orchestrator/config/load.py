"""Loading a job configuration: a TOML file plus ``--set SECTION.KEY=VALUE`` overrides -> ``JobConfig``.

The sections and their keys are declared in ``meshspeak.sections`` (both sides read them); this
module reads the file, applies the overrides (with suggestions for unknown sections and keys), coerces
every value through its declaration and then checks the rules between keys
(``orchestrator.config.validate``). Every problem surfaces as one ``ConfigError`` naming the key and
the fix (the CLI prints it and exits 2).
"""

from __future__ import annotations

import difflib
import logging
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from meshspeak.schema import ConfigError, coerce, dump_toml, is_string_key, toml_literal
from meshspeak.sections import ALL_KEYS, FIELDS, SECTIONS, JobConfig, config_to_dict
from orchestrator.config.validate import validate_job

logger = logging.getLogger(__name__)


def load_config(path: str | Path | None, overrides: Sequence[str] = (), deepspeed: str | None = None,
                warn: Callable[[str], None] | None = None) -> JobConfig:
    """Load, override and validate a job configuration.

    Args:
        path: a TOML file with one `[section]` per config class, or None for the defaults.
        overrides: `SECTION.KEY=VALUE` strings applied after the file; VALUE is read as a TOML
            literal (`1e-3`, `true`, `[1, 3]`, `"x"`) and as a bare string if it is not one.
        deepspeed: a DeepSpeed JSON config (``orchestrator.config.deepspeed``): its keys fill what the
            file and the overrides leave unset, and may not contradict them.
        warn: called with each line about a DeepSpeed field that has no counterpart (default: logged).

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
    if deepspeed:
        _merge_deepspeed(raw, deepspeed, warn or logger.warning)

    sections = {}
    for name, cls in SECTIONS.items():
        kwargs = {}
        for key, value in raw.get(name, {}).items():
            f = FIELDS[name][key]
            kwargs[f.name] = coerce(f"{name}.{key}", f, value)
        sections[name] = cls(**kwargs)
    cfg = JobConfig(**sections)
    _check_from_hf_conflicts(raw.get("model", {}))
    _check_powersgd_knobs(raw.get("train", {}), cfg.train.grad_compression)
    validate_job(cfg)
    return cfg


def _check_powersgd_knobs(train_raw: Mapping[str, object], compression: str) -> None:
    """int8/int4 with PowerSGD (issue 27's bad input): one reduction runs per generation, so a PowerSGD
    knob set beside a quantized codec would be silently ignored; refuse it (a knob left at its default
    is fine: only what the file or --set wrote counts)."""
    if compression not in ("int8", "int4"):
        return
    knobs = [k for k in ("powersgd_rank", "powersgd_plain_steps") if k in train_raw]
    if knobs:
        raise ConfigError(f"train.{knobs[0]}", f"train.{knobs[0]} is PowerSGD's, but train.grad_compression="
                                               f"\"{compression}\": {compression} and PowerSGD do not combine (one "
                                               f"reduction per step); remove train.{knobs[0]} or set "
                                               f"train.grad_compression=\"powersgd\"")


def _merge_deepspeed(raw: dict[str, dict[str, object]], path: str, warn: Callable[[str], None]) -> None:
    """Put the DeepSpeed config's keys into ``raw`` (TOML + --set) where unset; equal where set."""
    from orchestrator.config.deepspeed import read_deepspeed

    def ours(dotted: str) -> Any:
        section, key = dotted.split(".")
        f = FIELDS[section][key]
        return coerce(dotted, f, raw[section][key]) if key in raw.get(section, {}) else f.default

    mapped, origin, warnings = read_deepspeed(path, ours("mesh.dp"), ours)
    for line in warnings:
        warn(line)
    for section, table in mapped.items():
        for key, value in table.items():
            dotted = f"{section}.{key}"
            theirs = coerce(dotted, FIELDS[section][key], value)
            if key in raw.get(section, {}) and ours(dotted) != theirs:
                raise ConfigError(dotted, f"{path}: {origin[dotted]} gives {dotted}={theirs!r} but the TOML or --set "
                                          f"says {dotted}={ours(dotted)!r}: make them agree or drop one")
            raw.setdefault(section, {})[key] = value


# [model] keys that describe the architecture: with model.from_hf, config.json decides them.
HF_SIZE_KEYS = ("n_layers", "d_model", "n_heads", "vocab_size", "ffn_hidden", "norm_eps", "rope_theta")


# Where a family's shape keeps each of them when its name differs (the llama family's ffn_dim).
_SHAPE_FIELDS = {"ffn_hidden": ("ffn_hidden", "ffn_dim")}


def config_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML that ``load_config`` accepts back (``elastimesh config``).

    With ``model.from_hf`` the architecture keys come from its config.json and must not be set (a file
    that sets them is refused), so they are written as comments carrying config.json's values.
    """
    doc = config_to_dict(cfg)
    if not cfg.model.from_hf:
        return dump_toml(doc)
    from meshmodels.family import resolve_model

    shape = resolve_model(cfg.model).shape
    notes = []
    for key in HF_SIZE_KEYS:
        doc["model"].pop(key, None)
        value = next((getattr(shape, f) for f in _SHAPE_FIELDS.get(key, (key,)) if hasattr(shape, f)), None)
        if value is not None:
            notes.append(f"# {key} = {toml_literal(value)}")
    header = f"# read from {cfg.model.from_hf}/config.json (model.from_hf), so not set here:"
    text = dump_toml(doc)
    model_end = text.index("[model]\n")
    model_end = text.index("\n\n", model_end)
    return text[:model_end] + "\n" + "\n".join([header, *notes]) + text[model_end:]


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
    f = FIELDS[section][key]
    try:
        value: object = tomllib.loads("v = " + value_text)["v"]
    except tomllib.TOMLDecodeError:
        value = value_text  # a bare word such as /data/shards or auto
    if is_string_key(f) and not isinstance(value, str):
        value = value_text  # `--set data.path=2024` means the string, not the integer
    return section, key, value


def _unknown_section(section: str) -> str:
    close = difflib.get_close_matches(section, list(SECTIONS), n=1)
    hint = f"did you mean '[{close[0]}]'?" if close else f"sections are {', '.join(SECTIONS)}"
    return f"unknown section '[{section}]': {hint}"


def _check_key(section: str, key: str, prefix: str) -> None:
    if key in FIELDS[section]:
        return
    full = f"{section}.{key}"
    # A key that exists under another section is the likeliest mistake; then near spellings.
    moved = [k for k in ALL_KEYS if k.split(".", 1)[1] == key]
    close = moved or difflib.get_close_matches(full, ALL_KEYS, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else f"keys are {', '.join(FIELDS[section])}"
    raise ConfigError(full, f"{prefix}unknown key '{full}': {hint}")
