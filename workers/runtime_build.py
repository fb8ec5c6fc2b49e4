"""How one rank's ``RankRuntime`` is built for a generation, as an ordered recipe of small steps.

``RankRuntime.__init__`` (workers/runtime.py) calls these in order, as TorchTitan's
``parallelize_llama`` applies TP, activation checkpointing, compile and FSDP one ``apply_*`` at a
time; each step takes what it needs and returns what it made:

1. ``build_stages``: this rank's pipeline stages (built on the meta device, TP'd, compiled, FSDP'd
   or DDP-wrapped: meshmodels/build.py, workers/parallelize.py) and one optimizer per stage;
2. ``apply_dp_reduction``: the data-parallel reduction the plan chose, and the dp bytes counter;
3. ``build_compute_clock``: the straggler score's clock around the blocks' forwards;
4. ``apply_tied_parameters``: the family's tied copies across stages (collective: new groups);
5. ``apply_checkpoint_group_bound``: the checkpoint group's timeout, from the state it moves;
6. ``apply_initial_weights``: ``checkpoint.init_from``'s Hugging Face weights, if any (collective);
7. ``build_executor``: what runs the driver's pipeline actions over the stages;
8. ``build_loss_scale``: float16's dynamic loss scale (None otherwise).

The order matters where steps are collective (every rank makes the tied groups, then loads the
initial weights) and where one reads what another made (the clock's hooks go on after FSDP's).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from meshmodels.build import build_local_stage
from meshmodels.hf_io import load_hf
from meshspeak.mesh import layer_ranges
from meshspeak.messages import RuntimeSpec
from meshspeak.schedule import Action, placement_of, stages_of_rank
from workers.compression import setup_dp_reduction, wrap_ddp
from workers.compute_clock import ComputeClock
from workers.groups import RankGroups
from workers.loss_scale import DynamicLossScale
from workers.optim import build_optimizer
from workers.parallelize import parallelize_stage
from workers.pipeline import Executor, Stage
from workers.tied import TiedGrads

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def build_stages(spec: RuntimeSpec, groups: RankGroups, family, shape) -> tuple[dict[int, Stage], list]:
    """This rank's stages (by stage index) and their optimizers, one per stage, in the same order."""
    train, dp_plan = spec.train, spec.dp  # the dp strategy comes decided (meshspeak/dp_plan.py)
    num_stages = groups.shape.pp * spec.virtual_stages
    ranges = layer_ranges(list(spec.layers_per_stage))
    placement = placement_of(spec.schedule)  # zbv: the V (meshspeak/actions.py)
    stages: dict[int, Stage] = {}
    optimizers: list[torch.optim.Optimizer] = []
    for index in stages_of_rank(groups.coords.pp, groups.shape.pp, spec.virtual_stages, placement):
        first, end = ranges[index]
        # Built on the meta device; only this rank's shards are ever allocated (meshmodels/build.py).
        module = build_local_stage(
            family, shape, range(first, end), device=groups.device, seed=train.seed,
            activation_checkpointing=train.activation_checkpointing,
            init=not spec.init_from and not spec.load_follows,  # a load overwrites it anyway
            dtype=torch.float64 if train.dtype == "float64" else None,  # fp64 master weights too
            cpu_offload=dp_plan.cpu_offload,
            parallelize=lambda m: parallelize_stage(
                m, family, dp_plan, tp_mesh=groups.tp_mesh,
                dp_mesh=groups.shard_mesh if dp_plan.fsdp_over == "shard" else groups.dp_mesh,
                param_dtype=DTYPES[train.dtype], fsdp_unit_bytes=int(spec.fsdp_unit_mb * 2**20),
                compile=train.compile,
            ),
        )
        stages[index] = Stage(
            index=index, module=module, is_first=index == 0, is_last=index == num_stages - 1,
            ddp=wrap_ddp(module, groups.dp_group) if dp_plan.wrapper == "ddp" else None,
        )
        optimizers.append(build_optimizer(module, train, dp_group=groups.dp_group))
    return stages, optimizers


def apply_dp_reduction(stages: dict[int, Stage], optimizers: list, spec: RuntimeSpec, groups: RankGroups):
    """The dp reduction the plan chose, attached to the stages (workers/compression.py); returns the
    counter of each step's dp bytes, or None when nothing is counted."""
    modules = [st.module for st in stages.values()]
    ddp_wrappers = [st.ddp for st in stages.values() if st.ddp is not None]
    return setup_dp_reduction(modules, spec.dp, spec.train, groups, ddp_wrappers, optimizers)


