"""The config schema's machinery: one declaration per key, and everything derived from it.

A key is declared once, as a dataclass field of its section in `meshspeak.sections`, through
`key(default, doc, ...)`: its type is the annotation, its default and one-line doc are given here,
and so are its single-value rules (`ge`, `gt`, `le`, `lt`, `choices`) and, for a Python keyword,
the TOML spelling (`toml="async"`). From that one declaration this module derives the type
coercion of TOML values, the range and enum checks with their one-line errors, and the README's
key table (`elastimesh config --doc`; a unit test keeps README equal to it). Rules between keys
(`config_validate.check_mesh` and friends) stay code: they are relations, not ranges.

Pure stdlib, like the config itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class KeySpec:
    """What a key declares besides its type and default (read from the field's metadata)."""

    doc: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] | None = None
    toml: str | None = None  # the TOML key when the field name cannot be it (a Python keyword)


def key(default: Any, doc: str, **rules: Any) -> Any:
    """Declare one config key: a dataclass field with its default, doc and value rules.

    Args:
        default: the default value (immutable: every section is a frozen dataclass).
        doc: one line saying what the key means, shown in `elastimesh config --doc` and README.
        **rules: `ge`, `gt`, `le`, `lt` bounds, `choices` (a tuple), `toml` (the TOML spelling).
    """
    return dataclasses.field(default=default, metadata={"spec": KeySpec(doc=doc, **rules)})


def spec_of(f: dataclasses.Field[Any]) -> KeySpec:
    spec = f.metadata.get("spec")
    if spec is None:  # a section field declared without key(): a programming error, caught by tests
        raise TypeError(f"config field {f.name!r} is not declared with meshspeak.schema.key()")
    return spec


def toml_name(f: dataclasses.Field[Any]) -> str:
    return spec_of(f).toml or f.name


def iter_keys(sections: dict[str, type]) -> Iterator[tuple[str, str, dataclasses.Field[Any]]]:
    """(section, toml key, field) for every key, in declaration order."""
    for section, cls in sections.items():
        for f in dataclasses.fields(cls):
            yield section, toml_name(f), f


class ConfigError(ValueError):
    """A configuration problem, reported as one line that names the key and the fix.

    Attributes:
        key: the config key at fault ("model.n_heads"); for file-level problems the file path,
            for a malformed override the `--set` text.
        message: the one-line, user-facing message (also `str(error)`).
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str]]:
        # The default reduce replays only `args` (the message), which would lose `key` when
        # the error crosses a Ray actor boundary.
        return (type(self), (self.key, self.message))


# --- type coercion: one checker per annotation spelling used in meshspeak.sections ----------


def _type_error(name: str, expected: str, value: object) -> ConfigError:
    return ConfigError(name, f"{name}: expected {expected}, got {value!r} ({type(value).__name__})")


def _as_int(name: str, v: object) -> int:
    # bool is a subclass of int; `dp = true` is a mistake, not 1.
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise _type_error(name, "an integer", v)


def _as_float(name: str, v: object) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        # Store ints as floats so the fingerprint of `rope_theta = 10000` equals `10000.0`.
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        # Timeouts of `inf` would disable failure detection; `nan` defeats every range check.
        if not math.isfinite(f):
            raise ConfigError(name, f"{name}: expected a finite number, got {v!r}")
        return f
    raise _type_error(name, "a number", v)


def _as_str(name: str, v: object) -> str:
    if isinstance(v, str):
        return v
    raise _type_error(name, "a string", v)


def _as_bool(name: str, v: object) -> bool:
    if isinstance(v, bool):
        return v
    raise _type_error(name, "true or false", v)


def _as_str_or_bool(name: str, v: object) -> str | bool:
    if isinstance(v, (str, bool)):
        return v
    raise _type_error(name, 'true, false or "auto"', v)


def _as_int_tuple(name: str, v: object) -> tuple[int, ...] | None:
    if isinstance(v, (list, tuple)) and all(type(x) is int for x in v):  # bool is not int here
        return tuple(v) or None
    raise _type_error(name, "a list of integers", v)


MIX_ANNOTATION = "tuple[tuple[str, float], ...] | None"  # data.mix / eval.mix: ((path, weight), ...)
_MIX_TABLE = '{path = "DIR", weight = 0.5}'


def _as_mix(name: str, v: object) -> tuple[tuple[str, float], ...] | None:
    """A TOML array of inline tables ``{path = "...", weight = w}`` as ((path, weight), ...); an empty
    array is None (no mixture). Each weight must be a finite number > 0, so the sum is positive."""
    if not isinstance(v, (list, tuple)):
        raise _type_error(name, f"a list of tables {_MIX_TABLE}", v)
    out: list[tuple[str, float]] = []
    for i, item in enumerate(v):
        where = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(name, f"{where}: expected a table {_MIX_TABLE}, got {item!r}")
        unknown = sorted(set(item) - {"path", "weight"})
        if unknown:
            raise ConfigError(name, f"{where}: unknown key {unknown[0]!r}: a source has only path and weight")
        path = item.get("path")
        if not isinstance(path, str) or not path:
            raise ConfigError(name, f"{where}.path: expected a shard directory or URI (a non-empty string), "
                                    f"got {path!r}")
        weight = _as_float(f"{where}.weight", item.get("weight"))
        if weight <= 0:
            raise ConfigError(name, f"{where}.weight must be > 0, got {item.get('weight')!r}: every source needs a "
                                    "positive share (leave a source out to not train on it)")
        if path in (p for p, _ in out):
            raise ConfigError(name, f"{where}.path {path!r} is listed twice: give it one entry with the summed weight")
        out.append((path, weight))
    return tuple(out) or None


# annotation spelling -> (coercer, the type as the docs show it)
_TYPES: dict[str, tuple[Callable[[str, object], Any], str]] = {
    "int": (_as_int, "int"),
    "float": (_as_float, "float"),
    "str": (_as_str, "string"),
    "bool": (_as_bool, "bool"),
    "str | bool": (_as_str_or_bool, "bool or string"),
    "tuple[int, ...] | None": (_as_int_tuple, "list of int"),
    MIX_ANNOTATION: (_as_mix, "list of {path, weight}"),
}


def coerce(name: str, f: dataclasses.Field[Any], value: object) -> Any:
    """The TOML `value` of key `name` as the field's type, or a ConfigError naming the key."""
    return _TYPES[str(f.type)][0](name, value)


