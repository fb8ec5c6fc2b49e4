"""The driver context: everything the controller's state handlers act on, built once per run (driver
side; no Ray, no torch).

Each state's handler (orchestrator/control/handlers/) takes its state and this context and returns
the next state; none of them knows the controller, which holds only the context and the current state
(orchestrator/control/controller.py). ``build_context`` makes each collaborator from its part of the
job's configuration: the worker group, the metrics log, the checkpoint and snapshot coordinators, the
spares, the steps in flight, the recovery clock, the progress and the policies that decide.

What changes as the run goes on is in a few named places: ``generation`` (the mesh formed now),
``last_restore``, ``progress``, the recovery clock, and the collaborators' own state.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from meshspeak.sections import JobConfig
from orchestrator.cluster.group_protocol import WorkerGroupLike
from orchestrator.cluster.store_provider import FixedStore, StoreSource
from orchestrator.control.evaluation import Evaluator
from orchestrator.control.generation import GenerationRecord
from orchestrator.control.health import StepHealth
from orchestrator.control.progress import Progress, RecoveryClock
from orchestrator.control.rebalance import Rebalancer
from orchestrator.control.scaling import ScalingPolicy, policy_for
from orchestrator.control.spares import SparePool
from orchestrator.control.window import DEFAULT_SIZE, StepWindow
from orchestrator.metrics import MetricsLog
from orchestrator.recovery.failure_policy import FailurePolicy
from orchestrator.recovery.hang_watch import HangWatch
from orchestrator.recovery.preemption import PreemptionWatcher
from orchestrator.saves.checkpointing import CheckpointCoordinator, coordinator_for
from orchestrator.saves.snapshots import Restored, SnapshotCoordinator


@dataclass(frozen=True)
class RunIdentity:
    """What every generation's join carries besides the mesh: the run's id (the store prefixes), the
    store secret (handed to the ranks only inside Ray calls, messages.JoinSpec), the data path
    (resolved by the caller: absolute, actors may run elsewhere), the device and the EOS id that
    ``data.mask_document_boundaries`` masks at (None: no masking)."""

    run_id: str
    store_secret: str
    data_path: str
    use_gpu: bool
    mask_eos_id: int | None


@dataclass(frozen=True)
class StepHook:
    """``call(subject, step)`` at the boundary before ``step``, every step before it done (fault
    injection: ``Controller.add_step_hook``); ``steps``: only before those (None: before every step)."""

    call: Callable[[object, int], None]
    steps: frozenset[int] | None = None

    def due(self, step: int) -> bool:
        return self.steps is None or step in self.steps


@dataclass
class BoundaryInputs:
    """Inputs from outside the loop, read at step boundaries."""

    resize_requests: dict[int, int] = field(default_factory=dict)  # step -> dp (tests, operators)
    step_hooks: list[StepHook] = field(default_factory=list)  # a hook due drains the window before its step
    hook_subject: object = None  # what a hook is called with: the controller (set by it)
    stop_requested: Callable[[], bool] = lambda: False  # a signal asked to stop (launch.py)

    def hook_due(self, step: int) -> bool:
        return any(hook.due(step) for hook in self.step_hooks)

    def run_hooks(self, step: int) -> None:
        for hook in self.step_hooks:
            if hook.due(step):
                hook.call(self.hook_subject, step)


# A grow decided while a checkpoint is still being written waits for the write: the save uses the
# generation's groups, which the re-form ends. Held instead for up to this many boundaries, training
# on meanwhile (a write takes under a step or two: 0.5-1.2 s for the chaos bench's 1 s steps); a write
# slower than that (slow storage) is then waited for, as before.
GROW_HOLD_STEPS = 3


class GrowCheck:
    """Every ``elastic.grow_check_s``: time for the boundary's grow check. A grow held while a save
    writes (``hold``) is checked again at every boundary until it is made, lapses, or a new generation
    forms (``release``)."""

    def __init__(self, every_s: float, clock: Callable[[], float]) -> None:
        self.every_s, self.clock = every_s, clock
        self._last = clock()
        self.held = 0  # boundaries in a row a grow was held at (counted, not stepped: a rollback goes back)

    def due(self) -> bool:
        if self.held:
            return True
        now = self.clock()
        if now - self._last < self.every_s:
            return False
        self._last = now
        return True

    def hold(self) -> bool:
        """Whether a grow decided at this boundary waits for the save being written: yes at up to
        ``GROW_HOLD_STEPS`` boundaries in a row, then no."""
        if self.held >= GROW_HOLD_STEPS:
            return False
        self.held += 1
        return True

    def release(self) -> None:
        """The grow was made, there is none to make, or a generation formed (what was held is decided
        afresh): the next check waits for ``grow_check_s``."""
        self.held = 0


@dataclass
class DriverContext:
    cfg: JobConfig
    group: WorkerGroupLike
    metrics: MetricsLog
    clock: Callable[[], float]
    store: StoreSource  # asked at every formation: the provider re-hosts a store that died
    identity: RunIdentity
    checkpoints: CheckpointCoordinator
    snapshots: SnapshotCoordinator  # checkpoint.memory_every (saves/snapshots.py)
    health: StepHealth  # bad steps, stragglers
    spares: SparePool  # elastic.spares (control/spares.py)
    scaling: ScalingPolicy
    rebalance: Rebalancer  # elastic.rebalance: each step's microbatch split
    evaluator: Evaluator  # [eval]: held-out loss between steps
    failures: FailurePolicy  # elastic.max_restarts
    preemptions: PreemptionWatcher  # elastic.drain_poll_s
    grow_check: GrowCheck  # elastic.grow_check_s
    window: StepWindow  # steps sent and not yet read (control/window.py)
    hang_watch: HangWatch  # probes a step that runs long
    recovery_clock: RecoveryClock
    progress: Progress = field(default_factory=Progress)
    inputs: BoundaryInputs = field(default_factory=BoundaryInputs)
    generation: GenerationRecord | None = None  # the mesh formed now
    last_restore: Restored | None = None  # what the newest formation or rollback resumed from
    # Survivors told to leave the broken generation as soon as they were freed (handlers/recovering.py):
    # their pending calls, waited for by the next formation (control/formation.py)
    leaving: dict = field(default_factory=dict)


def build_context(cfg: JobConfig, group: WorkerGroupLike, *, metrics: MetricsLog,
                  store_address: tuple[str, int] | StoreSource, use_gpu: bool, data_path: str,
                  clock: Callable[[], float] = time.monotonic, eval_path: str = "",
                  eval_mask_eos_id: int | None = None, steps_in_flight: int = DEFAULT_SIZE) -> DriverContext:
    """The context of one run on ``group``."""
    from meshdata.masks import mask_eos_for  # data.mask_document_boundaries -> an EOS id or None
    from meshmodels.family import family_ref

    store = store_address if isinstance(store_address, StoreSource) else FixedStore(store_address)
    identity = RunIdentity(run_id=uuid.uuid4().hex[:8], store_secret=secrets.token_hex(16),
                           data_path=data_path, use_gpu=use_gpu, mask_eos_id=mask_eos_for(cfg.data))
    coordinator = coordinator_for(cfg, metrics)  # checkpoint, elastic, and what manifests record of the job
    return DriverContext(
        cfg=cfg, group=group, metrics=metrics, clock=clock, store=store, identity=identity,
        checkpoints=coordinator,
        snapshots=SnapshotCoordinator(cfg.checkpoint, cfg.elastic, metrics, run_id=identity.run_id),
        # the skipped steps are one set: saved with the checkpoints and restored from them
        health=StepHealth(cfg.elastic, cfg.train.max_bad_steps, metrics, coordinator.skipped_steps),
        spares=SparePool(cfg.elastic.spares, group, metrics, family=family_ref(cfg.model)),
        scaling=policy_for(cfg),  # mesh and elastic, and the job's mesh rules (they span sections)
        rebalance=Rebalancer(cfg.elastic.rebalance, cfg.train, metrics),
        evaluator=Evaluator(cfg.eval, last_step=cfg.train.steps, step_timeout_s=cfg.elastic.step_timeout_s,
                            eval_path=eval_path, mask_eos_id=eval_mask_eos_id),
        failures=FailurePolicy(cfg.elastic.max_restarts),
        preemptions=PreemptionWatcher(cfg.elastic.drain_poll_s),
        grow_check=GrowCheck(cfg.elastic.grow_check_s, clock),
        window=StepWindow(steps_in_flight),
        hang_watch=HangWatch(cfg.elastic.hang_probe_factor, clock),
        recovery_clock=RecoveryClock(metrics, clock),
    )