def build_compute_clock(stages: dict[int, Stage], family, device: torch.device) -> ComputeClock:
    """Each step's compute time without FSDP's waits, for straggler scoring (workers/compute_clock.py)."""
    return ComputeClock((b for st in stages.values() for b in family.blocks(st.module)), device=device)


def apply_tied_parameters(stages: dict[int, Stage], family, shape, spec: RuntimeSpec,
                          groups: RankGroups) -> TiedGrads:
    """The family's tied copies across stages (the embedding and a head tied to it), kept identical
    (workers/tied.py). Collective: every rank makes every pair's group."""
    modules = {i: st.module for i, st in stages.items()}
    num_stages = groups.shape.pp * spec.virtual_stages
    return TiedGrads(family.tied_parameters(shape), modules, num_stages, groups, spec.collective_timeout_s)


def apply_checkpoint_group_bound(params: list[nn.Parameter], groups: RankGroups, collective_timeout_s: float) -> None:
    """Give the checkpoint group's collectives (DCP save and load, init_from) a bound derived from
    the work instead of ``elastic.collective_timeout_s``: in them every rank waits for the slowest
    one's storage, and a rank a minute behind used to fail a save with every rank alive, which read
    as storage failing and stopped the run. A rank that dies is found by liveness and its peers
    freed by the driver's kick, so this bound is only the backstop for a live rank that never
    returns (#36: time alone never fails a live run)."""
    from datetime import timedelta

    from checkpoints.writer import checkpoint_group_timeout_s

    planned = 3 * sum(p.numel() * p.element_size() for p in params)  # parameters + Adam's 2 moments
    bound_s = checkpoint_group_timeout_s(planned, collective_timeout_s)
    if bound_s > collective_timeout_s:
        groups.ckpt_group.set_timeout(timedelta(seconds=bound_s))
        logger.info("checkpoint group timeout %.0f s (elastic.collective_timeout_s %.0f s): %d bytes of state "
                    "at the slowest storage waited for", bound_s, collective_timeout_s, planned)


def apply_initial_weights(stages: dict[int, Stage], family, spec: RuntimeSpec, groups: RankGroups) -> None:
    """``checkpoint.init_from``: Hugging Face weights straight into the local shards, collectively
    (the driver validated the directory). Nothing without it."""
    if spec.init_from:
        load_hf([st.module for st in stages.values()], family, spec.init_from, process_group=groups.ckpt_group)


def build_executor(stages: dict[int, Stage], family, shape, spec: RuntimeSpec, groups: RankGroups) -> Executor:
    """What runs the driver's action lists over this rank's stages (workers/pipeline.py)."""
    mesh, train = groups.shape, spec.train
    seq_local = spec.model.seq_len // mesh.tp if mesh.tp > 1 else spec.model.seq_len

    def nccl_plan(actions: list[Action]) -> list:
        """This rank's lockstep P2P batches on NCCL (meshspeak.p2p_rounds; cached per list)."""
        from meshspeak.p2p_rounds import rank_batches

        return rank_batches(spec.schedule, mesh.pp, spec.virtual_stages, groups.coords.pp, tuple(actions))

    return Executor(
        stages,
        num_stages=mesh.pp * spec.virtual_stages,
        pp=mesh.pp,
        peer_of_pp_index=groups.pp_peer,
        boundary_shape=(train.micro_batch_size, seq_local, shape.d_model),
        boundary_dtype=DTYPES[train.dtype],
        device=groups.device,
        pp_group=groups.pp_group if mesh.pp > 1 else None,
        # gloo only (see workers.p2p). 4 ahead: interleaved 1F1B's late receives went from
        # 3.7 ms (p90) with 0 ahead to 0.25 ms, and its pp=2 m=8 bubble from 0.11-0.13 to 0.086.
        recv_lookahead=4 if groups.backend == "gloo" else 0,
        nccl_plan=nccl_plan if groups.backend == "nccl" else None,
        loss_fn=family.loss_sum,
        placement=placement_of(spec.schedule),
    )


def build_loss_scale(train) -> DynamicLossScale | None:
    """float16: dynamic loss scaling, one decision for all ranks (workers/loss_scale.py); else None."""
    if train.dtype != "float16":
        return None
    return DynamicLossScale(scale=train.loss_scale_initial, growth_interval=train.loss_scale_window,
                            min_scale=train.loss_scale_min)
