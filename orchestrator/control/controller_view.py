"""The parts of the controller that the step boundary (``control/boundary.py``) and the formation
(``control/formation.py``) read and write, as Protocols (driver side; no Ray, no torch).

Those two modules take the controller as ``c``; typing it as ``Controller`` made them import
``control/controller.py``, which imports them: an import circle, hidden behind ``TYPE_CHECKING``.
Each Protocol names what its module uses of the controller and nothing else, so the modules depend on
the collaborators (checkpoints, snapshots, spares, the window...) rather than on the controller, and
``Controller`` satisfies both by its attributes. A step towards the driver context of issue 38, not the
context itself: the functions still write the controller's state (``generation``, ``progress``...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from meshspeak.messages import CallOutcome, StepResult
from meshspeak.sections import JobConfig
from orchestrator.cluster.group_protocol import WorkerGroupLike
from orchestrator.cluster.store_provider import StoreSource
from orchestrator.control.generation import GenerationRecord
from orchestrator.control.health import StepHealth
from orchestrator.control.progress import Progress, Recovery
from orchestrator.control.rebalance import Rebalancer
from orchestrator.control.scaling import ScalingPolicy
from orchestrator.control.spares import SparePool
from orchestrator.control.states import Rebuilding
from orchestrator.control.window import StepWindow
from orchestrator.metrics import MetricsLog
from orchestrator.recovery.failure_policy import Phase
from orchestrator.recovery.hang_watch import HangWatch
from orchestrator.recovery.preemption import PreemptionWatcher
from orchestrator.saves.checkpointing import CheckpointCoordinator
from orchestrator.saves.snapshots import Restored, SnapshotCoordinator


class BoundaryView(Protocol):
    """What the boundary's deciders and ``carry_out_decision`` use of the controller."""

    cfg: JobConfig
    group: WorkerGroupLike
    metrics: MetricsLog
    clock: Callable[[], float]
    generation: GenerationRecord | None
    progress: Progress
    recovery: Recovery
    ckpt: CheckpointCoordinator
    health: StepHealth
    spares: SparePool
    scaling: ScalingPolicy
    preemptions: PreemptionWatcher
    preempted: set[int]  # actors on nodes announced as draining
    resize_requests: dict[int, int]  # step -> dp
    stop_requested: Callable[[], bool]

    def grow_due(self) -> bool: ...


class FormationView(Protocol):
    """What ``form_generation`` and ``save_before_reform`` use of the controller."""

    cfg: JobConfig
    group: WorkerGroupLike
    metrics: MetricsLog
    generation: GenerationRecord | None
    progress: Progress
    recovery: Recovery
    ckpt: CheckpointCoordinator
    snapshots: SnapshotCoordinator
    health: StepHealth
    spares: SparePool
    rebalance: Rebalancer
    window: StepWindow
    hang_watch: HangWatch
    last_restore: Restored | None
    store: StoreSource
    run_id: str
    store_secret: str
    data_path: str
    use_gpu: bool
    mask_eos_id: int | None

    def fail(self, phase: Phase, outcome: CallOutcome, results: list[StepResult] = ()) -> Rebuilding: ...
