"""The run's progress and the recovery under way: the data the controller's states act on (pure).

``Progress``: the next step to train, the losses logged, where a rerun resumes. ``RecoveryClock``: when
the current recovery (or planned resize) began, and the rebuild / grow event that goes out with the
new generation's first trained step, so that ``recovery_s`` covers the failure (or resize) to
training again; a recovery that begins before that step tells the event first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Progress:
    next_step: int = 1
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss (last record wins)
    resume_step: int | None = None  # set when stopped by a signal: the step a rerun starts with


class RecoveryClock:
    def __init__(self, metrics, clock: Callable[[], float]) -> None:
        self.metrics, self.clock = metrics, clock
        self.began_at: float | None = None
        self.pending_event: dict | None = None  # {"kind": "rebuild" | "grow", ...the event's fields}
        # Seconds from the recovery's start at which each phase ended (settled, joined, restored): where
        # a recovery's time went, in its rebuild / grow event as ``phases_s``.
        self.phases: dict[str, float] = {}

    @property
    def under_way(self) -> bool:
        return self.began_at is not None

    def begins(self) -> None:
        self.trained()
        self.began_at = self.clock()
        self.phases = {}

    def mark(self, phase: str) -> None:
        """``phase`` of the recovery under way ended now (a later mark of the same phase wins: a
        formation that fails and is tried again is part of the same recovery)."""
        if self.began_at is not None:
            self.phases[phase] = round(self.clock() - self.began_at, 4)

    def trained(self) -> None:
        """The generation trained a step (or the next recovery begins): the pending event goes out."""
        event, self.pending_event = self.pending_event, None
        if event is not None:
            if self.began_at is not None:
                event["recovery_s"] = self.clock() - self.began_at
                event["phases_s"] = dict(self.phases)
            self.metrics.event(event.pop("kind"), **event)
            self.began_at = None
