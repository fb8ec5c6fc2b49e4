"""Controller: the elastic control loop as an explicit state machine (driver side; no Ray, no torch).

``step()`` makes exactly one transition (or trains one step while RUNNING), so tests drive it and
assert the state after each call — with a fake worker group (``tests/unit/test_controller.py``, whose
docstring lists the test of each transition) or with real actors (``tests/ray``):

    INITIALIZING -> RUNNING      generation 1 formed (joined; resumed from the newest checkpoint)
    INITIALIZING -> REBUILDING   forming generation 1 lost a member
    INITIALIZING -> ERRORED      forming generation 1 broke with nobody lost
    RUNNING -> RUNNING           a step trained; or a planned resize / grow at the step boundary
    RUNNING -> FINISHED          ``train.steps`` done, the last checkpoint committed
    RUNNING -> REBUILDING        a step failed (a rank died, hung, latched an error, or timed out)
    RUNNING -> ERRORED           the restart budget is spent, or checkpoint storage failed
    REBUILDING -> RUNNING        a new generation formed from the live actors
    REBUILDING -> REBUILDING     forming it lost a member (joining or loading): try again
    REBUILDING -> ERRORED        below ``elastic.min_dp``, the budget spent, or broke with nobody lost

A generation is one formed mesh: which actor holds which world rank. On a failure the driver frees the
survivors (``orchestrator.recovery.settle``), bumps the generation, re-plans the mesh from the live actors,
has them re-form groups *in the same processes*, and reloads the newest state resharded into the new
mesh: the in-memory snapshots when every shard has a live copy, else the newest committed checkpoint
(``orchestrator.saves.snapshots``). A failure while a generation forms takes the same path; it is retried.

Decisions are data: ``orchestrator.recovery.failure_policy.FailurePolicy`` answers a failure with ``Rebuild``
or ``Raise``; ``orchestrator.control.scaling.ScalingPolicy`` answers with ``ResizeDecision``, ``NoResize`` or
``TooFewWorkers``. The controller carries them out. Everything it needs of the cluster goes through
the worker group (calls, kills, the capacity probe ``free_slots``).
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from meshspeak.mesh import MeshShape
from meshspeak.messages import CallOutcome, JoinSpec, RuntimeSpec, StepResult
from meshspeak.sections import JobConfig
from orchestrator.cluster.store_provider import FixedStore, StoreSource
from orchestrator.control.boundary_exits import BoundaryExits
from orchestrator.control.evaluation import Evaluator
from orchestrator.control.generation import GenerationRecord, RunSummary, State, runtime_spec
from orchestrator.control.rank_health import RankHealth
from orchestrator.control.rebalance import Rebalancer
from orchestrator.control.scaling import ResizeDecision, ScalingPolicy, carry_out
from orchestrator.errors import TrainingFailed, WorkerGroupStartupError
from orchestrator.metrics import MetricsLog, step_record
from orchestrator.plan.mesh_plan import MeshPlan, make_plan
from orchestrator.plan.placement import place_ranks
from orchestrator.recovery.failure_policy import FailurePolicy, Phase, Raise, diagnose
from orchestrator.recovery.preemption import PreemptionWatcher
from orchestrator.recovery.settle import settle
from orchestrator.saves.checkpointing import CheckpointCoordinator, RestoreFailed
from orchestrator.saves.snapshots import SnapshotCoordinator

if TYPE_CHECKING:  # the Ray-backed group; tests drive the controller with a fake one
    from orchestrator.cluster.worker_group import WorkerGroup

logger = logging.getLogger(__name__)


class Controller(RankHealth, BoundaryExits):
    def __init__(
        self,
        cfg: JobConfig,
        worker_group: WorkerGroup,
        *,
        metrics: MetricsLog,
        store_address: tuple[str, int] | StoreSource,
        use_gpu: bool,
        data_path: str,
        clock: Callable[[], float] = time.monotonic,
        eval_path: str = "",
        eval_mask_eos_id: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.group = worker_group
        self.metrics = metrics
        # Asked at every formation: the provider re-hosts a store that died (orchestrator/cluster/store_provider.py).
        self.store = store_address if isinstance(store_address, StoreSource) else FixedStore(store_address)
        self.use_gpu = use_gpu
        self.data_path = data_path  # resolved by the caller (absolute; actors may run elsewhere)
        self.clock = clock
        from meshdata.masks import mask_eos_for  # data.mask_document_boundaries -> an EOS id or None

        self.mask_eos_id = mask_eos_for(cfg.data)
        self.evaluator = Evaluator(cfg, eval_path, eval_mask_eos_id)  # [eval]: held-out loss between steps
        self.state = State.INITIALIZING
        self.run_id = uuid.uuid4().hex[:8]
        # Before every rendezvous key; handed to the ranks only inside Ray calls (messages.JoinSpec).
        self._store_secret = secrets.token_hex(16)
        self.generation: GenerationRecord | None = None
        self.next_step = 1
        self.losses: dict[int, float] = {}
        self.error: TrainingFailed | None = None
        self.ckpt = CheckpointCoordinator(cfg, metrics)
        self._init_rank_health()  # bad steps, stragglers, spares (orchestrator/control/rank_health.py)
        self.snapshots = SnapshotCoordinator(cfg, metrics)  # checkpoint.memory_every (orchestrator/saves/snapshots.py)
        self.scaling = ScalingPolicy(cfg)
        self.rebalance = Rebalancer(cfg, metrics)  # elastic.rebalance: each step's microbatch split
        self.failures = FailurePolicy(cfg.elastic.max_restarts)
        self._failure_at: float | None = None  # when the current recovery (or planned resize) began
        self._pending_rebuild_event: dict | None = None  # emitted with the first step it trains
        self._last_grow_check = clock()
        self.preemptions = PreemptionWatcher(cfg.elastic.drain_poll_s)
        self._preempted: set[int] = set()  # actors on nodes announced as draining
        self.resize_requests: dict[int, int] = {}  # step -> dp: resize at that step boundary (tests, ops)
        self.step_hooks: list = []  # callables(controller, step) run before each step (fault injection)
        self.stop_requested: Callable[[], bool] = lambda: False  # a signal asked to stop (launch.py)
        self.resume_step: int | None = None

    @property
    def restarts(self) -> int:
        return self.failures.restarts

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> RunSummary:
        while self.state not in (State.FINISHED, State.ERRORED):
            self.step()
        self.ckpt.close()
        if self.state == State.ERRORED:
            raise self.error
        return self.summary()

    def summary(self) -> RunSummary:
        return RunSummary(
            final_step=self.next_step - 1,
            generations=self.generation.number if self.generation else 0,
            restarts=self.restarts,
            losses=dict(self.losses),
            pids=dict(self.group.pids),
            resume_step=self.resume_step,
        )

    def step(self) -> State:
        try:
            if self.state == State.INITIALIZING:
                self._form(self.scaling.start())
            elif self.state == State.REBUILDING:
                self._form(carry_out(self.scaling.after_failure(len(self.group.live_ids))))
            elif self.state == State.RUNNING:
                self._running()
        except TrainingFailed as exc:
            self.error = exc
            self.state = State.ERRORED
        return self.state

    def _running(self) -> None:
        step = self.next_step
        if step > self.cfg.train.steps:
            self.ckpt.finish(self.group, self.generation, step - 1)
            self.metrics.event("done", step=step - 1)
            self.state = State.FINISHED
            return
        if self.stop_requested():
            self._stop(step - 1)
            return
        for hook in self.step_hooks:
            hook(self, step)
        if step in self.resize_requests:
            self._resize_requested(self.resize_requests.pop(step))
            return
        adopted = self._adopt_started()
        if self._preempted_at(step) or self._evict_stragglers(step):
            return
        if self._grow_due() or adopted:
            self._refill_spares()  # spares first: a grow never takes them (orchestrator/control/scaling.py)
            self._adopt_new_actors()
            decision = self.scaling.grow(self.generation.shape.dp, len(self.group.live_ids))
            if isinstance(decision, ResizeDecision):
                self._begin_resize()
                self._form(decision)
                return
        if self.bad_steps.is_skipped(step):  # skipped before a rollback or resume: the same choice again
            self.metrics.event("bad_step", step=step, reason="recorded")
            self.next_step = step + 1
            self.ckpt.after_step(self.group, self.generation, step)
            return
        outcome = self._train_step(step)
        results = list(outcome.results.values())
        if outcome.ok and all(r.ok for r in results):
            if self._bad_step(step, results):
                return
            self._record(step, results)
            self.next_step = step + 1
            self.ckpt.after_step(self.group, self.generation, step)
            self.snapshots.after_step(self.group, self.generation, step)
            if self.evaluator.due(step):
                failed = self.evaluator.run(self, step)
                if failed is not None:
                    self._fail(Phase.STEP, failed)
            return
        self._fail(Phase.STEP, outcome, results)

    # -- steps ------------------------------------------------------------------------------------
    def _train_step(self, step: int) -> CallOutcome:
        gen = self.generation
        args = self.rebalance.step_args(step)  # the plan's lists, or per replica (control/rebalance.py)
        refs = self.group.submit(list(gen.members.values()), "train_step", args)
        return self.group.collect(refs, self.cfg.elastic.step_timeout_s, stop_early=_step_broken)

    def _record(self, step: int, results: list[StepResult]) -> None:
        gen = self.generation
        record = step_record(step, results, train=self.cfg.train, seq_len=self.cfg.model.seq_len,
                             shape=gen.shape, generation=gen.number)
        self.losses[step] = record["loss"]
        self.metrics.step(record)
        self.metrics.timeline(step, results)
        self._score_stragglers(results)
        self.rebalance.observe(step, results)
        self._emit_rebuild_event()

    def _emit_rebuild_event(self) -> None:
        """The rebuild / grow event goes out with the generation's first step (recovery_s then covers
        the failure or resize to training again), or when the next recovery begins before it."""
        event, self._pending_rebuild_event = self._pending_rebuild_event, None
        if event is not None:
            if self._failure_at is not None:
                event["recovery_s"] = self.clock() - self._failure_at
            self.metrics.event(event.pop("kind"), **event)
            self._failure_at = None

    def _recovery_begins(self) -> None:
        self._emit_rebuild_event()
        self._failure_at = self.clock()

    # -- failures (one path for every phase) ------------------------------------------------------
    def _fail(self, phase: Phase, outcome: CallOutcome, results: list[StepResult] = ()) -> None:
        """Something broke in ``phase``: free the survivors, record the failure, carry out the policy's
        decision (REBUILDING, or raise the error it carries)."""
        gen = self.generation
        if not phase.forming or self._failure_at is None:
            self._recovery_begins()  # a failed formation is part of the recovery under way
        found = settle(self.group, outcome, list(gen.members.values()), listeners=self._listeners(),
                       wait_s=self.cfg.elastic.collective_timeout_s + 5, hang_reason=phase.hang_reason())
        # Forming broke with nobody lost: if the store died, the next formation re-hosts it (not a bug).
        store_lost = phase.forming and not found.lost and not self.store.healthy()
        failure = diagnose(phase, step=self.next_step, generation=gen.number, members=gen.members,
                           found=found, results=results, step_timeout_s=self.cfg.elastic.step_timeout_s,
                           store_lost=store_lost, preempted=frozenset(self._preempted))
        self.metrics.event("failure", step=failure.step, ranks=list(failure.ranks), reason=failure.reason)
        self.ckpt.abandon_pending()  # a save in flight dies with its generation (none while forming)
        self.snapshots.settle(self.group)  # a snapshot whose holders all acked still counts
        decision = self.failures.decide(failure)
        if isinstance(decision, Raise):
            raise decision.error
        self.state = State.REBUILDING

    def _listeners(self) -> dict[int, tuple[tuple[str, int], ...]]:
        """Actor id -> gloo listening endpoints in the current generation, as far as reported."""
        return {actor: info.gloo_listeners for actor, info in self.generation.infos.items()}

    # -- planned resizes --------------------------------------------------------------------------
    def _begin_resize(self) -> None:
        """Before a planned resize: commit a checkpoint of the current step (finishing any save in
        flight first) so the next generation resumes exactly here."""
        self._recovery_begins()
        self.ckpt.save_now(self.group, self.generation, self.next_step - 1)

    def _resize_requested(self, dp: int) -> None:
        """A requested dp larger than the live actors allow starts the missing actors first (as a
        replacement would); if they cannot be placed, the largest feasible dp the live ones allow."""
        self._begin_resize()
        missing = self.scaling.missing_for(dp, len(self.group.live_ids))
        if missing > 0:
            try:
                self.group.add(missing, wait_s=self.cfg.resources.placement_timeout_s)
            except WorkerGroupStartupError as exc:
                logger.warning("resize to dp=%d: %s", dp, exc)
        self._form(carry_out(self.scaling.requested(dp, len(self.group.live_ids))))

    def _grow_due(self) -> bool:
        now = self.clock()
        if now - self._last_grow_check < self.cfg.elastic.grow_check_s:
            return False
        self._last_grow_check = now
        return True

    def _adopt_new_actors(self) -> None:
        """Start actors on resources that appeared (autoscaler, replacement node), never blocking."""
        count = self.scaling.actors_to_adopt(len(self.group.live_ids) + self.group.starting, self.group.free_slots)
        if count:
            try:  # taken in by _adopt_started once they answer: the next grow check uses them
                self.group.start_background(count)
            except Exception as exc:  # resources vanished again: try at the next check
                logger.info("grow: could not start actors yet (%s)", exc)

    # -- generations ------------------------------------------------------------------------------
    def _form(self, decision: ResizeDecision) -> None:
        """Form the next generation at ``decision.dp`` from the live actors and resume it from the
        newest committed checkpoint; RUNNING when it worked, else the failure path."""
        previous = self.generation
        number = (previous.number + 1) if previous else 1
        plan = make_plan(self.cfg, decision.dp)
        members, spares = _assign(self.group.live_ids, self.group.node_ips, plan.shape)
        self._spares_formed(number, members, spares)
        spec = self._runtime_spec(plan)
        host, port = self.store.address()
        args = {
            actor: (JoinSpec(number, plan.shape, rank, host, port, f"{self.run_id}-gen{number}",
                             store_secret=self._store_secret), spec)
            for rank, actor in members.items()
        }
        if spares:
            self.group.call(spares, "leave_generation", timeout_s=30.0)
        refs = self.group.submit(list(members.values()), "join_generation", args)
        outcome = self.group.collect(refs, self.cfg.elastic.rebuild_timeout_s, stop_early=_join_broken)
        self.generation = GenerationRecord(number, plan, members, infos=dict(outcome.results))
        if not outcome.ok:
            self._fail(Phase.JOINING, outcome)
            return
        try:  # in-memory snapshots when every shard has a live copy, else the newest checkpoint
            restored = self.snapshots.restore_best(self.group, self.generation, self.ckpt)
        except RestoreFailed as exc:
            self._fail(Phase.LOADING, exc.outcome)
            return
        self.snapshots.begin_generation(self.group, self.generation)
        self.rebalance.begin(self.generation)
        self.next_step = restored.step + 1
        event = {"kind": "rebuild" if decision.reason != "grow" else "grow", "generation": number,
                 "dp": plan.shape.dp, "pp": plan.shape.pp, "tp": plan.shape.tp,
                 "dp_replicate": spec.dp.replicate, "resumed_from_step": restored.step,
                 "restored_from": restored.source, "restore_s": round(restored.load_s, 4),
                 "reason": decision.reason, "spares": len(spares)}
        if decision.reason == "start":
            self.metrics.event("start", **{k: v for k, v in event.items() if k != "kind"})
        else:
            self._pending_rebuild_event = event
        self.state = State.RUNNING
        self._refill_spares()

    def _runtime_spec(self, plan: MeshPlan) -> RuntimeSpec:
        resuming = self.ckpt.resume_point() is not None
        snapshot = self.snapshots.active and self.snapshots.usable(set(self.group.live_ids)) is not None
        return runtime_spec(self.cfg, plan, data_path=self.data_path, use_gpu=self.use_gpu,
                            mask_eos_id=self.mask_eos_id, resuming=resuming, load_follows=resuming or snapshot)


def _assign(live: list[int], node_ips: dict[int, str], shape: MeshShape) -> tuple[dict[int, int], list[int]]:
    """World rank -> actor id for ``shape.world`` of the live actors, and the spares: TP groups inside
    a node, then PP, then DP across nodes (orchestrator/plan/placement.py)."""
    ordered = place_ranks(live, node_ips, shape).order
    return {rank: ordered[rank] for rank in range(shape.world)}, ordered[shape.world:]


def _step_broken(o: CallOutcome) -> bool:
    # Stop waiting as soon as an actor died or a rank latched an error: survivors are then
    # blocked in a collective and must be freed now, not after the timeout.
    return bool(o.dead or o.failed) or any(not r.ok for r in o.results.values())


def _join_broken(o: CallOutcome) -> bool:
    # A member that died or failed to join leaves the others blocked in the rendezvous.
    return bool(o.dead or o.failed)
