"""The controller's states: each one carries the data its handler needs (pure; as Ray Train v2's
``controller/state.py``).

``Controller.step()`` hands the current state to its handler, which returns the next state; only the
controller's ``step()`` assigns it (orchestrator/control/controller.py). ``State`` names the kinds, so
a caller (the tests, the loop) can compare ``controller.step() == State.RUNNING``.

    Forming(decision, save_first, drop)  form the next generation at ``decision.dp`` — at the start,
                                          or after a planned resize, eviction, preemption or grow was
                                          decided at a step boundary (``save_first``: commit the
                                          boundary's step first; ``drop``: actors to kill after that)
    Running                              train steps; at each boundary the deciders may end it
    Rebuilding(failure)                  something broke: re-plan from the live actors and form again
    Finished(step)                       ``train.steps`` done, or stopped by a signal at ``step``
    Errored(error)                       the run stops with ``error`` (exit 1)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

from orchestrator.control.scaling import ResizeDecision
from orchestrator.errors import TrainingFailed
from orchestrator.recovery.failure_policy import Failure


class State(StrEnum):
    """The kind of a controller state (what ``Controller.step()`` returns)."""

    FORMING = "forming"
    RUNNING = "running"
    REBUILDING = "rebuilding"
    FINISHED = "finished"
    ERRORED = "errored"


@dataclass(frozen=True)
class Forming:
    kind: ClassVar[State] = State.FORMING
    decision: ResizeDecision
    save_first: bool = False  # a planned re-form: commit the step just trained before anything else
    drop: frozenset[int] = field(default_factory=frozenset)  # actors to kill once that step is committed
    drop_event: str = ""  # an event to log when dropping them ("evict"), with the step and the actors
    # No node is going: when the in-memory snapshot of that step has a copy of every shard on an
    # actor that stays, the new generation resumes from it exactly as from the save, which is skipped.
    snapshot_may_replace_save: bool = False


@dataclass(frozen=True)
class Running:
    kind: ClassVar[State] = State.RUNNING


@dataclass(frozen=True)
class Rebuilding:
    kind: ClassVar[State] = State.REBUILDING
    failure: Failure


@dataclass(frozen=True)
class Finished:
    kind: ClassVar[State] = State.FINISHED
    step: int  # the last step trained (and committed, when checkpoint.dir is set)


@dataclass(frozen=True)
class Errored:
    kind: ClassVar[State] = State.ERRORED
    error: TrainingFailed


ControllerState = Forming | Running | Rebuilding | Finished | Errored
TERMINAL = (Finished, Errored)
