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
    # data.mix with each path resolved by the driver, ((path, weight), ...); () = data_path alone.
    data_mix: tuple[tuple[str, float], ...] = ()
    schedule: str = ""  # pipeline.schedule: NCCL ranks plan their batched P2P from every rank's list
    # The driver loads a checkpoint or in-memory snapshot right after the join: the ranks skip the
    # random init it would overwrite (and refuse to train if no load came: workers/runtime.py).
    load_follows: bool = False


@dataclass(frozen=True, slots=True)
class JoinSpec:
    """Driver -> rank: join generation ``generation`` as ``world_rank`` of ``shape`` through the store
    at addr:port (``RankActor.join_generation``; the rank answers with a ``RankInfo``).

    ``store_prefix`` is unique per (run, generation): store keys of an earlier generation — or an
    earlier run sharing the store — must never be seen again (docs/design.md, Generations, and "Store
    keys collide across generations").
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
    # collective burns none; the step record's ``cpu_s`` is the most of it over the ranks (metrics.step_record).
    own_s: float = 0.0
    # Wall time inside this rank's blocks' forwards, FSDP's all-gather waits left out: what the
    # straggler score compares (workers/compute_clock.py, orchestrator/recovery/stragglers.py).
    forward_s: float = 0.0
    dp_bytes: int | None = None  # dp > 1: bytes this rank sent over dp in the step (workers/compression.py)
    # train.compile: graphs this rank compiled again in the step (workers/compile_stats.py); None: off
    recompiles: int | None = None
    # In-memory snapshots of this rank's shard that its holder acknowledged since the last result
    # (orchestrator/saves/snapshots.py counts them into complete sets).
    snapshots: tuple[SnapshotAck, ...] = ()
    # The call arrived before the step it follows had run on this rank (Ray does not promise the
    # order of a threaded actor's calls): nothing was done and nothing latched; the driver sends the
    # step again (orchestrator/control/controller.py, ``_resend_early``).
    early: bool = False


def early_answer(step: int, world_rank: int, follows: int, done: int) -> StepResult:
    """A rank's answer to ``step`` that reached it before ``follows``, the step it follows, ran there
    (``done``: the last step it trained): nothing trained, nothing latched (``StepResult.early``)."""
    return StepResult(step=step, world_rank=world_rank, ok=False, early=True,
                      error=f"step {step} arrived before step {follows} (after step {done})")


SnapKey = tuple[int, int, int]  # (generation, life: loads done in it, step) of an in-memory snapshot


@dataclass(frozen=True, slots=True)
class SnapshotAck:
    """Rank -> driver (inside a ``StepResult``): the holder keeps a copy of this rank's snapshot ``key``."""

    key: SnapKey
    stall_s: float  # what taking it cost the training thread (planning + waiting for the copy)
    nbytes: int


@dataclass(frozen=True, slots=True)
class GenerationOrders:
    """Driver -> rank, once per generation with the ``JoinSpec``: what the rank runs in every step.

    ``actions``: this rank's schedule action list (the same every step). ``snapshot_every``: take an
    in-memory snapshot after every such step (0: none), pushed by the rank itself to ``holder`` — the
    actor handle of the rank that keeps its copy (the one call a rank makes on another actor, on a
    handle the driver gave it for that purpose; docs/design.md, In-memory snapshots)."""

    actions: tuple[Any, ...]
    snapshot_every: int = 0
    holder: Any = None  # an actor handle (the fake group: an actor id); None: no snapshots pushed
    holder_rank: int = -1
    # The snapshot set the generation loads once joined (None: none, or a checkpoint): the rank asks
    # its providers for their metadata as it joins, so the load's first read has come by then.
    restore: RestoreSource | None = None


@dataclass(frozen=True, slots=True)
class SplitOrders:
    """Driver -> rank, with the first step of a new microbatch split (``elastic.rebalance``:
    meshspeak/rebalance.py) and kept by the rank until the next one or the end of its generation:
    ``split`` holds the step's microbatches per dp replica (in dp order; they sum to the global
    batch's), ``actions`` this rank's schedule for its replica's count. Without one a generation
    trains the even split with its ``GenerationOrders.actions`` (which evals keep using)."""

    split: tuple[int, ...]
    actions: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class SnapshotInventory:
    """Rank -> driver after a failure: the snapshots this actor can give (its own, and held copies)."""

    own: tuple[tuple[SnapKey, int], ...]  # (key, the world rank it had in that generation)
    held: tuple[tuple[SnapKey, int], ...]  # (key, owner's world rank)


@dataclass(frozen=True, slots=True)
class RestoreSource:
    """Driver -> every new member: load the snapshot set ``key`` of a generation of ``world`` ranks;
    ``providers`` give old ranks' pieces: (old world rank, actor id, actor handle), in old-rank order
    (handles the driver gives for this restore's reads) — every old rank's, or where a shard's copies
    died, those of the ranks holding the same shard (HSDP's replicas: ``meshspeak.mesh.same_shard_ranks``)."""

    key: SnapKey
    world: int
    providers: tuple[tuple[int, int, Any], ...]


@dataclass(frozen=True, slots=True)
class RestoreAck:
    """Rank -> driver, answer to ``load_snapshot``: the step loaded and the bytes it fetched."""

    step: int
    fetched_bytes: int  # pieces of old shards fetched from the providers (its own ones included)
    shard_bytes: int  # this rank's own state (model + optimizer shard) after the load
    direct: bool = False  # copied in place from one old rank's snapshot, not resharded (workers/snapshot_restore.py)
    fetched_ahead: int = 0  # of fetched_bytes: the shard asked for at the join (workers.snapshot_push.ask_ahead)


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    world_rank: int
    pid: int
    generation: int
    busy: bool
    step: int
    error: str | None
    # train.compile: seconds compiled inside the step running now (workers/compile_stats.py); the driver
    # does not count them against elastic.step_timeout_s
    step_compile_s: float = 0.0
    # Seconds since the rank last made progress in the step it runs (an action of the schedule, the
    # update's phases: RankRuntime.stalled_s); None outside a step. A step slower than
    # elastic.step_timeout_s fails only once no rank progressed for that long.
    stalled_s: float | None = None


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
    # Pending actors that answered no liveness probe (orchestrator/recovery/hang_watch.py) -> reason.
    hung: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.dead or self.failed or self.pending)

    def absorb(self, later: CallOutcome) -> None:
        """Add what a later read of this call's pending refs found (``later``): its answers, deaths,
        errors and hung actors; what is still pending is ``later``'s."""
        self.results.update(later.results)
        self.dead.update(later.dead)
        self.failed.update(later.failed)
        self.hung.update(later.hung)
        self.pending, self.pending_refs = later.pending, later.pending_refs
