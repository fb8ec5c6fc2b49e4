"""Run a real (dp, pp, tp) mesh of ``RankRuntime`` ranks on this machine, and the reference to compare with.

``run_mesh(dp, pp, tp, overrides, steps)`` trains ``steps`` optimizer steps on ``dp*pp*tp`` local gloo
ranks, exactly as the actors would (``build_process_groups`` + ``RankRuntime`` + the driver's schedule),
and returns a :class:`MeshRun`: the global per-step losses (the sum of every replica's share), the
unsharded final parameters of the whole model and every rank's ``StepResult`` s.
The single-process reference to compare with is ``testbed.reference``.

Processes
    Ranks live in ``testbed.rank_pool``'s shared pool of forked processes (one intra-op thread
    each), re-used across runs: every run is a new generation in the same processes, as the elastic
    actors re-form. A failed or timed-out run raises :class:`MeshRunError` with each failed rank's
    traceback and kills the pool (the next run starts a new one): failures never hang. A run whose rank
    died of a native crash (SIGABRT/SIGSEGV/SIGBUS) is re-run once, with a warning, and recorded in a
    file that tests/conftest.py prints at the end of the session (docs/design.md, "A rare native crash in the
    test pool").

Stage split
    ``pipeline.layers`` when set, else ``balanced_split`` over per-layer parameter counts with the
    embedding added to the first layer and the final norm + head to the last
    (``meshspeak.mesh.stage_param_counts``), the counts taken from the real ``GPT`` built on the
    meta device: the same rule ``orchestrator.plan.mesh_plan`` uses for the driver.
"""

from __future__ import annotations

import dataclasses
import signal
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshspeak.mesh import MeshShape, balanced_split, stage_param_counts
from meshspeak.messages import StepResult
from meshspeak.schedule import Action, make_schedule
from meshspeak.sections import JobConfig, microbatches_per_replica
from orchestrator.config.load import load_config
from testbed.rank_pool import MeshRunError, _Pool, is_shared, record_native_crash, shared_pool, shutdown_pool

__all__ = ["MeshRun", "MeshRunError", "run_mesh", "shutdown_pool"]


@dataclass
class MeshRun:
    """The outcome of one :func:`run_mesh` call."""

    shape: MeshShape
    schedule: str
    virtual_stages: int
    layers_per_stage: tuple[int, ...]
    microbatches: int  # per dp replica and step
    actions: list[list[Action]]  # the schedule, per pp rank
    losses: list[float]  # global mean loss per step (sum of the replicas' shares)
    params: dict[str, np.ndarray]  # full (unsharded) parameters after the last step; {} if not collected
    results: dict[int, list[StepResult]]  # world rank -> one StepResult per step
    extras: dict[int, Any] = field(default_factory=dict)  # world rank -> what `instrument` returned
    setup_s: dict[int, float] = field(default_factory=dict)  # world rank -> groups + runtime build time
    wall_s: float = 0.0  # dispatch -> last result, in the parent

    def dp_bytes_per_step(self) -> list[int]:
        """Per step, the most bytes one rank sent over dp (``StepResult.dp_bytes``)."""
        return [max(r[i].dp_bytes for r in self.results.values()) for i in range(len(self.losses))]

    def step_times(self, step_index: int) -> list[float]:
        """Every rank's wall time of the ``step_index``-th step of this run (0-based)."""
        return [self.results[r][step_index].step_time_s for r in sorted(self.results)]


# --- configuration -------------------------------------------------------------------------------


def mesh_config(
    dp: int, pp: int, tp: int, overrides: Sequence[str] = (), schedule: str = "1f1b", virtual_stages: int = 1
) -> JobConfig:
    """The validated job config of a run: ``overrides`` then the mesh and pipeline arguments."""
    return load_config(
        None,
        [
            *overrides,
            f"mesh.dp={dp}",
            f"mesh.pp={pp}",
            f"mesh.tp={tp}",
            f'pipeline.schedule="{schedule}"',
            f"pipeline.virtual_stages={virtual_stages}",
        ],
    )


def part_params(model_cfg) -> dict[str, int]:
    """Parameter counts of one block, the embedding and the head (final norm + output) of the real model,
    built on the meta device through its family."""
    import torch

    from meshmodels.family import resolve_model

    resolved = resolve_model(model_cfg)
    with torch.device("meta"):
        model = resolved.family.build_stage(resolved.shape, range(resolved.shape.n_layers))
    per = {name: p.numel() for name, p in model.named_parameters()}
    layer = sum(v for n, v in per.items() if n.startswith("layers.0."))
    embed = sum(v for n, v in per.items() if n.startswith("tok_embeddings."))
    head = sum(per.values()) - embed - resolved.shape.n_layers * layer
    if resolved.family.tied_parameters(resolved.shape):
        head += embed  # the last stage holds its own copy of a tied embedding
    return {"layer": layer, "embed": embed, "head": head}


