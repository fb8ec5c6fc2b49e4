"""Which training steps ``metrics.profile_steps`` traces, and what each trace file is called (pure).

The driver builds the ``ProfileSpec`` from the ``[metrics]`` section and hands it to every rank actor;
the rank wraps a covered step in torch.profiler (``workers/profiling.py``), one Chrome-trace file per
rank and step: ``<metrics.profile_dir>/rank{R}-gen{G}-step{K}.<time stamp>.pt.trace.json``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from meshspeak.schema import ConfigError

TRACE_SUFFIX = ".pt.trace.json"  # what tensorboard_trace_handler appends (after a time stamp)


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    first: int
    last: int
    out_dir: str  # absolute: the actors' working directory is not the driver's

    def covers(self, step: int) -> bool:
        return self.first <= step <= self.last


def profile_spec(metrics, steps: int) -> ProfileSpec | None:
    """The spec for a job's `[metrics]` section (None when profiling is off), paths made absolute."""
    window = profile_range(metrics.profile_steps, steps)
    if window is None:
        return None
    return ProfileSpec(window[0], window[1], profile_dir(metrics))


def profile_dir(metrics) -> str:
    """`metrics.profile_dir`, or `profiles/` beside `metrics.path`; absolute."""
    out_dir = metrics.profile_dir or os.path.join(os.path.dirname(metrics.path or "x"), "profiles")
    return os.path.abspath(out_dir)


def worker_name(rank: int, generation: int, step: int) -> str:
    return f"rank{rank}-gen{generation}-step{step}"


def profile_range(text: str, steps: int) -> tuple[int, int] | None:
    """`metrics.profile_steps` "A:B" as (A, B), or None when empty; steps A..B must lie in the run."""
    if not text.strip():
        return None
    first, sep, last = text.partition(":")
    try:
        a, b = int(first), int(last or "x")
    except ValueError:
        a = b = None
    _require(
        bool(sep) and a is not None,
        "metrics.profile_steps",
        f"metrics.profile_steps={text!r} is not a step range: write \"A:B\" with whole numbers, "
        f"e.g. \"2:3\" profiles steps 2 and 3 (empty = off)",
    )
    _require(
        1 <= a <= b <= steps,
        "metrics.profile_steps",
        f"metrics.profile_steps=\"{a}:{b}\" is outside the run: need 1 <= A <= B <= "
        f"train.steps={steps}",
    )
    return a, b


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)
