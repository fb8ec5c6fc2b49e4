"""Straggler scoring (pure): which rank has been slower than its peers for too many steps in a row.

Each step every rank reports ``StepResult.own_s``: the CPU time of its training thread in the step.
A rank blocked in a collective waiting for a slow peer sleeps in the wait and burns no CPU, so a slow
peer does not make everybody look slow, as the step's wall time (the same on every rank of a lockstep
step) or forward/backward wall time (which holds FSDP's and pipeline waits) would; the time to reach
the step's first collective would leave out everything after it. CPU time sees a rank doing more
work or running on a slower core; it misses a rank that waits on something else (slow storage) or
whose CPU is taken by a neighbour, and on GPUs it counts only the host's share (docs/design.md,
Stragglers).

A rank's score is its own time over the median of its peers' — the ranks at the same pipeline
position (they run the same layers), or every other rank when it has none. Above
``elastic.straggler_factor`` for ``elastic.straggler_steps`` steps in a row it is reported once;
it is reported again only after a step at a normal pace. Scores follow actors, not world ranks, so
a re-formed mesh keeps no stale streaks of departed actors (``forget``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


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
        streak reached ``steps`` in this step."""
        out = []
        for actor, (group, seconds) in own.items():
            peers = [s for a, (g, s) in own.items() if a != actor and g == group]
            peers = peers or [s for a, (_, s) in own.items() if a != actor]
            if not peers:
                continue
            median = statistics.median(peers)
            ratio = seconds / median if median > 0 else (math.inf if seconds > 0 else 1.0)
            if ratio <= self.factor:
                self.streak[actor] = 0
                self.reported.discard(actor)
                continue
            self.streak[actor] = self.streak.get(actor, 0) + 1
            if self.streak[actor] >= self.steps and actor not in self.reported:
                self.reported.add(actor)
                out.append(Straggler(actor, ratio))
        return out

    def forget(self, keep) -> None:
        """Drop the actors not in ``keep`` (gone, or now spares)."""
        self.streak = {a: n for a, n in self.streak.items() if a in keep}
        self.reported &= set(keep)