def stage_layers(cfg: JobConfig) -> tuple[int, ...]:
    """Layers per stage (``pp * virtual_stages`` entries, stage order): see the module docstring."""
    if cfg.pipeline.layers:
        return tuple(cfg.pipeline.layers)
    counts = part_params(cfg.model)
    from meshmodels.family import resolve_model

    n_layers = resolve_model(cfg.model).shape.n_layers
    costs = stage_param_counts(n_layers, counts["layer"], counts["embed"], counts["head"])
    return tuple(balanced_split(costs, cfg.mesh.pp * cfg.pipeline.virtual_stages))


# --- the rank side -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    overrides: tuple[str, ...]  # complete: mesh and pipeline keys included
    layers_per_stage: tuple[int, ...]
    steps: int
    first_step: int
    collect_params: bool
    collective_timeout_s: float
    instrument: Callable[[Any], Callable[[], Any] | None] | None
    splits: tuple[tuple[int, ...], ...] | None = None  # per step: microbatches per dp replica

    def __call__(self, rank: int, store_port: int, generation: int) -> dict[str, Any]:
        return _run_job(rank, store_port, generation, self)


def _run_job(rank: int, store_port: int, generation: int, job: _Job) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from meshdata.masks import mask_eos_for
    from orchestrator.control.generation import runtime_spec
    from orchestrator.plan.mesh_plan import make_plan
    from workers.groups import build_process_groups
    from workers.runtime import RankRuntime

    t0 = time.perf_counter()
    cfg = load_config(None, list(job.overrides))
    shape = MeshShape(cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.tp)
    v = cfg.pipeline.virtual_stages
    # The driver's own construction (one decision of the data-parallel strategy, etc.); the stage
    # split and the process groups' timeout are the test's.
    spec = dataclasses.replace(
        runtime_spec(cfg, make_plan(cfg), data_path=cfg.data.path, use_gpu=False,
                     mask_eos_id=mask_eos_for(cfg.data), resuming=False),
        layers_per_stage=job.layers_per_stage, collective_timeout_s=job.collective_timeout_s)
    groups = build_process_groups(
        store_addr="127.0.0.1",
        store_port=store_port,
        generation=generation,
        shape=shape,
        world_rank=rank,
        timeout_s=job.collective_timeout_s,
        device=torch.device("cpu"),
        replicate=spec.dp.replicate,
    )
    runtime = RankRuntime(spec, groups)
    finish = job.instrument(runtime) if job.instrument is not None else None
    microbatches = microbatches_per_replica(cfg.train, shape.dp)
    actions = make_schedule(cfg.pipeline.schedule, shape.pp, microbatches, v)[groups.coords.pp]
    # Every rank starts step 1 together, so step timings are comparable (on the checkpoint group: the
    # default group never connects in training, tests/distributed/test_world_group_unused.py).
    dist.barrier(group=groups.ckpt_group)
    setup_s = time.perf_counter() - t0
    results = []
    for i, step in enumerate(range(job.first_step, job.first_step + job.steps)):
        if job.splits is None:
            results.append(runtime.train_step(step, actions))
            continue
        # elastic.rebalance, forced: the replica's own count, its schedule for that count (what the
        # driver's orchestrator/control/rebalance.py hands each rank).
        split = job.splits[i]
        count = split[groups.coords.dp]
        own = make_schedule(cfg.pipeline.schedule, shape.pp, count, v)[groups.coords.pp]
        results.append(runtime.train_step(step, own, split))
    params = runtime.full_state() if job.collect_params else {}
    extra = finish() if finish is not None else None
    runtime.destroy()
    return {"results": results, "params": params, "extra": extra, "setup_s": setup_s}


def run_mesh(
    dp: int,
    pp: int,
    tp: int,
    overrides: Sequence[str] = (),
    steps: int = 10,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    timeout: float = 240.0,
    *,
    first_step: int = 1,
    collect_params: bool = True,
    instrument: Callable[[Any], Callable[[], Any] | None] | None = None,
    collective_timeout_s: float = 60.0,
    fresh: bool = False,
    splits: Sequence[Sequence[int]] | None = None,
) -> MeshRun:
    """Train steps ``first_step .. first_step+steps-1`` on a local (dp, pp, tp) gloo mesh.

    Args:
        overrides: ``SECTION.KEY=VALUE`` config overrides (model, train, data...); the mesh and
            pipeline keys come from the other arguments.
        timeout: seconds for the run once the workers are up (their start-up has its own limit).
        collect_params: gather the full parameters after the last step (a collective).
        instrument: a picklable module-level ``fn(runtime) -> finish | None``, called on every rank
            after its ``RankRuntime`` is built; ``finish()`` is called after the last step and its
            (picklable) return value lands in ``MeshRun.extras[rank]``. For benchmarks.
        collective_timeout_s: the process groups' timeout (bounds a blocked collective).
        splits: one split per step (microbatches per dp replica, ``elastic.rebalance``'s data:
            meshspeak/rebalance.py), forced instead of measured; None: the even split.
        fresh: run in a pool of its own, closed afterwards, instead of the shared one.

    Raises:
        MeshRunError: a rank raised, died or timed out; the pool is killed, nothing is left hanging.
        ConfigError: the overrides do not describe a valid job for this mesh.
    """
    cfg = mesh_config(dp, pp, tp, overrides, schedule, virtual_stages)
    shape = MeshShape(dp, pp, tp)
    microbatches = microbatches_per_replica(cfg.train, dp)
    job = _Job(
        overrides=_job_overrides(overrides, shape, schedule, virtual_stages), layers_per_stage=stage_layers(cfg),
        steps=steps, first_step=first_step, collect_params=collect_params,
        collective_timeout_s=collective_timeout_s, instrument=instrument,
        splits=None if splits is None else tuple(tuple(split) for split in splits),
    )
    if splits is not None and len(splits) != steps:
        raise ValueError(f"splits: one per step, got {len(splits)} for {steps} steps")
    out, wall = _run_in_pool(job, shape.world, timeout, fresh=fresh,
                             what=f"run_mesh(dp={dp}, pp={pp}, tp={tp}, steps={steps})")
    results = {rank: out[rank]["results"] for rank in range(shape.world)}
    losses = _step_losses(results, steps, dp, first_step)
    params = _gathered_params(out, shape.world)
    return MeshRun(
        shape=shape, schedule=schedule, virtual_stages=virtual_stages, layers_per_stage=job.layers_per_stage,
        microbatches=microbatches, actions=make_schedule(schedule, pp, microbatches, virtual_stages),
        losses=losses, params=params, results=results,
        extras={rank: out[rank]["extra"] for rank in range(shape.world)},
        setup_s={rank: out[rank]["setup_s"] for rank in range(shape.world)},
        wall_s=wall,
    )


