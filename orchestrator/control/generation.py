"""What the driver records of a generation and of a run, what it tells each rank to build, and which
live actor gets which world rank.

Three different "generation" types exist, one per side: ``GenerationRecord`` here (the driver's record
of a formed mesh), ``messages.JoinSpec`` (the instruction one rank gets) and
``workers.groups.RankGroups`` (a rank's own groups of that generation). Pure data: no Ray, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshspeak.mesh import MeshShape
from meshspeak.messages import RankInfo, RuntimeSpec
from meshspeak.sections import JobConfig
from orchestrator.plan.mesh_plan import MeshPlan, model_fields
from orchestrator.plan.placement import keep_ranks, place_ranks


@dataclass
class GenerationRecord:
    """Driver side: the driver's record of one generation — the mesh it planned (``plan``), which actor
    holds each world rank (``members``) and what each member reported on joining (``infos``; none for a
    member that never finished). Recorded as soon as the join is sent, so that a formation that fails
    can still be settled. The instruction one rank gets is a ``messages.JoinSpec``; a rank's own groups
    of the generation are a ``workers.groups.RankGroups``."""

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
    resume_step: int | None = None  # set when stopped by a signal: the step a rerun starts with


def runtime_spec(cfg: JobConfig, plan: MeshPlan, *, data_path: str, use_gpu: bool, mask_eos_id: int | None,
                 resuming: bool, load_follows: bool = False) -> RuntimeSpec:
    """What every rank of a generation planned as ``plan`` needs to build its model, optimizer and data.

    ``resuming``: a checkpoint will be loaded, so ``checkpoint.init_from`` is not passed on.
    ``load_follows``: a checkpoint or snapshot will be loaded, so the ranks skip the random init.
    """
    return RuntimeSpec(
        model=cfg.model,
        train=cfg.train,
        data_path=data_path,
        dp=plan.dp,
        layers_per_stage=plan.layers_per_stage,
        virtual_stages=plan.virtual_stages,
        collective_timeout_s=cfg.elastic.collective_timeout_s,
        use_gpu=use_gpu,
        async_checkpoint=cfg.checkpoint.async_write,
        fsdp_unit_mb=cfg.mesh.fsdp_unit_mb,
        **model_fields(cfg, resuming=resuming),
        mask_eos_id=mask_eos_id,
        data_mix=cfg.data.mix or (),  # paths resolved on the driver (orchestrator/data_inputs.py)
        schedule=cfg.pipeline.schedule,
        load_follows=load_follows,
    )


def assign_ranks(live: list[int], node_ips: dict[int, str], shape: MeshShape,
                 previous: GenerationRecord | None = None) -> tuple[dict[int, int], list[int]]:
    """World rank -> actor id for ``shape.world`` of the live actors, and the spares: TP groups inside
    a node, then PP, then DP across nodes; after a ``previous`` generation of the same shape, its
    survivors at the ranks they held where the placement allows (orchestrator/plan/placement.py)."""
    placement = place_ranks(live, node_ips, shape)
    if previous is not None and previous.shape == shape:
        placement = keep_ranks(placement, previous.members, shape)
    ordered = placement.order
    return {rank: ordered[rank] for rank in range(shape.world)}, ordered[shape.world:]
