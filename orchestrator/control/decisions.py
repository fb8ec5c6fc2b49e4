"""What a step boundary can decide, as data (pure): the boundary's deciders (control/boundary.py)
return one of these, the Running and Draining handlers carry it out or hold it (control/states.py)."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.control.scaling import ResizeDecision, TooFewWorkers
from orchestrator.recovery.preemption import Preemption


@dataclass
class Boundary:
    """The boundary before ``step`` (the next step to train)."""

    step: int
    adopted: bool = False  # actors started in the background answered at this boundary


@dataclass(frozen=True)
class Stop:
    """Commit the step just trained and finish (a stop signal)."""


@dataclass(frozen=True)
class ResizeTo:
    """A requested resize to ``dp`` (started actors are added first if the live ones are too few)."""

    dp: int


@dataclass(frozen=True)
class Evacuate:
    """A draining node: resume from the snapshots that cover the state without it, the save owed
    (``notice.from_snapshots``), or else commit first; drop its actors, re-form without them."""

    notice: Preemption
    decision: ResizeDecision | TooFewWorkers


@dataclass(frozen=True)
class Evict:
    """Drop stragglers: commit, kill them, re-form from the others."""

    actors: frozenset[int]
    decision: ResizeDecision


@dataclass(frozen=True)
class Grow:
    """The live actors hold more whole replicas than the mesh: commit, form the larger mesh."""

    decision: ResizeDecision


Decision = Stop | ResizeTo | Evacuate | Evict | Grow
