"""Controller: the elastic control loop as explicit states that carry their data (driver side; no Ray,
no torch; as Ray Train v2's controller).

``step()`` hands the current state (``orchestrator/control/states.py``) to its handler, which returns
the next one; ``step()`` is the only place that assigns it, and it answers the new state's kind, so
tests drive the loop one transition at a time and assert after each call — with a fake worker group
(``tests/unit/test_controller.py``, whose docstring lists the test of each transition) or with real
actors (``tests/ray``):

    FORMING -> RUNNING          the generation formed (joined; resumed from the newest snapshot or
                                checkpoint); at the start, or after a planned resize, eviction,
                                preemption or grow (whose step is committed first)
    FORMING -> REBUILDING       forming it lost a member (or the pre-resize save lost one)
    FORMING -> ERRORED          it broke with nobody lost, or too few actors are left
    RUNNING -> RUNNING          a step trained (the oldest of the steps in flight: control/window.py)
    RUNNING -> FORMING          a boundary decider asked for a planned re-form (control/boundary.py)
    RUNNING -> FINISHED         ``train.steps`` done (the last checkpoint committed), or a stop signal
    RUNNING -> REBUILDING       a step failed (a rank died, hung, latched an error, or timed out)
    RUNNING -> ERRORED          the restart budget is spent, or checkpoint storage failed
    REBUILDING -> RUNNING       a new generation formed from the live actors
    REBUILDING -> REBUILDING    forming it lost a member (joining or loading): try again
    REBUILDING -> ERRORED       below ``elastic.min_dp``, the budget spent, or broke with nobody lost

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
import secrets
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from meshspeak.messages import CallOutcome, StepResult
from meshspeak.sections import JobConfig
from orchestrator.cluster.store_provider import FixedStore, StoreSource
from orchestrator.control.boundary import (
    DECIDERS,
    Boundary,
    Decision,
    carry_out_decision,
    refresh,
)
from orchestrator.control.evaluation import Evaluator
from orchestrator.control.formation import form_generation, save_before_reform
from orchestrator.control.generation import GenerationRecord, RunSummary
from orchestrator.control.health import StepHealth, Verdict
from orchestrator.control.progress import Progress, Recovery
from orchestrator.control.rebalance import Rebalancer
from orchestrator.control.scaling import ResizeDecision, ScalingPolicy, carry_out
from orchestrator.control.spares import SparePool
from orchestrator.control.states import (
    TERMINAL,
    ControllerState,
    Errored,
    Finished,
    Forming,
    Rebuilding,
    Running,
    State,
)
from orchestrator.control.window import DEFAULT_SIZE, StepWindow
from orchestrator.errors import TrainingFailed
from orchestrator.metrics import MetricsLog, step_record
from orchestrator.recovery.failure_policy import FailurePolicy, Phase, Raise, diagnose
from orchestrator.recovery.hang_watch import HangWatch
from orchestrator.recovery.preemption import PreemptionWatcher
from orchestrator.recovery.settle import kicked_wait_s, settle
from orchestrator.saves.checkpointing import CheckpointCoordinator, RestoreFailed
from orchestrator.saves.snapshots import Restored, SnapshotCoordinator

if TYPE_CHECKING:
    from orchestrator.cluster.group_protocol import WorkerGroupLike

logger = logging.getLogger(__name__)

SETTLE_SNAPSHOTS_S = 5.0  # after a failure, how long the survivors' snapshot pushes may take to land

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
        from meshdata.masks import (
            mask_eos_for,  # data.mask_document_boundaries -> an EOS id or None
        )

        self.cfg = cfg
        self.group = worker_group
        self.metrics = metrics
        # Asked at every formation: the provider re-hosts a store that died (cluster/store_provider.py).
        self.store = store_address if isinstance(store_address, StoreSource) else FixedStore(store_address)
        self.use_gpu = use_gpu
        self.data_path = data_path  # resolved by the caller (absolute; actors may run elsewhere)
        self.clock = clock
        self.mask_eos_id = mask_eos_for(cfg.data)
        self.evaluator = Evaluator(cfg, eval_path, eval_mask_eos_id)  # [eval]: held-out loss between steps
        self.run_id = uuid.uuid4().hex[:8]
        # Before every rendezvous key; handed to the ranks only inside Ray calls (messages.JoinSpec).
        self.store_secret = secrets.token_hex(16)
        self.generation: GenerationRecord | None = None
        self.progress = Progress()
        self.window = StepWindow(steps_in_flight)  # steps sent and not yet read (control/window.py)
        self.hang_watch = HangWatch(cfg.elastic.hang_probe_factor, clock)  # probes a step that runs long
        self.last_restore: Restored | None = None
        self.recovery = Recovery(metrics, clock)
        self.ckpt = CheckpointCoordinator(cfg, metrics)
        self.snapshots = SnapshotCoordinator(cfg, metrics)  # checkpoint.memory_every (saves/snapshots.py)
        self.health = StepHealth(cfg, metrics, self.ckpt.skipped_steps)  # bad steps, stragglers
        self.spares = SparePool(cfg, worker_group, metrics)  # elastic.spares (control/spares.py)
        self.scaling = ScalingPolicy(cfg)
        self.rebalance = Rebalancer(cfg, metrics)  # elastic.rebalance: each step's microbatch split
        self.state: ControllerState = Forming(self.scaling.start())
        self.failures = FailurePolicy(cfg.elastic.max_restarts)
        self.preemptions = PreemptionWatcher(cfg.elastic.drain_poll_s)
        self.preempted: set[int] = set()  # actors on nodes announced as draining
        self._last_grow_check = clock()
        # Inputs from outside the loop, read at step boundaries:
        self.resize_requests: dict[int, int] = {}  # step -> dp: resize at that step boundary (tests, ops)
        # callables(controller, step) run at the boundary before a step, every step before it done
        # (fault injection); one with a ``steps`` attribute runs (and drains the window) only at those.
        self.step_hooks: list = []
        self.stop_requested: Callable[[], bool] = lambda: False  # a signal asked to stop (launch.py)
        self._handlers = {Forming: self._forming, Running: self._running, Rebuilding: self._rebuilding}

    # -- what callers read ------------------------------------------------------------------------
    @property
    def restarts(self) -> int:
        return self.failures.restarts

    @property
    def next_step(self) -> int:
        return self.progress.next_step

    @property
    def losses(self) -> dict[int, float]:
        return self.progress.losses

    @property
    def error(self) -> TrainingFailed | None:
        return self.state.error if isinstance(self.state, Errored) else None

    @property
    def spare_ids(self) -> list[int]:
        return self.spares.ids

    @property
    def bad_steps(self):
        return self.health.bad_steps

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> RunSummary:
        try:
            while not isinstance(self.state, TERMINAL):
                self.step()
        finally:  # any exit, not only a finished or failed run: the purger thread and a temp checkpoint root
            self.ckpt.close()
        if isinstance(self.state, Errored):
            raise self.state.error
        return self.summary()

    def summary(self) -> RunSummary:
        return RunSummary(
            final_step=self.progress.next_step - 1,
            generations=self.generation.number if self.generation else 0,
            restarts=self.restarts,
            losses=dict(self.progress.losses),
            pids=dict(self.group.pids),
            resume_step=self.progress.resume_step,
        )

    def step(self) -> State:
        """One transition: the current state's handler returns the next state (its kind is returned)."""
        try:
            state = self._handlers[type(self.state)](self.state)
        except TrainingFailed as exc:
            state = Errored(exc)
        self.state = state
        if isinstance(state, TERMINAL):  # nothing more is saved: give the run lease back now
            self.ckpt.close()
        return state.kind

    # -- FORMING, REBUILDING --------------------------------------------------------------------------
    def _forming(self, state: Forming) -> ControllerState:
        step = self.progress.next_step - 1
        if state.save_first:
            # A covered snapshot of ``step`` replaces its save (a save in flight still commits).
            only_pending = state.snapshot_may_replace_save and self.snapshots.covers(
                self.group, self.generation, step, without=state.drop)
            saved = save_before_reform(self, step, only_pending=only_pending)
            if saved is not None:
                return saved
        if state.drop:
            if state.drop_event:
                self.metrics.event(state.drop_event, step=step, actors=sorted(state.drop))
            self.group.kill(sorted(state.drop))  # before the node goes / the straggler trains on
        return self._form(carry_out(state.decision))

    def _rebuilding(self, state: Rebuilding) -> ControllerState:
        return self._form(carry_out(self.scaling.after_failure(len(self.group.live_ids))))

    def _form(self, decision: ResizeDecision) -> ControllerState:
        return form_generation(self, decision)

    # -- RUNNING ----------------------------------------------------------------------------------
    def _running(self, _: Running) -> ControllerState:
        """Read the oldest step in flight (sending the next ones first, as far as the window and the
        boundaries allow); with nothing in flight, the full step boundary comes first."""
        if not self.window.flights:
            state = self._boundary()
            if state is not None:
                return state
        self._top_up()
        flight, outcome = self.window.read_oldest(self.group, self.cfg.elastic.step_timeout_s, _step_broken,
                                                  self.hang_watch)
        results = list(outcome.results.values())
        if not (outcome.ok and all(r.ok for r in results)):
            return self.fail(Phase.STEP, self.window.broken(outcome), results)
        self.window.done()
        self.hang_watch.step_read()
        return self._trained(flight.step, results)

    def _boundary(self) -> ControllerState | None:
        """The boundary before the next step, nothing in flight: the end of the run, the hooks due, the
        actors that answered, the deciders (or the decision held while the window drained), a step
        replayed as a recorded skip; else the step is sent."""
        step = self.progress.next_step
        if step > self.cfg.train.steps:
            self.ckpt.finish_run(self.group, self.generation, step - 1)
            self.metrics.event("done", step=step - 1)
            return Finished(step - 1)
        decision, stale = self.window.take_held()
        if decision is not None and stale:
            decision = refresh(self, decision)  # a failure or rollback came between: actors may have changed
        if decision is None:
            for hook in self.step_hooks:
                if _due(hook, step):
                    hook(self, step)
            decision = self._decide(step)
        if decision is not None:
            return carry_out_decision(self, decision, step)
        if self.health.bad_steps.is_skipped(step):  # skipped before a rollback or resume: the same choice
            self.metrics.event("bad_step", step=step, reason="recorded")
            self.progress.next_step = step + 1
            self.ckpt.after_step(self.group, self.generation, step)
            return Running()
        self._send(step)
        return None

    def _top_up(self) -> None:
        """Send further steps while the window has room and nothing stands between them: a decision
        taken at such a boundary is held until the steps in flight are read (control/window.py)."""
        while len(self.window) < self.window.size and self.window.held is None:
            step = self.window.last + 1
            if self._barrier(step):
                return
            decision = self._decide(step)
            if decision is not None:
                self.window.held = decision
                return
            self._send(step)

    def _barrier(self, step: int) -> bool:
        """Whether ``step`` must wait until every step before it was read: the end, a requested resize,
        a hook due, a replayed skip, an eval or a checkpoint save after the step before. A save goes
        out only once its step was read good (never one of a step that broke or turns out bad), and
        before the next step changes the state."""
        return (step > self.cfg.train.steps or step in self.resize_requests
                or any(_due(hook, step) for hook in self.step_hooks) or self.health.bad_steps.is_skipped(step)
                or self.evaluator.due(step - 1) or self.ckpt.due(step - 1))

    def _decide(self, step: int) -> Decision | None:
        at = Boundary(step, adopted=self.spares.adopt_started())
        for decide in DECIDERS:
            decision = decide(self, at)
            if decision is not None:
                return decision
        return None

    def _send(self, step: int) -> None:
        """Send ``step`` to every member."""
        split = self.rebalance.orders_for(step)  # elastic.rebalance: a new split starts here (or None)
        self.window.send(self.group, list(self.generation.members.values()), step, self.snapshots.keep, split)

    def _trained(self, step: int, results: list[StepResult]) -> ControllerState:
        """Step ``step`` trained on every rank: record it (or its skip), then the boundary's saves."""
        self.progress.next_step = step + 1
        self.snapshots.after_results(results)
        verdict = self.health.verdict(step, results, restorable=self._restorable)
        if verdict is Verdict.ROLL_BACK:
            return self._roll_back(step)
        if verdict is Verdict.GOOD:
            self._record(step, results)
        self.ckpt.after_step(self.group, self.generation, step)
        if verdict is Verdict.SKIPPED:
            return Running()
        if self.evaluator.due(step):  # nothing in flight: the next step waits for it (``_barrier``)
            failed = self.evaluator.run(self.group, self.generation, self.metrics, step)
            if failed is not None:
                return self.fail(Phase.STEP, failed)
        return Running()

    def _restorable(self) -> bool:
        """Something to roll back to: a committed checkpoint, or a snapshot set with a live copy of
        every shard."""
        return self.ckpt.resume_point() is not None or self.snapshots.usable(set(self.group.live_ids)) is not None

    def _roll_back(self, step: int) -> ControllerState:
        """``train.max_bad_steps`` bad steps in a row: reload the newest snapshot (else checkpoint) in
        place; its replay skips the recorded steps. The steps in flight are read and dropped first."""
        broken = self.window.drain(self.group, self.cfg.elastic.step_timeout_s, _step_broken)
        if broken is not None:
            return self.fail(Phase.STEP, broken)
        self.ckpt.finish(self.group, self.generation, step)  # no save in flight while loading
        try:
            restored = self.snapshots.restore_best(self.group, self.generation, self.ckpt, at_most=step)
        except RestoreFailed as exc:
            return self.fail(Phase.LOADING, exc.outcome)
        self.metrics.event("rollback", step=step, resumed_from_step=restored.step, restored_from=restored.source,
                           skipped=sorted(self.health.bad_steps.skipped))
        self.window.reset(restored.step)
        self.progress.next_step = restored.step + 1
        return Running()

    def _record(self, step: int, results: list[StepResult]) -> None:
        gen = self.generation
        record = step_record(step, results, train=self.cfg.train, seq_len=self.cfg.model.seq_len,
                             shape=gen.shape, generation=gen.number)
        self.progress.losses[step] = record["loss"]
        self.metrics.step(record)
        self.metrics.timeline(step, results)
        self.health.score(results, gen.members, lambda rank: gen.shape.coords(rank).pp, self.group.node_ips)
        self.rebalance.observe(step, results)
        self.recovery.trained()

    def grow_due(self) -> bool:
        """Every ``elastic.grow_check_s``: time for the boundary's grow check."""
        now = self.clock()
        if now - self._last_grow_check < self.cfg.elastic.grow_check_s:
            return False
        self._last_grow_check = now
        return True

    # -- failures (one path for every phase) ------------------------------------------------------
    def fail(self, phase: Phase, outcome: CallOutcome, results: list[StepResult] = ()) -> Rebuilding:
        """Something broke in ``phase``: free the survivors, record the failure, carry out the policy's
        decision (Rebuilding, or raise the error it carries)."""
        gen = self.generation
        self.hang_watch.pause()  # the recovery is no step interval
        if not phase.forming or not self.recovery.under_way:
            self.recovery.begins()  # a failed formation is part of the recovery under way
        listeners = {actor: info.gloo_listeners for actor, info in gen.infos.items()}
        pace = self.hang_watch.pace_s() if phase is Phase.STEP else None  # a join or load has none
        wait_s = kicked_wait_s(self.cfg.elastic.collective_timeout_s + 5, pace)
        found = settle(self.group, outcome, list(gen.members.values()), listeners=listeners, wait_s=wait_s,
                       hang_reason=phase.hang_reason())
        self.recovery.mark("settled")
        # Forming broke with nobody lost: if the store died, the next formation re-hosts it (not a bug).
        store_lost = phase.forming and not found.lost and not self.store.healthy()
        failure = diagnose(phase, step=self.progress.next_step, generation=gen.number, members=gen.members,
                           found=found, results=results, step_timeout_s=self.cfg.elastic.step_timeout_s,
                           store_lost=store_lost, preempted=frozenset(self.preempted))
        self.metrics.event("failure", step=failure.step, ranks=list(failure.ranks), reason=failure.reason)
        self.ckpt.abandon_pending()  # a save in flight dies with its generation (none while forming)
        self.window.reset(self.window.after)  # whatever was in flight went to settle with the outcome
        self.snapshots.settle(self.group, gen, timeout_s=SETTLE_SNAPSHOTS_S)  # pushes under way may still land
        self.recovery.mark("snapshots_settled")
        decision = self.failures.decide(failure)
        if isinstance(decision, Raise):
            raise decision.error
        return Rebuilding(failure)


def _step_broken(o: CallOutcome) -> bool:
    # Stop waiting as soon as an actor died or a rank latched an error: survivors are then
    # blocked in a collective and must be freed now, not after the timeout.
    # An ``early`` answer is no failure: the window sends that step again (control/window.py).
    return bool(o.dead or o.failed) or any(not r.ok and not r.early for r in o.results.values())


def _due(hook, step: int) -> bool:
    steps = getattr(hook, "steps", None)
    return steps is None or step in steps