def is_string_key(f: dataclasses.Field[Any]) -> bool:
    return str(f.type) == "str"


def plain_value(f: dataclasses.Field[Any], value: Any) -> Any:
    """A key's value as TOML/JSON writes it: tuples as lists, a mixture as a list of tables."""
    if str(f.type) == MIX_ANNOTATION and value is not None:
        return [{"path": path, "weight": weight} for path, weight in value]
    return list(value) if isinstance(value, tuple) else value


# --- single-value rules ----------------------------------------------------------------------


def toml_literal(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def check_value(name: str, spec: KeySpec, value: Any) -> None:
    """Raise ConfigError if `value` breaks one of the key's own rules (the message names the key)."""
    if spec.choices is not None:
        # `True == 1` in Python, so compare types too: zero=True must not pass as zero=1.
        if not any(type(value) is type(a) and value == a for a in spec.choices):
            shown = ", ".join(toml_literal(a) for a in spec.choices)
            raise ConfigError(name, f"{name}={toml_literal(value)} is not allowed: use one of {shown}")
        return
    if value is None or isinstance(value, (str, bool, tuple)):
        return
    low_ok = (spec.ge is None or value >= spec.ge) and (spec.gt is None or value > spec.gt)
    high_ok = (spec.le is None or value <= spec.le) and (spec.lt is None or value < spec.lt)
    if not (low_ok and high_ok):
        raise ConfigError(name, f"{name} must be {describe_range(spec)}, got {value!r}")


def describe_range(spec: KeySpec) -> str:
    """The rule as the errors and docs say it: '>= 1', '> 0', 'in [0, 1)'; '' when none."""
    low = f"[{spec.ge:g}" if spec.ge is not None else f"({spec.gt:g}" if spec.gt is not None else None
    high = f"{spec.le:g}]" if spec.le is not None else f"{spec.lt:g})" if spec.lt is not None else None
    if low and high:
        return f"in {low}, {high}"
    for op, bound in ((">=", spec.ge), (">", spec.gt), ("<=", spec.le), ("<", spec.lt)):
        if bound is not None:
            return f"{op} {bound:g}"
    return ""


def check_values(cfg: Any, sections: dict[str, type]) -> None:
    """Every key's own rules, in declaration order; the first violation raises."""
    for section, name, f in iter_keys(sections):
        check_value(f"{section}.{name}", spec_of(f), getattr(getattr(cfg, section), f.name))


# --- docs ------------------------------------------------------------------------------------


def _allowed(spec: KeySpec) -> str:
    if spec.choices is not None:
        return ", ".join(toml_literal(a) for a in spec.choices)
    return describe_range(spec)


def _default(f: dataclasses.Field[Any]) -> str:
    value = f.default
    if value is None:
        return "(none)"
    if isinstance(value, str) and not value:
        return '""'
    return toml_literal(value)


def doc_table(sections: dict[str, type]) -> str:
    """The Markdown table of every key: key, type, default, allowed values, meaning."""
    rows = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for section, name, f in iter_keys(sections):
        spec = spec_of(f)
        doc, allowed = (text.replace("|", r"\|") for text in (spec.doc, _allowed(spec)))
        rows.append(f"| `{section}.{name}` | {_TYPES[str(f.type)][1]} | `{_default(f)}` | "
                    f"{allowed} | {doc} |")
    return "\n".join(rows) + "\n"


def dump_toml(doc: dict[str, dict[str, Any]]) -> str:
    """{section: {key: value}} as TOML text (the value types a config key can have).

    Written here rather than taken from a library: the stdlib reads TOML but does not write it, and
    a config needs only tables of scalars, lists, and lists of inline tables (a mixture).
    """
    lines: list[str] = []
    for section, table in doc.items():
        lines.append(f"[{section}]")
        for name, value in table.items():
            lines.append(f"{name} = {_toml_text(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return toml_literal(value)
