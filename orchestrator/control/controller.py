"""Controller: the elastic control loop as explicit states that carry their data (driver side; no Ray,
no torch; as Ray Train v2's controller).

The controller holds two things: the driver context (control/context.py: the worker group, metrics,
checkpoints, snapshots, spares, window, recovery clock, progress, policies) and the current state
(control/states.py). ``advance()`` hands both to the state's handler (control/handlers/: one module
per state, none of which knows the controller), which returns the next state; ``_set_state`` is the
only place that assigns it, and ``advance()`` answers the new state's kind, so tests drive the loop
one transition at a time and assert after each call — with a fake worker group
(``tests/unit/test_controller.py``, whose docstring lists the test of each transition) or with real
actors (``tests/ray``):

    FORMING -> RUNNING          the generation formed (joined; resumed from the newest snapshot or
                                checkpoint); at the start, or after a planned resize, eviction,
                                preemption or grow (whose step is committed first)
    FORMING -> REBUILDING       forming it lost a member (or the pre-resize save lost one)
    FORMING -> ERRORED          it broke with nobody lost, or too few actors are left
    RUNNING -> RUNNING          a step trained (the oldest of the steps in flight: control/window.py)
    RUNNING -> DRAINING         a boundary decided with steps in flight: they are read first
    RUNNING -> FORMING          a boundary decider asked for a planned re-form (control/boundary.py)
    RUNNING -> FINISHED         ``train.steps`` done, or a stop signal: the last step committed
                                (FINISHING, passed through: handlers/finished.py)
    RUNNING -> REBUILDING       a step failed (a rank died, hung, latched an error, or timed out)
    RUNNING -> ERRORED          the restart budget is spent, or checkpoint storage failed
    DRAINING -> (as RUNNING)    the last step in flight read, the held decision is carried out
    REBUILDING -> RUNNING       a new generation formed from the live actors (or DRAINING: a decision
                                the failure interrupted is taken again)
    REBUILDING -> REBUILDING    forming it lost a member (joining or loading): try again
    REBUILDING -> ERRORED       below ``elastic.min_dp``, the budget spent, or broke with nobody lost

Every "-> REBUILDING" and "-> ERRORED" after a broken call passes through RECOVERING within the same
``advance()`` (handlers/recovering.py: the survivors are freed, the failure decided). No handler
raises for a failure: an error is the ERRORED state it returns (handlers/errored.py). FINISHED and
ERRORED are terminal: ``run()`` answers the finished run's summary or raises the error
(``handlers.OUTCOMES``).

A generation is one formed mesh: which actor holds which world rank. On a failure the driver frees the
survivors (``orchestrator.recovery.settle``), bumps the generation, re-plans the mesh from the live actors,
has them re-form groups *in the same processes*, and reloads the newest state resharded into the new
mesh: the in-memory snapshots when every shard has a live copy, else the newest committed checkpoint
(``orchestrator.saves.snapshots``). A failure while a generation forms takes the same path.

Decisions are data: ``FailurePolicy`` answers a failure with ``Rebuild`` or ``Raise``; ``ScalingPolicy``
with ``ResizeDecision``, ``NoResize`` or ``TooFewWorkers``; the boundary's deciders with a ``Decision``.
Everything the controller needs of the cluster goes through the worker group
(``orchestrator.cluster.group_protocol.WorkerGroupLike``), every call named through ``RankCalls``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from meshspeak.sections import JobConfig
from orchestrator.cluster.group_protocol import WorkerGroupLike
from orchestrator.cluster.store_provider import StoreSource
from orchestrator.control.context import DriverContext, StepHook, build_context
from orchestrator.control.generation import GenerationRecord, RunSummary
from orchestrator.control.handlers import HANDLERS, OUTCOMES
from orchestrator.control.handlers.finished import outcome as finished_outcome
from orchestrator.control.states import ControllerState, Errored, Finished, Forming, State
from orchestrator.control.window import DEFAULT_SIZE
from orchestrator.errors import TrainingFailed
from orchestrator.metrics import MetricsLog
from orchestrator.saves.checkpointing import CheckpointCoordinator
from orchestrator.saves.snapshots import Restored, SnapshotCoordinator

logger = logging.getLogger(__name__)

__all__ = ["Controller", "RunSummary", "State"]


class Controller:
    def __init__(
        self,
        cfg: JobConfig,
        worker_group: WorkerGroupLike,
        *,
        metrics: MetricsLog,
        store_address: tuple[str, int] | StoreSource,
        use_gpu: bool,
        data_path: str,
        clock: Callable[[], float] = time.monotonic,
        eval_path: str = "",
        eval_mask_eos_id: int | None = None,
        steps_in_flight: int = DEFAULT_SIZE,
    ) -> None:
        self.context: DriverContext = build_context(
            cfg, worker_group, metrics=metrics, store_address=store_address, use_gpu=use_gpu,
            data_path=data_path, clock=clock, eval_path=eval_path, eval_mask_eos_id=eval_mask_eos_id,
            steps_in_flight=steps_in_flight)
        self.context.inputs.hook_subject = self  # step hooks are called with the controller
        self.handlers = dict(HANDLERS)  # state type -> its handler (state, context) -> next state
        self.state: ControllerState = Forming(self.context.scaling.start())

    # -- the inputs callers set -------------------------------------------------------------------
    @property
    def resize_requests(self) -> dict[int, int]:
        """step -> dp: resize at that step boundary (tests, operators)."""
        return self.context.inputs.resize_requests

    @resize_requests.setter
    def resize_requests(self, requests: dict[int, int]) -> None:
        self.context.inputs.resize_requests = requests

    def add_step_hook(self, hook: Callable[[Controller, int], None], steps: Iterable[int] | None = None) -> None:
        """Run ``hook(controller, step)`` at the boundary before ``step``, once every step before it was
        read (fault injection: tests, bench/chaos.py; the hook acts through ``controller.group`` and
        reads what callers read below). ``steps``: only before those steps. The steps in flight are
        drained before each step a hook runs at (control/window.py): a hook at every step stops the
        pipelining, so name the steps where you can."""
        due = None if steps is None else frozenset(steps)
        self.context.inputs.step_hooks.append(StepHook(hook, due))

    @property
    def stop_requested(self) -> Callable[[], bool]:
        return self.context.inputs.stop_requested

    @stop_requested.setter
    def stop_requested(self, asked: Callable[[], bool]) -> None:  # a signal asked to stop (launch.py)
        self.context.inputs.stop_requested = asked

    # -- what callers read ------------------------------------------------------------------------
    @property
    def cfg(self) -> JobConfig:
        return self.context.cfg

    @property
    def group(self) -> WorkerGroupLike:
        return self.context.group

    @property
    def metrics(self) -> MetricsLog:
        return self.context.metrics

    @property
    def generation(self) -> GenerationRecord | None:
        return self.context.generation

    @property
    def ckpt(self) -> CheckpointCoordinator:
        return self.context.checkpoints

    @property
    def snapshots(self) -> SnapshotCoordinator:
        return self.context.snapshots

    @property
    def last_restore(self) -> Restored | None:
        return self.context.last_restore

    @property
    def restarts(self) -> int:
        return self.context.failures.restarts

    @property
    def next_step(self) -> int:
        return self.context.progress.next_step

    @property
    def losses(self) -> dict[int, float]:
        return self.context.progress.losses

    @property
    def error(self) -> TrainingFailed | None:
        return self.state.error if isinstance(self.state, Errored) else None

    @property
    def spare_ids(self) -> list[int]:
        return self.context.spares.ids

    @property
    def bad_steps(self):
        return self.context.health.bad_steps

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> RunSummary:
        """Advance to a terminal state; the finished run's summary, or its error raised."""
        try:
            while not self.state.is_terminal:
                self.advance()
        finally:  # any exit, not only a finished or failed run: the purger thread and a temp checkpoint root
            self.context.checkpoints.close()
        return OUTCOMES[type(self.state)](self.state, self.context)

    def summary(self) -> RunSummary:
        """What the run answers so far (as if it finished now)."""
        return finished_outcome(Finished(self.context.progress.next_step - 1), self.context)

    def advance(self) -> State:
        """One transition of the control loop (not a training step: Running's handler reads one step):
        the current state's handler returns the next state, whose kind is returned. A state that
        passes through (Recovering, Finishing) is handled at once, within the same call."""
        state = self.state
        while True:
            state = self.handlers[type(state)](state, self.context)
            if not state.passes_through:
                break
        self._set_state(state)
        return state.kind

    def _set_state(self, state: ControllerState) -> None:
        self.state = state
        if state.is_terminal:  # nothing more is saved: give the run lease back now
            self.context.checkpoints.close()
