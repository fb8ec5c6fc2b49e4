"""Straggler scoring (pure): which rank has been slower than its peers for too many steps in a row.

Each step every rank reports ``StepResult.forward_s``: the wall time inside its blocks' forward
passes with FSDP's all-gather waits left out (``workers/compute_clock.py``). The step's wall time is
the same on every rank of a lockstep step, and forward/backward wall time holds FSDP's and the
pipeline's waits for a slow peer, so either would make everybody look slow; CPU time (``own_s``)
would miss a rank that is slow without computing more (a sleep, a core taken by a neighbour).
Measured on the forwards only: the backward's FSDP waits run inside autograd, where no module hook
separates them. On GPUs the forward's kernels run asynchronously, so this counts the host's share
only (docs/design.md, Stragglers).

A rank's score is its own time over the median of its peers' — the ranks at the same pipeline
position (they run the same layers), or every other rank when it has none. Above
``elastic.straggler_factor`` (and at least ``MIN_EXCESS_S`` slower) for ``elastic.straggler_steps``
steps in a row it is reported once; it is reported again only after a step at a normal pace. Scores follow actors, not world ranks, so
a re-formed mesh keeps no stale streaks of departed actors (``forget``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A rank must also be this much slower than its peers' median: on a busy host a tiny model's
# millisecond forwards differ by whole factors from scheduling alone (seen on the 2-core test machine),
# which no real straggler's cost is worth an eviction for.
MIN_EXCESS_S = 0.05


@dataclass(frozen=True, slots=True)
class Straggler:
    actor: int
    factor: float  # own time / the peers' median in the step that completed the streak


class StragglerWatch:
    def __init__(self, factor: float, steps: int) -> None:
        self.factor, self.steps = factor, steps
        self.streak: dict[int, int] = {}
        self.reported: set[int] = set()

    def observe(self, own: dict[int, tuple[int, float]]) -> list[Straggler]:
        """One step: actor -> (peer group, e.g. its pp coordinate; own seconds). The stragglers whose
        streak reached ``steps`` in this step. O(n log n) in the ranks: each group's times are sorted
        once and every median leaves one element out by index (a rescan per rank was quadratic: 76 ms
        of driver CPU per step at 1,024 ranks)."""
        groups: dict[int, list[tuple[float, int]]] = {}
        for actor, (group, seconds) in own.items():
            groups.setdefault(group, []).append((seconds, actor))
        everyone = sorted((seconds, actor) for actor, (_, seconds) in own.items())
        all_times = [s for s, _ in everyone]
        position = {actor: i for i, (_, actor) in enumerate(everyone)}
        out = []
        for members in groups.values():
            members.sort()
            times = [s for s, _ in members]
            for i, (seconds, actor) in enumerate(members):
                if len(members) > 1:
                    median = _median_without(times, i)
                elif len(everyone) > 1:
                    median = _median_without(all_times, position[actor])
                else:
                    continue
                found = self._score(actor, seconds, median)
                if found is not None:
                    out.append(found)
        return out

    def _score(self, actor: int, seconds: float, median: float) -> Straggler | None:
        ratio = seconds / median if median > 0 else (math.inf if seconds > 0 else 1.0)
        if ratio <= self.factor or seconds - median < MIN_EXCESS_S:
            self.streak[actor] = 0
            self.reported.discard(actor)
            return None
        self.streak[actor] = self.streak.get(actor, 0) + 1
        if self.streak[actor] >= self.steps and actor not in self.reported:
            self.reported.add(actor)
            return Straggler(actor, ratio)
        return None

    def forget(self, keep) -> None:
        """Drop the actors not in ``keep`` (gone, or now spares)."""
        self.streak = {a: n for a, n in self.streak.items() if a in keep}
        self.reported &= set(keep)


def _median_without(ordered: list[float], skip: int) -> float:
    """The median of sorted ``ordered`` without its element at ``skip`` (at least two elements)."""
    n = len(ordered) - 1

    def at(j: int) -> float:  # the j-th element of the list without ``skip``
        return ordered[j if j < skip else j + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2
