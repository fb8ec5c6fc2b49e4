"""The typed, picklable messages the driver and the rank actors exchange (pure data, no torch, no ray).

The driver imports these to read results; the actors import them to build results. Keeping them here
means neither side needs the other's heavy imports to unpickle a message. ``CallOutcome`` is what one
fan-out call over several actors brought back: these messages per actor, or why there is none.

Three things are called "generation"; only one of them lives here:

* ``JoinSpec`` (here, driver -> rank): the instruction to join generation N as world rank r.
* ``orchestrator.control.generation.GenerationRecord`` (driver side): the driver's record of generation N —
  its plan, which actor holds each world rank, what each member reported on joining.
* ``workers.groups.RankGroups`` (worker side): one rank's process groups and DeviceMesh of
  generation N, destroyed whole when the rank leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshspeak.dp_plan import DataParallelPlan
from meshspeak.mesh import MeshShape


@dataclass(frozen=True, slots=True)
class RuntimeSpec:
    """What a rank needs to build its model, optimizer and data for one generation."""

    model: Any  # meshspeak.sections.ModelConfig
    train: Any  # meshspeak.sections.TrainConfig
    data_path: str
    dp: DataParallelPlan  # the generation's data-parallel strategy, decided by the driver's plan
    layers_per_stage: tuple[int, ...]  # over all pp * virtual_stages stages, in stage order
    virtual_stages: int
    collective_timeout_s: float
    use_gpu: bool
    async_checkpoint: bool = True
    fsdp_unit_mb: float = 25.0  # mesh.fsdp_unit_mb
    # The model family and the shape the driver resolved (meshmodels/family.py); "" / None: the
    # ranks resolve them from `model` themselves.
    family: str = ""
    shape: Any = None
    init_from: str = ""  # checkpoint.init_from, set only when there is no checkpoint to resume
    mask_eos_id: int | None = None  # data.mask_document_boundaries resolved: targets after this id don't count
    schedule: str = ""  # pipeline.schedule: NCCL ranks plan their batched P2P from every rank's list
    # The driver loads a checkpoint or in-memory snapshot right after the join: the ranks skip the
    # random init it would overwrite (and refuse to train if no load came: workers/runtime.py).
    load_follows: bool = False


@dataclass(frozen=True, slots=True)
class JoinSpec:
    """Driver -> rank: join generation ``generation`` as ``world_rank`` of ``shape`` through the store
    at addr:port (``RankActor.join_generation``; the rank answers with a ``RankInfo``).

    ``store_prefix`` is unique per (run, generation): store keys of an earlier generation — or an
    earlier run sharing the store — must never be seen again (docs/design.md, Generations; F4).
    ``store_secret`` (128 random bits per run, kept out of ``repr`` and logs) is put in front of
    every key: the store has no authentication, and the secret travels only inside Ray's
    (token-authenticated) calls (README, Trust boundary).
    """

    generation: int
    shape: MeshShape
    world_rank: int
    store_addr: str
    store_port: int
    store_prefix: str
    store_secret: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Rank -> driver: what a rank reports after joining a generation (answer to a ``JoinSpec``)."""

    world_rank: int
    pid: int
    node_ip: str
    gloo_listeners: tuple[tuple[str, int], ...]
    setup_s: float
    num_params_local: int


@dataclass(frozen=True, slots=True)
class ActionTiming:
    action: str  # e.g. "2F0"
    start_s: float  # relative to the step's start on this rank
    end_s: float


@dataclass(frozen=True, slots=True)
class StepResult:
    """One rank's outcome of one step. Errors are latched and reported, never raised mid-collective."""

    step: int
    world_rank: int
    ok: bool
    loss: float | None = None  # this replica's share of the global-mean loss (last stage, tp 0 only)
    error: str | None = None
    step_time_s: float = 0.0
    compute_s: float = 0.0
    timings: tuple[ActionTiming, ...] = field(default_factory=tuple)
    loss_scale: float | None = None  # fp16: the loss scale this step's backward used
    skipped: bool = False  # every rank skipped the update: fp16 overflow, or a bad step (``bad``)
    bad: str = ""  # a bad step: "loss" (this rank's loss was not finite) or "grad_norm"; "" = fine
    # This rank's own CPU time in the step (the training thread's): waiting for peers in a
    # collective burns none; the benches' per-step CPU figure (bench/full_speed.py, ray_train_compare.py).
    own_s: float = 0.0
    # Wall time inside this rank's blocks' forwards, FSDP's all-gather waits left out: what the
    # straggler score compares (workers/compute_clock.py, orchestrator/recovery/stragglers.py).
    forward_s: float = 0.0
    dp_bytes: int | None = None  # dp > 1: bytes this rank sent over dp in the step (workers/compression.py)
    # train.compile: graphs this rank compiled again in the step (workers/compile_stats.py); None: off
    recompiles: int | None = None


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    world_rank: int
    pid: int
    generation: int
    busy: bool
    step: int
    error: str | None


@dataclass(frozen=True, slots=True)
class SaveAck:
    """Rank -> driver, answer to ``save_checkpoint``: the shard is staged and being written in the
    background (phase 1 of the two-phase commit, see ``orchestrator.saves.checkpointing``)."""

    stall_s: float  # what the save call cost the training loop


@dataclass(frozen=True, slots=True)
class WriteAck:
    """Rank -> driver, answer to ``wait_checkpoint``: this rank's shard is durable.

    ``files`` (file name -> size in bytes) goes into the manifest, so that validation can spot a
    missing or truncated shard without reading DCP's metadata. ``stall_s`` is what training paid in
    all: the save call plus any wait for staging before the next optimizer step.
    """

    write_s: float
    files: dict[str, int]
    stall_s: float
    staging_s: float


@dataclass
class CallOutcome:
    """Driver side: per-actor outcome of one fan-out call (``WorkerGroup.collect``)."""

    results: dict[int, Any] = field(default_factory=dict)
    dead: dict[int, str] = field(default_factory=dict)  # actor died (RayActorError)
    failed: dict[int, str] = field(default_factory=dict)  # the method raised
    pending: list[int] = field(default_factory=list)  # no answer before the deadline
    pending_refs: dict = field(default_factory=dict)  # call ref -> actor_id, for a later collect()

    @property
    def ok(self) -> bool:
        return not (self.dead or self.failed or self.pending)
