"""MeshPlan: what the driver decides before any actor starts (pure; no torch, no ray).

Shape, stage split (balanced by parameter count, embedding and head included, or the user's
``pipeline.layers``), which actor holds which coordinates, the pipeline schedule, and a per-rank
memory estimate (parameters, gradients, optimizer state, activations) for ``elastimesh plan``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshmodels.family import resolve_model
from meshspeak.dp_plan import DataParallelPlan, plan_data_parallel
from meshspeak.mesh import MeshShape, balanced_split, fsdp_units, layer_ranges, stage_param_counts
from meshspeak.schedule import (
    ZERO_BUBBLE,
    Action,
    make_schedule,
    peak_in_flight,
    placement_of,
    stage_to_rank,
    stages_of_rank,
    theoretical_bubble,
)
from meshspeak.schedule_sim import simulate
from meshspeak.sections import JobConfig, microbatches_per_replica
from orchestrator.plan.host_memory import host_bytes_per_rank, host_copies

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def param_counts(model) -> dict[str, int]:
    """Parameter counts of the model by part: ``embed``, one ``layer``, ``head`` (final norm + output,
    the output counted even when tied to the embedding: the last stage holds a copy), ``tied`` (what
    of the head is the embedding's copy; 0 untied) and ``total`` (distinct parameters). From the model
    family (``meshmodels/family.py``); tests check them against the built modules."""
    counts = dict(resolve_model(model).family.param_counts(resolve_model(model).shape))
    counts.setdefault("tied", 0)
    return counts


@dataclass(frozen=True, slots=True)
class MeshPlan:
    shape: MeshShape
    layers_per_stage: tuple[int, ...]
    virtual_stages: int
    schedule_name: str
    microbatches: int
    dp: DataParallelPlan  # how the generation's ranks hold and reduce over dp (meshspeak/dp_plan.py)

    @property
    def num_stages(self) -> int:
        return self.shape.pp * self.virtual_stages

    def actions(self, microbatches: int | None = None) -> list[list[Action]]:
        """The schedule per pipeline rank (every dp/tp rank at one pp position runs the same list),
        for ``microbatches`` per replica (``elastic.rebalance``: a replica's own count) or the even
        split's."""
        return make_schedule(self.schedule_name, self.shape.pp, microbatches or self.microbatches,
                             self.virtual_stages)


def make_plan(cfg: JobConfig, dp: int | None = None) -> MeshPlan:
    dp = cfg.mesh.dp if dp is None else dp
    num_stages = cfg.mesh.pp * cfg.pipeline.virtual_stages
    if cfg.pipeline.layers:
        layers = tuple(cfg.pipeline.layers)
    else:
        counts = param_counts(cfg.model)
        costs = stage_param_counts(n_layers(cfg), counts["layer"], counts["embed"], counts["head"])
        layers = tuple(balanced_split(costs, num_stages))
    return MeshPlan(
        shape=MeshShape(dp, cfg.mesh.pp, cfg.mesh.tp),
        layers_per_stage=layers,
        virtual_stages=cfg.pipeline.virtual_stages,
        schedule_name=cfg.pipeline.schedule,
        microbatches=microbatches_per_replica(cfg.train, dp),
        dp=plan_data_parallel(zero=cfg.mesh.zero, dp=dp, pp=cfg.mesh.pp, tp=cfg.mesh.tp, dtype=cfg.train.dtype,
                              grad_reduce=cfg.train.grad_reduce, cpu_offload=cfg.mesh.cpu_offload,
                              compression=cfg.train.grad_compression, cfg_dp=cfg.mesh.dp,
                              cfg_replicate=cfg.mesh.dp_replicate, optimizer=cfg.train.optimizer,
                              rebalance=cfg.elastic.rebalance),
    )


def stage_params(cfg: JobConfig, plan: MeshPlan, stage: int) -> int:
    counts = param_counts(cfg.model)
    first, end = layer_ranges(list(plan.layers_per_stage))[stage]
    total = (end - first) * counts["layer"]
    if first == 0:
        total += counts["embed"]
    if end == n_layers(cfg):
        # A tied head on a stage without the embedding holds its own copy of it.
        total += counts["head"] - (counts["tied"] if first == 0 else 0)
    return total


def model_fields(cfg: JobConfig, *, resuming: bool) -> dict:
    """The ``RuntimeSpec`` fields about the model: family, resolved shape, and the Hugging Face weights
    to start from (``checkpoint.init_from``) unless a checkpoint is resumed instead."""
    resolved = resolve_model(cfg.model)
    return {"family": resolved.ref, "shape": resolved.shape,
            "init_from": "" if resuming else cfg.checkpoint.init_from}


def n_layers(cfg: JobConfig) -> int:
    return resolve_model(cfg.model).shape.n_layers


def rank_memory(cfg: JobConfig, plan: MeshPlan, pp_rank: int) -> dict[str, int]:
    """Estimated bytes per rank at pipeline position ``pp_rank`` (all dp/tp ranks there are alike).

    Model state: fp32 master params + fp32 grads + two fp32 Adam moments, divided by tp (TP shards the
    weights) and by the shard-group size dp / R (``mesh.zero`` and ``mesh.dp_replicate``: ZeRO-0 has
    groups of one rank, HSDP of dp / R; FSDP shards all of it inside a group). ZeRO-0..2 keep the
    bf16/fp32 compute copy of the parameters gathered through the step; ZeRO-3 gathers the root unit
    (embedding, head and the blocks that ``mesh.fsdp_unit_mb`` left in it) plus one unit at a time. Activations: per layer and
    microbatch, roughly 16·s·b·d values (inputs of norms, q/k/v, attention output, the 4x MLP) in the
    compute dtype, sequence/tensor-sharded by tp, plus logits on the last stage, times the schedule's
    peak microbatches in flight on that stage.
    """
    m, t, train = resolve_model(cfg.model).shape, plan.shape.tp, cfg.train
    dp = plan.shape.dp
    stages = stages_of_rank(pp_rank, plan.shape.pp, plan.virtual_stages, placement_of(plan.schedule_name))
    params = sum(stage_params(cfg, plan, s) for s in stages) // t
    shard = dp // plan.dp.replicate
    sharded = params // shard if shard > 1 else params
    act_bytes = BYTES[train.dtype]
    gathered = 0
    if dp > 1:
        gathered = (params if not plan.dp.reshard_after_forward or shard == 1
                    else _zero3_gathered_params(cfg, plan, stages))
        gathered *= act_bytes
    per_layer = 16 * train.micro_batch_size * m.seq_len * m.d_model * act_bytes // t
    ranges = layer_ranges(list(plan.layers_per_stage))
    inflight = peak_in_flight(plan.actions()[pp_rank])
    layers_here = sum(ranges[s][1] - ranges[s][0] for s in stages)
    activations = per_layer * layers_here * inflight // max(1, len(stages))
    if plan.num_stages - 1 in stages:
        # fp32 logits + their grad, vocab-sharded over tp (loss_parallel)
        activations += train.micro_batch_size * m.seq_len * m.vocab_size * 4 * 2 // t
    master = 8 if train.dtype == "float64" else 4  # fp64: weights, grads and moments are all fp64
    return {
        "params": sharded * master + gathered,
        "grads": sharded * master,
        "optimizer": sharded * 2 * master,
        "activations": activations,
        "peak_microbatches_in_flight": inflight,
    }


def stage_fsdp_units(cfg: JobConfig, plan: MeshPlan, stage: int) -> list[list[int]]:
    """The FSDP units (global layer indices) ``stage``'s blocks form; blocks in none stay in the root.

    The same grouping ``workers.parallelize.apply_fsdp`` makes from the built blocks, estimated from the
    parameter count (fp32 master weights per tp shard; the actors also count the replicated norms).
    """
    layer_bytes = param_counts(cfg.model)["layer"] // plan.shape.tp * 4
    first, end = layer_ranges(list(plan.layers_per_stage))[stage]
    units = fsdp_units([layer_bytes] * (end - first), int(cfg.mesh.fsdp_unit_mb * 2**20))
    return [[first + i for i in unit] for unit in units]


def _zero3_gathered_params(cfg: JobConfig, plan: MeshPlan, stages: list[int]) -> int:
    """Parameters (per tp shard) gathered at once under ZeRO-3: the largest stage's root + one unit."""
    layer = param_counts(cfg.model)["layer"] // plan.shape.tp
    peak = 0
    for s in stages:
        units = stage_fsdp_units(cfg, plan, s)
        root = stage_params(cfg, plan, s) // plan.shape.tp - sum(len(u) for u in units) * layer
        peak = max(peak, root + max((len(u) for u in units), default=0) * layer)
    return peak


def bubble_estimate(plan: MeshPlan) -> float:
    """The schedule's idle share of a step with uniform stage costs and free communication: the
    paper formula for the classic schedules; the zero-bubble ones simulated with F = I = W (their
    bubble depends on the list: meshspeak/zero_bubble.py)."""
    pp, m, v = plan.shape.pp, plan.microbatches, plan.virtual_stages
    if plan.schedule_name in ZERO_BUBBLE:
        return simulate(plan.actions(), pp, v, placement=placement_of(plan.schedule_name)).bubble_fraction
    return theoretical_bubble(pp, m, v)


def describe(cfg: JobConfig, plan: MeshPlan) -> dict:
    """Everything `elastimesh plan` prints, as data (the CLI renders it; tests read it)."""
    shape = plan.shape
    ranges = layer_ranges(list(plan.layers_per_stage))
    uses_fsdp = plan.dp.wrapper == "fsdp"
    return {
        "mesh": shape.as_dict(),
        "world": shape.world,
        "schedule": plan.schedule_name,
        "virtual_stages": plan.virtual_stages,
        "microbatches_per_replica": plan.microbatches,
        "bubble_estimate": bubble_estimate(plan),
        "data_parallel": dataclasses.asdict(plan.dp),
        "stages": [
            {"stage": s, "pp_rank": stage_to_rank(s, shape.pp, placement_of(plan.schedule_name)),
             "layers": [a, b - 1], "params": stage_params(cfg, plan, s),
             "fsdp_units": stage_fsdp_units(cfg, plan, s) if uses_fsdp else None}
            for s, (a, b) in enumerate(ranges)
        ],
        "ranks": [
            {"rank": r, **vars_of(shape.coords(r))} for r in range(shape.world)
        ],
        "memory_per_rank": {p: rank_memory(cfg, plan, p) for p in range(shape.pp)},
        "snapshot_host_memory": snapshot_host_memory(cfg, plan),
        "total_params": param_counts(cfg.model)["total"],
        "model_family": resolve_model(cfg.model).ref,
        "model_source": cfg.model.from_hf,
    }


def snapshot_host_memory(cfg: JobConfig, plan: MeshPlan) -> dict | None:
    """The host memory in-memory snapshots and the background checkpoint write take per rank, or None
    when neither is on (``checkpoint.dir`` unset): the copies of a rank's state by source and the
    bytes per rank at each pipeline position (orchestrator/plan/host_memory.py counts them)."""
    copies = host_copies(cfg)
    if not copies:
        return None
    memory = {p: rank_memory(cfg, plan, p) for p in range(plan.shape.pp)}
    return {"copies": copies, "memory_keep": cfg.checkpoint.memory_keep,
            "per_rank": host_bytes_per_rank(cfg, memory)}


def vars_of(coords) -> dict[str, int]:
    return {"dp": coords.dp, "pp": coords.pp, "tp": coords.tp}