def _job_overrides(overrides: Sequence[str], shape: MeshShape, schedule: str, virtual_stages: int) -> tuple[str, ...]:
    """The caller's overrides completed with the mesh and pipeline keys (the ranks build their config
    from these alone)."""
    return (
        *overrides, f"mesh.dp={shape.dp}", f"mesh.pp={shape.pp}", f"mesh.tp={shape.tp}",
        f'pipeline.schedule="{schedule}"', f"pipeline.virtual_stages={virtual_stages}",
    )  # fmt: skip


def _run_in_pool(job: _Job, world: int, timeout: float, *, fresh: bool, what: str) -> tuple[dict, float]:
    """``job`` on ``world`` pool processes: (each rank's output, wall seconds once the workers were up).
    A run broken by a native crash is re-run once in fresh processes; any other failure is raised."""
    for attempt in (1, 2):
        pool = _Pool() if fresh else shared_pool()
        t0 = time.monotonic()
        try:
            pool.ensure(world)
            t0 = time.monotonic()
            out = pool.run(job, world, timeout)
            break
        except BaseException as error:
            # A failed, timed-out or interrupted run leaves ranks blocked in collectives: kill them all.
            if is_shared(pool):
                shutdown_pool()
            else:
                pool.close()
            if attempt == 1 and _native_crash(error):
                # Recorded, never silent: tests/conftest.py prints every record at the session's end.
                path = record_native_crash(error, what)
                warnings.warn(f"run_mesh: a rank crashed in native code; re-running once in fresh processes "
                              f"(docs/design.md, 'A rare native crash in the test pool'; recorded in {path}): "
                              f"{str(error).splitlines()[0]}",
                              stacklevel=3)
                continue
            raise
    wall = time.monotonic() - t0
    if fresh:
        pool.close()
    return out, wall


def _step_losses(results: dict[int, list], steps: int, dp: int, first_step: int) -> list[float]:
    """Each step's loss: the sum of the dp loss shares the ranks reported (one per replica)."""
    losses = []
    for i in range(steps):
        shares = [results[r][i].loss for r in results if results[r][i].loss is not None]
        if len(shares) != dp:
            raise MeshRunError(f"step {first_step + i}: {len(shares)} loss shares reported, expected dp={dp}")
        losses.append(float(sum(shares)))
    return losses


def _gathered_params(out: dict, world: int) -> dict[str, np.ndarray]:
    """The full parameters the ranks reported, each name from exactly one rank."""
    params: dict[str, np.ndarray] = {}
    for rank in range(world):
        for name, value in out[rank]["params"].items():
            if name in params:
                raise MeshRunError(f"parameter {name} reported by two ranks (rank {rank} is the second)")
            params[name] = value
    return params


# Signals with which glibc or the kernel stop a process whose native code (torch, gloo) broke: a heap
# check failing (SIGABRT, "malloc(): unaligned tcache chunk detected"), a bad access (SIGSEGV, SIGBUS).
# A Python exception, an injected exit (code > 0) or a kill (SIGKILL) is never one of these.
_NATIVE_CRASH_SIGNALS = (-signal.SIGABRT, -signal.SIGSEGV, -signal.SIGBUS)


def _native_crash(error: BaseException) -> bool:
    """A run ended because a rank died of a native crash (docs/design.md, "A rare native crash in the
    test pool": seen once in CI, not reproduced in hundreds of stressed runs; each rank's faulthandler
    stack is in the test's stderr)."""
    return (isinstance(error, MeshRunError) and error.ended_by == "died"
            and any(code in _NATIVE_CRASH_SIGNALS for code in error.died.values()))
