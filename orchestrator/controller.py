"""Controller: the elastic control loop as explicit states (driver side; never imports torch.distributed).

INITIALIZING -> RUNNING <-> REBUILDING -> FINISHED | ERRORED. ``step()`` makes exactly one transition
(or runs one training step while RUNNING), so tests can drive it and assert the state after each call.

A generation is one formed mesh: which actor holds which world rank. On a failure the driver frees the
survivors (kills dead/hung actors, shuts their blocked gloo sockets: ``orchestrator.recovery``), bumps
the generation, re-plans the mesh from the live actors, has them re-form groups *in the same
processes*, and reloads the newest committed checkpoint resharded into the new mesh. A failure while a
generation forms (joining, loading) is handled the same way and the rebuild is retried.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from enum import StrEnum

import ray

from orchestrator.checkpointing import CheckpointCoordinator, RestoreFailed
from orchestrator.config import JobConfig, dp_bounds
from orchestrator.lr_schedule import lr_at
from orchestrator.errors import RebuildTimeoutError, TrainingFailed, WorkerGroupStartupError
from orchestrator.mesh import MeshShape
from orchestrator.messages import GenerationSpec, RankInfo, RuntimeSpec, StepResult
from orchestrator.metrics import MetricsLog, bubble_fraction
from orchestrator.plan import MeshPlan, make_plan
from orchestrator.policies import ResizeDecision, choose_dp, fit_dp, grow_target
from orchestrator.recovery import reason_line, settle
from orchestrator.store_provider import FixedStore, StoreSource
from orchestrator.worker_group import CallOutcome, WorkerGroup

logger = logging.getLogger(__name__)


class State(StrEnum):
    INITIALIZING = "initializing"
    RUNNING = "running"
    REBUILDING = "rebuilding"
    FINISHED = "finished"
    ERRORED = "errored"


@dataclass
class Generation:
    number: int
    plan: MeshPlan
    members: dict[int, int]  # world rank -> actor id
    infos: dict[int, RankInfo] = field(default_factory=dict)  # actor id -> what it reported

    @property
    def shape(self) -> MeshShape:
        return self.plan.shape


@dataclass
class RunSummary:
    final_step: int
    generations: int
    restarts: int
    losses: dict[int, float]  # step -> loss (last record wins)
    pids: dict[int, int]  # actor id -> pid, as of the end


class Controller:
    def __init__(
        self,
        cfg: JobConfig,
        worker_group: WorkerGroup,
        *,
        metrics: MetricsLog,
        store_address: tuple[str, int] | StoreSource,
        use_gpu: bool,
        data_path: str,
    ) -> None:
        self.cfg = cfg
        self.group = worker_group
        self.metrics = metrics
        # Asked at every rebuild: the provider re-hosts a store that died (orchestrator/store_provider.py).
        self.store = store_address if isinstance(store_address, StoreSource) else FixedStore(store_address)
        self.use_gpu = use_gpu
        self.data_path = data_path  # resolved by the caller (absolute; actors may run elsewhere)
        self.state = State.INITIALIZING
        self.run_id = uuid.uuid4().hex[:8]
        self.generation: Generation | None = None
        self.next_step = 1
        self.restarts = 0
        self.losses: dict[int, float] = {}
        self.error: TrainingFailed | None = None
        self.ckpt = CheckpointCoordinator(cfg, metrics)
        self._rebuild_reason = "start"
        self._failure_at: float | None = None  # when the current recovery began
        self._pending_rebuild_event: dict | None = None
        self._last_grow_check = time.monotonic()
        self.resize_requests: dict[int, int] = {}  # step -> dp: resize at that step boundary (tests, ops)
        self.step_hooks: list = []  # callables(controller, step) run before each step (fault injection)

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
        )

    def step(self) -> State:
        try:
            if self.state == State.INITIALIZING:
                self._rebuild(self.cfg.mesh.dp, "start")
            elif self.state == State.REBUILDING:
                self._rebuild_after_failure()
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
        for hook in self.step_hooks:
            hook(self, step)
        if step in self.resize_requests:
            self._resize(self.resize_requests.pop(step), "requested")
            return
        if self._maybe_grow(step):
            return
        outcome, results = self._train_step(step)
        if outcome.ok and all(r.ok for r in results):
            self._record(step, results)
            self.next_step = step + 1
            self.ckpt.after_step(self.group, self.generation, step)
            return
        self._on_failure(step, outcome, results)

    # -- steps ------------------------------------------------------------------------------------
    def _train_step(self, step: int) -> tuple[CallOutcome, list[StepResult]]:
        gen = self.generation
        actions = gen.plan.actions()
        args = {
            actor: (step, actions[gen.shape.coords(rank).pp]) for rank, actor in gen.members.items()
        }
        refs = self.group.submit(list(gen.members.values()), "train_step", args)

        def any_broken(o: CallOutcome) -> bool:
            # Stop waiting as soon as an actor died or a rank latched an error: survivors are then
            # blocked in a collective and must be freed now, not after the timeout.
            return bool(o.dead or o.failed) or any(not r.ok for r in o.results.values())

        outcome = self.group.collect(refs, self.cfg.elastic.step_timeout_s, stop_early=any_broken)
        return outcome, list(outcome.results.values())

    def _record(self, step: int, results: list[StepResult]) -> None:
        shape = self.generation.shape
        loss = sum(r.loss for r in results if r.loss is not None)
        wall = max(r.step_time_s for r in results)
        tokens = self.cfg.train.global_batch_size * self.cfg.model.seq_len
        self.losses[step] = loss
        self.metrics.step({
            "step": step, "loss": loss, "lr": lr_at(step, self.cfg.train), "tokens": tokens,
            "step_time_s": wall, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "dp": shape.dp, "pp": shape.pp, "tp": shape.tp, "generation": self.generation.number,
            "bubble": bubble_fraction(results),
        })
        self.metrics.timeline(step, results)
        if self._pending_rebuild_event is not None:
            event = self._pending_rebuild_event
            if self._failure_at is not None:
                event["recovery_s"] = time.monotonic() - self._failure_at
            self.metrics.event(event.pop("kind"), **event)
            self._pending_rebuild_event = None
            self._failure_at = None

    # -- failures ---------------------------------------------------------------------------------
    def _on_failure(self, step: int, outcome: CallOutcome, results: list[StepResult]) -> None:
        """A step broke: free the survivors (recovery.settle), record it, and go rebuild."""
        self._failure_at = time.monotonic()
        gen = self.generation
        rank_of = {actor: rank for rank, actor in gen.members.items()}
        found = settle(self.group, outcome, list(gen.members.values()), listeners=self._listeners(),
                       wait_s=self.cfg.elastic.collective_timeout_s + 5,
                       hang_reason="no progress within elastic.step_timeout_s")
        reasons = dict(found.reasons)
        for r in results:
            if not r.ok and r.error:
                reasons.setdefault(gen.members.get(r.world_rank, -1), r.error)
        if not reasons:  # everyone alive, answering, error-free: just slower than the bound
            reasons[-1] = (f"step {step} exceeded elastic.step_timeout_s={self.cfg.elastic.step_timeout_s:g} "
                           "with every rank alive: raise it if steps are legitimately this slow")
        # Name the ranks that were lost; only when none was (a latched error) the ones that errored.
        blamed = found.lost or set(reasons)
        self.metrics.event("failure", step=step, ranks=sorted(rank_of[a] for a in blamed if a in rank_of),
                           reason=reason_line(reasons))
        self.ckpt.abandon_pending()
        self._count_restart(
            TrainingFailed, f"giving up after {self.restarts} restarts (elastic.max_restarts="
            f"{self.cfg.elastic.max_restarts}); last failure at step {step}: raise "
            "elastic.max_restarts or look at the failure events in the metrics file")
        self._rebuild_reason = "failure"
        self.state = State.REBUILDING

    def _rebuild_failed(self, outcome: CallOutcome, stage: str) -> None:
        """A member died, hung or failed while generation ``self.generation`` was forming.

        Just another failure: free and drop whom it cost, then rebuild from the live actors. A
        rebuild that broke although nobody was lost is not elastic business (a bug, bad state): stop.
        """
        if self._failure_at is None:
            self._failure_at = time.monotonic()
        gen = self.generation
        rank_of = {actor: rank for rank, actor in gen.members.items()}
        found = settle(self.group, outcome, list(gen.members.values()), listeners=self._listeners(),
                       wait_s=self.cfg.elastic.collective_timeout_s + 5,
                       hang_reason=f"no answer within elastic.rebuild_timeout_s while {stage}")
        why = f"rebuild of generation {gen.number} failed while {stage}: {reason_line(found.reasons)}"
        self.metrics.event("failure", step=self.next_step,
                           ranks=sorted(rank_of[a] for a in found.lost if a in rank_of), reason=why)
        if not found.lost and self.store.healthy():
            raise TrainingFailed(why)  # (a dead store is re-hosted by the next rebuild's address())
        self._count_restart(
            RebuildTimeoutError, f"could not form generation {gen.number} within elastic.max_restarts="
            f"{self.cfg.elastic.max_restarts} tries ({why})")
        self._rebuild_reason = "failure"
        self.state = State.REBUILDING

    def _count_restart(self, error: type[TrainingFailed], message: str) -> None:
        self.restarts += 1
        if self.restarts > self.cfg.elastic.max_restarts:
            raise error(message)

    def _listeners(self) -> dict[int, tuple[tuple[str, int], ...]]:
        """Actor id -> gloo listening endpoints in the current generation, as far as reported."""
        return {actor: info.gloo_listeners for actor, info in self.generation.infos.items()}

    # -- generations ------------------------------------------------------------------------------
    def _rebuild_after_failure(self) -> None:
        decision = choose_dp(self.cfg, len(self.group.live_ids), "failure")
        if not isinstance(decision, ResizeDecision):
            raise TrainingFailed(decision.message)
        self._rebuild(decision.dp, "failure")

    def _resize(self, dp: int, reason: str) -> None:
        """Planned resize at a step boundary: commit a checkpoint of the current step, then rebuild."""
        self._failure_at = time.monotonic()
        self.ckpt.save_now(self.group, self.generation, self.next_step - 1)
        if reason == "requested":
            dp = self._fit_request(dp)
        self._rebuild(dp, reason)

    def _fit_request(self, dp: int) -> int:
        """A requested dp larger than the live actors allow starts the missing actors first (as a
        replacement would); if they cannot be placed, the largest feasible dp the live ones allow."""
        missing = dp * self.cfg.mesh.pp * self.cfg.mesh.tp - len(self.group.live_ids)
        if missing > 0:
            try:
                self.group.add(missing, wait_s=self.cfg.resources.placement_timeout_s)
            except WorkerGroupStartupError as exc:
                logger.warning("resize to dp=%d: %s", dp, exc)
        fitted = fit_dp(self.cfg, dp, len(self.group.live_ids))
        if fitted < 1:
            raise TrainingFailed(f"resize to dp={dp}: {len(self.group.live_ids)} live workers hold no "
                                 "whole replica that divides train.global_batch_size: add nodes")
        return fitted

    def _maybe_grow(self, step: int) -> bool:
        if time.monotonic() - self._last_grow_check < self.cfg.elastic.grow_check_s:
            return False
        self._last_grow_check = time.monotonic()
        self._adopt_new_actors()
        target = grow_target(self.cfg, self.generation.shape.dp, len(self.group.live_ids))
        if target is None:
            return False
        self._resize(target, "grow")
        return True

    def _adopt_new_actors(self) -> None:
        """Start actors on resources that appeared (autoscaler, replacement node), never blocking."""
        replica = self.cfg.mesh.pp * self.cfg.mesh.tp
        _, max_dp = dp_bounds(self.cfg)
        wanted = max_dp * replica - len(self.group.live_ids)
        if wanted <= 0:
            return
        free = ray.available_resources()
        bundle = self.group.bundle()
        fits = min(int(free.get(k, 0.0) // v) for k, v in bundle.items() if v > 0)
        # A lost node's bundles are re-placed by Ray on the node that replaces it: those resources
        # are not "available", yet they are ours to start actors in (WorkerGroup.add refills them).
        fits += len(self.group.placed_vacancies())
        count = min(wanted, fits)
        if count >= replica:
            try:
                self.group.add(count - count % replica, wait_s=10.0)
            except Exception as exc:  # resources vanished again: try at the next check
                logger.info("grow: could not start actors yet (%s)", exc)

    def _rebuild(self, dp: int, reason: str) -> None:
        previous = self.generation
        number = (previous.number + 1) if previous else 1
        plan = make_plan(self.cfg, dp)
        live = self.group.live_ids
        # Keep ranks of one replica together on a node: order by node, then age.
        ordered = sorted(live, key=lambda a: (self.group.node_ips.get(a, ""), a))
        members = {rank: ordered[rank] for rank in range(plan.shape.world)}
        spares = ordered[plan.shape.world:]
        spec = self._runtime_spec(plan)
        host, port = self.store.address()
        args = {
            actor: (GenerationSpec(number, plan.shape, rank, host, port, f"{self.run_id}-gen{number}"), spec)
            for rank, actor in members.items()
        }
        if spares:
            self.group.call(spares, "leave_generation", timeout_s=30.0)
        refs = self.group.submit(list(members.values()), "join_generation", args)

        def broken(o: CallOutcome) -> bool:
            # A member that died or failed to join leaves the others blocked in the rendezvous.
            return bool(o.dead or o.failed)

        outcome = self.group.collect(refs, self.cfg.elastic.rebuild_timeout_s, stop_early=broken)
        self.generation = Generation(number, plan, members, infos=dict(outcome.results))
        if not outcome.ok:
            self._rebuild_failed(outcome, "joining")
            return
        try:
            resumed = self.ckpt.restore(self.group, self.generation)
        except RestoreFailed as exc:
            self._rebuild_failed(exc.outcome, "loading the checkpoint")
            return
        self.next_step = resumed + 1
        event = {"kind": "rebuild" if reason != "grow" else "grow", "generation": number,
                 "dp": plan.shape.dp, "pp": plan.shape.pp, "tp": plan.shape.tp,
                 "resumed_from_step": resumed, "reason": reason, "spares": len(spares)}
        if reason == "start":
            self.metrics.event("start", **{k: v for k, v in event.items() if k != "kind"})
        else:
            self._pending_rebuild_event = event
        self.state = State.RUNNING

    def _runtime_spec(self, plan: MeshPlan) -> RuntimeSpec:
        return RuntimeSpec(
            model=self.cfg.model,
            train=self.cfg.train,
            data_path=self.data_path,
            zero=self.cfg.mesh.zero,
            layers_per_stage=plan.layers_per_stage,
            virtual_stages=plan.virtual_stages,
            collective_timeout_s=self.cfg.elastic.collective_timeout_s,
            use_gpu=self.use_gpu,
            async_checkpoint=self.cfg.checkpoint.async_write,
            fsdp_unit_mb=self.cfg.mesh.fsdp_unit_mb,
        )
