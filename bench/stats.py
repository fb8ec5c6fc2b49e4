"""How a benchmark's repeats become its headline figure (one home for the rule in bench/README.md).

A figure is the median of interleaved repeats (A, B, A, B... or A B, B A...: the shared machine's drift
then hits every side alike) with its spread (min, max) and each repeat's value, never the best of the
runs or of the variants. A ratio between two sides is taken per repeat (each run over the other side's
run of the same repeat) and then its median. A goal holds only when every repeat meets it; how many did
is said beside it.

Pure functions (no torch, no Ray): the scripts import this module as ``stats`` (``bench/`` is on their
``sys.path``), the unit tests as ``tests/unit/test_bench_stats.py`` does.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence


def spread(values: Sequence[float | None], ndigits: int | None = None) -> dict | None:
    """The median of ``values`` with ``min``, ``max``, ``n`` (how many had a value) and ``per_repeat``
    (every repeat's value in order, None where a repeat has no figure: it is left out of the others).
    None when no repeat has a value. ``ndigits`` rounds every number."""
    got = [v for v in values if v is not None]
    if not got:
        return None

    def rnd(v):
        return v if ndigits is None or v is None else round(v, ndigits)

    return {"median": rnd(statistics.median(got)), "min": rnd(min(got)), "max": rnd(max(got)), "n": len(got),
            "per_repeat": [rnd(v) for v in values]}


def paired_ratios(numerators: Sequence[float | None], denominators: Sequence[float | None]) -> list[float | None]:
    """Repeat by repeat, ``numerators[i] / denominators[i]``; None where either is missing or the
    denominator is 0 (such a repeat has no ratio, it is not a zero or an infinite one)."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators for {len(denominators)} denominators: pair repeats one to one")
    return [a / b if a is not None and b else None for a, b in zip(numerators, denominators)]


def repeats_meeting(values: Sequence[float | None], meets: Callable[[float], bool]) -> tuple[str, bool]:
    """``("k of n", all n met)``: in how many of the ``n`` repeats the figure met the goal (a repeat
    without the figure did not). No repeats: ``("0 of 0", False)``: nothing measured claims nothing."""
    met = sum(v is not None and bool(meets(v)) for v in values)
    return f"{met} of {len(values)}", bool(values) and met == len(values)
