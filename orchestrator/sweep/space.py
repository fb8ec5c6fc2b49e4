"""`elastimesh tune --search KEY=SPACE`: parsing a search space, and the configs a sweep writes.

SPACE is one of `grid(a,b,...)`, `choice(a,b,...)`, `uniform(a,b)`, `loguniform(a,b)`, `randint(a,b)`
-- Ray Tune's `grid_search` and samplers of the same names (so `randint`'s upper bound is exclusive,
and `choice` draws at random, as in Ray Tune; `grid` runs every value, `--samples` times over). Values
are TOML literals (`1e-3`, `true`, `[1, 3]`, `"x"`) or bare words (`gpipe`), as `--set` reads them.
A malformed SPACE, a key that does not exist, or a bound the key cannot take is a `ConfigError`
naming the `--search` argument (the CLI exits 2 with that one line).

A trial's config, and the best config printed at the end, is the job's own config as a TOML document
with the sampled values put in (`apply`): exactly what `elastimesh train` loads.

Pure: no ray at import (`to_tune` imports `ray.tune` when called), so the parser is unit-tested alone.
"""

from __future__ import annotations

import copy
import difflib
import math
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from meshspeak.schema import ConfigError, iter_keys
from meshspeak.sections import ALL_KEYS, SECTIONS

KINDS = ("grid", "choice", "uniform", "loguniform", "randint")
LISTS = ("grid", "choice")  # spaces given as their values
FORMS = "grid(a,b,...), choice(a,b,...), uniform(a,b), loguniform(a,b) or randint(a,b)"
_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\s*\((.*)\)\s*$", re.DOTALL)
# key -> the annotation spelling of its type ("int", "float", "str", ...)
_TYPES = {f"{section}.{name}": str(f.type) for section, name, f in iter_keys(SECTIONS)}


@dataclass(frozen=True, slots=True)
class Space:
    key: str  # "section.key"
    kind: str  # one of KINDS
    values: tuple[Any, ...]  # the options of a grid or a choice; (low, high) otherwise
    text: str  # the --search argument, for messages

    def to_tune(self) -> Any:
        """The Ray Tune sampler for this space."""
        from ray import tune

        if self.kind == "grid":  # every value, in every one of the --samples repeats
            return tune.grid_search(list(self.values))
        if self.kind == "choice":
            return tune.choice(list(self.values))
        return getattr(tune, self.kind)(*self.values)

    def probes(self) -> list[Any]:
        """Values that stand for the whole space when checking the job accepts it: every option of
        a grid or a choice, both ends of a range (a range's values lie between them)."""
        if self.kind in LISTS:
            return list(self.values)
        low, high = self.values
        return [low, high - 1 if self.kind == "randint" else high]

    def largest(self) -> Any:
        return max(self.probes())


def parse_search(items: Sequence[str]) -> dict[str, Space]:
    """Parse every `--search KEY=SPACE`; keys in the order given. Raises ConfigError."""
    out: dict[str, Space] = {}
    for text in items:
        space = parse_one(text)
        if space.key in out:
            raise ConfigError(space.key, f"--search {text!r}: {space.key} is searched twice: give "
                                         "each key one SPACE")  # fmt: skip
        out[space.key] = space
    return out


def parse_one(text: str) -> Space:
    key, eq, spec = text.partition("=")
    key, spec = key.strip(), spec.strip()
    if not eq or not key or not spec:
        raise ConfigError(text, f"--search {text!r}: expected KEY=SPACE with SPACE one of {FORMS}, "
                                "e.g. train.lr=loguniform(1e-4,1e-2)")  # fmt: skip
    _check_key(key, text)
    m = _CALL.match(spec)
    if not m or m.group(1) not in KINDS:
        what = f"unknown space '{m.group(1)}'" if m else f"malformed SPACE {spec!r}"
        raise ConfigError(key, f"--search {text!r}: {what}: use {FORMS}")
    kind, inner = m.group(1), m.group(2)
    values = _values(inner, text, key)
    if kind in LISTS:
        if not values:
            raise ConfigError(key, f"--search {text!r}: {kind}() needs at least one value")
        return Space(key, kind, tuple(values), text)
    return Space(key, kind, _bounds(kind, values, text, key), text)


def _check_key(key: str, text: str) -> None:
    if key in _TYPES:
        return
    close = difflib.get_close_matches(key, ALL_KEYS, n=1, cutoff=0.6)
    moved = [k for k in ALL_KEYS if k.split(".", 1)[1] == key.split(".", 1)[-1]]
    hint = f"did you mean '{(moved or close)[0]}'?" if moved or close else \
        "see `elastimesh config --doc` for the keys"  # fmt: skip
    raise ConfigError(key, f"--search {text!r}: unknown key '{key}': {hint}")


def _values(inner: str, text: str, key: str) -> list[Any]:
    """The comma-separated arguments: a TOML array if they read as one, else bare words."""
    if not inner.strip():
        return []
    try:
        values = tomllib.loads(f"v = [{inner}]")["v"]
    except tomllib.TOMLDecodeError:
        values = [word.strip() for word in inner.split(",")]
        if any(not word or any(c in word for c in "[]\"'") for word in values):
            raise ConfigError(key, f"--search {text!r}: cannot read the values {inner!r}: write "
                                   "numbers, true/false, quoted strings or bare words") from None
    if _TYPES[key] == "str":  # `choice(2024, x)` for a string key: the words, as `--set` reads them
        values = [_word(word.strip()) for word in inner.split(",")]
    return values


def _word(text: str) -> str:
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    return value if isinstance(value, str) else text


def _bounds(kind: str, values: list[Any], text: str, key: str) -> tuple[Any, Any]:
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if len(values) != 2 or not numbers:
        raise ConfigError(key, f"--search {text!r}: {kind}(a,b) takes two numbers")
    low, high = values
    key_type = _TYPES[key]
    if kind == "randint":
        if not all(isinstance(v, int) for v in values):
            raise ConfigError(key, f"--search {text!r}: randint(a,b) takes two integers")
        if key_type not in ("int", "float"):
            raise ConfigError(key, f"--search {text!r}: {key} is not a number: use choice(...)")
    elif key_type != "float":
        fix = "randint(a,b) or choice(...)" if key_type == "int" else "choice(...)"
        raise ConfigError(key, f"--search {text!r}: {kind} draws real numbers but {key} takes "
                               f"{'integers' if key_type == 'int' else 'other values'}: use {fix}")  # fmt: skip
    if not all(math.isfinite(v) for v in values) or not low < high:
        raise ConfigError(key, f"--search {text!r}: {kind}(a,b) needs finite a < b, got a={low!r}, b={high!r}")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(key, f"--search {text!r}: loguniform(a,b) needs a > 0, got a={low!r}")
    if kind == "randint":
        return int(low), int(high)
    return float(low), float(high)


def plain(value: Any) -> Any:
    """A sampled value as a plain Python value (Tune may hand numpy scalars)."""
    if hasattr(value, "item") and not isinstance(value, (list, tuple, str)):
        value = value.item()
    if isinstance(value, tuple):
        value = list(value)
    return value


def apply(doc: dict[str, dict[str, Any]], values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A copy of the config document `doc` ({section: {key: value}}) with dotted `values` put in."""
    out = copy.deepcopy(doc)
    for dotted, value in values.items():
        section, _, name = dotted.partition(".")
        out.setdefault(section, {})[name] = plain(value)
    return out
