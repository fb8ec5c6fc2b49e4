"""The controller's states: each one carries the data its handler needs (pure; as Ray Train v2's
``controller/state.py``).

``Controller.advance()`` hands the current state and the driver context to the state's handler (one
module per state under ``orchestrator/control/handlers/``), which returns the next state; only the
controller assigns it (orchestrator/control/controller.py). ``State`` names the kinds, so a caller
(the tests, the loop) can compare ``controller.advance() == State.RUNNING``.

    Forming(decision, save_first, drop)  form the next generation at ``decision.dp`` — at the start,
                                          or after a planned resize, eviction, preemption or grow was
                                          decided at a step boundary (``save_first``: commit the
                                          boundary's step first; ``drop``: actors to kill after that)
    Running                              train steps; at each boundary the deciders may end it
    Draining(decision, stale)            train the steps already in flight, sending none: a decision
                                          taken at a boundary with steps in flight waits for them
                                          (``stale``: a failure or rollback ended them meanwhile, so
                                          the decision is taken again against the live actors)
    Recovering(phase, outcome)           a call broke: free the survivors and decide (passed through
                                          within the same ``advance()``: its survivors are blocked
                                          until freed, so nothing waits between the two)
    Rebuilding(failure)                  a failure was decided as a rebuild: re-plan from the live
                                          actors and form again
    Finishing(step, stopped)             ``train.steps`` done, or a stop signal (``stopped``): the last
                                          step is committed (passed through within the same
                                          ``advance()``: handlers/finished.py)
    Finished(step)                       the run ended at ``step`` (terminal)
    Errored(error)                       the run stops with ``error``, returned by the handler that met it
                                          (terminal: exit 1, or the error's own code; handlers/errored.py)

A decision that waits in ``Draining`` outlives a failure: ``Recovering`` and ``Rebuilding`` carry it
(``draining``) to the formation, which returns it as a stale ``Draining``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

from meshspeak.messages import CallOutcome, StepResult
from orchestrator.control.decisions import Decision
from orchestrator.control.scaling import ResizeDecision, TooFewWorkers
from orchestrator.errors import TrainingFailed
from orchestrator.recovery.failure_policy import Failure, Phase


class State(StrEnum):
    """The kind of a controller state (what ``Controller.advance()`` returns)."""

    FORMING = "forming"
    RUNNING = "running"
    DRAINING = "draining"
    RECOVERING = "recovering"
    REBUILDING = "rebuilding"
    FINISHING = "finishing"
    FINISHED = "finished"
    ERRORED = "errored"


class _Kind:
    kind: ClassVar[State]
    is_terminal: ClassVar[bool] = False
    passes_through: ClassVar[bool] = False  # handled within the same advance() as the state before it


@dataclass(frozen=True)
class Forming(_Kind):
    kind: ClassVar[State] = State.FORMING
    decision: ResizeDecision | TooFewWorkers  # TooFewWorkers: the run stops once the step is committed
    save_first: bool = False  # a planned re-form: commit the step just trained before anything else
    drop: frozenset[int] = field(default_factory=frozenset)  # actors to kill once that step is committed
    drop_event: str = ""  # an event to log when dropping them ("evict"), with the step and the actors
    # When the in-memory snapshot of that step has a copy of every shard on an actor that stays, the
    # new generation resumes from it exactly as from the save, which is skipped (a grow, a resize, an
    # eviction, a drain; a drain's is owed).
    snapshot_may_replace_save: bool = False
    owe_save: bool = False  # the save skipped so is owed: made at the new generation's first boundary


@dataclass(frozen=True)
class Running(_Kind):
    kind: ClassVar[State] = State.RUNNING


@dataclass(frozen=True)
class Draining(_Kind):
    kind: ClassVar[State] = State.DRAINING
    decision: Decision  # taken at the boundary after the newest step in flight
    stale: bool = False  # a failure or rollback ended those steps: take it again (boundary.refresh)


@dataclass(frozen=True)
class Recovering(_Kind):
    kind: ClassVar[State] = State.RECOVERING
    passes_through: ClassVar[bool] = True
    phase: Phase
    outcome: CallOutcome  # the broken call's outcome (``pending_refs``: calls still running)
    results: tuple[StepResult, ...] = ()  # a step's answers, for the errors they latched
    draining: Draining | None = None  # a decision waiting for the steps the failure ended


@dataclass(frozen=True)
class Rebuilding(_Kind):
    kind: ClassVar[State] = State.REBUILDING
    failure: Failure  # what broke; the new generation's formation logs what it recovers from
    draining: Draining | None = None


@dataclass(frozen=True)
class Finishing(_Kind):
    kind: ClassVar[State] = State.FINISHING
    passes_through: ClassVar[bool] = True
    step: int  # the last step trained
    stopped: bool = False  # a stop signal, not ``train.steps`` done


@dataclass(frozen=True)
class Finished(_Kind):
    kind: ClassVar[State] = State.FINISHED
    is_terminal: ClassVar[bool] = True
    step: int  # the last step trained (and committed, when checkpoint.dir is set)


@dataclass(frozen=True)
class Errored(_Kind):
    kind: ClassVar[State] = State.ERRORED
    is_terminal: ClassVar[bool] = True
    error: TrainingFailed


ControllerState = Forming | Running | Draining | Recovering | Rebuilding | Finishing | Finished | Errored


def after_reset(draining: Draining | None) -> Running | Draining:
    """The state once the steps in flight ended by a failure or a rollback: the decision waiting for
    them, if any, is taken again at the next boundary."""
    return Running() if draining is None else Draining(draining.decision, stale=True)
