"""Run a real (dp, pp, tp) mesh of ``RankRuntime`` ranks on this machine, and the reference to compare with.

``run_mesh(dp, pp, tp, overrides, steps)`` trains ``steps`` optimizer steps on ``dp*pp*tp`` local gloo
ranks, exactly as the actors would (``build_process_groups`` + ``RankRuntime`` + the driver's schedule),
and returns a :class:`MeshRun`: the global per-step losses (the sum of every replica's share), the
unsharded final parameters of the whole model and every rank's ``StepResult`` s.
``reference(overrides, steps)`` runs the single-process ``ReferenceTrainer`` on the same config, once
per (overrides, steps) in a session.

Processes
    Ranks are plain ``multiprocessing.Process`` es (never ``torch.multiprocessing.start_processes``,
    whose ``join`` kills the world when one rank exits: cpu-gloo-facts gotcha 14). Starting a rank costs
    seconds on 2 cores (importing torch; 8 ranks take 10-15 s, gotcha 16), so the ranks are kept in a
    module-level *pool* and re-used: every run is a new generation (fresh store prefix ``gen<N>``, new
    process groups, new ``RankRuntime``) in the same processes, which is also how the elastic actors
    re-form. Workers come from a ``forkserver`` that has imported torch and the runtime once, so a new
    worker is a cheap fork instead of a fresh interpreter (no fork of this threaded parent). Every worker
    runs with one intra-op thread.

Failures never hang
    Results come back through a queue read with a timeout. If a rank raises, dies or the run passes
    its ``timeout``, the whole pool is killed (the other ranks may be blocked in a collective) and
    :class:`MeshRunError` is raised with each failed rank's traceback; the next run starts a new pool.

Stage split
    ``pipeline.layers`` when set, else ``balanced_split`` over per-layer parameter counts with the
    embedding added to the first layer and the final norm + head to the last
    (``orchestrator.mesh.stage_param_counts``), the counts taken from the real ``GPT`` built on the
    meta device: the same rule ``orchestrator.plan`` uses for the driver.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orchestrator.config import JobConfig, load_config, microbatches_per_replica
from orchestrator.mesh import MeshShape, balanced_split, stage_param_counts
from orchestrator.messages import StepResult
from orchestrator.schedule import Action, make_schedule

START_METHOD = "forkserver"
# Imported once by the fork server, so every forked rank starts with them loaded.
PRELOAD = ["torch", "torch.distributed", "numpy", "workers.runtime", "workers.groups"]
WORKER_START_TIMEOUT_S = 240.0  # first pool on a loaded 2-core machine: imports dominate
FAILURE_GRACE_S = 2.0  # after the first failure, wait this long for the other ranks' tracebacks
_QUIET_LOGGERS = (  # known noise (gotcha 15)
    "torch.distributed.tensor._redistribute",
    "torch.distributed.fsdp._fully_shard._fsdp_param",
)


class MeshRunError(RuntimeError):
    """A mesh run failed: a rank raised, died or timed out. The message holds every rank's traceback."""


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
    """Parameter counts of one block, the embedding and the head (final norm + output) of the real GPT."""
    import torch

    from workers.model import GPT

    with torch.device("meta"):
        model = GPT(model_cfg)

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters())

    return {
        "layer": count(model.layers["0"]),
        "embed": count(model.tok_embeddings),
        "head": count(model.norm) + count(model.output),
    }


def stage_layers(cfg: JobConfig) -> tuple[int, ...]:
    """Layers per stage (``pp * virtual_stages`` entries, stage order): see the module docstring."""
    if cfg.pipeline.layers:
        return tuple(cfg.pipeline.layers)
    counts = part_params(cfg.model)
    costs = stage_param_counts(cfg.model.n_layers, counts["layer"], counts["embed"], counts["head"])
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


def _run_job(rank: int, store_port: int, generation: int, job: _Job) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from orchestrator.messages import RuntimeSpec
    from workers.groups import build_process_groups
    from workers.runtime import RankRuntime

    t0 = time.perf_counter()
    cfg = load_config(None, list(job.overrides))
    shape = MeshShape(cfg.mesh.dp, cfg.mesh.pp, cfg.mesh.tp)
    v = cfg.pipeline.virtual_stages
    spec = RuntimeSpec(
        model=cfg.model,
        train=cfg.train,
        data_path=cfg.data.path,
        zero=cfg.mesh.zero,
        layers_per_stage=job.layers_per_stage,
        virtual_stages=v,
        collective_timeout_s=job.collective_timeout_s,
        use_gpu=False,
    )
    groups = build_process_groups(
        store_addr="127.0.0.1",
        store_port=store_port,
        generation=generation,
        shape=shape,
        world_rank=rank,
        timeout_s=job.collective_timeout_s,
        device=torch.device("cpu"),
    )
    runtime = RankRuntime(spec, groups)
    finish = job.instrument(runtime) if job.instrument is not None else None
    microbatches = microbatches_per_replica(cfg.train, shape.dp)
    actions = make_schedule(cfg.pipeline.schedule, shape.pp, microbatches, v)[groups.coords.pp]
    dist.barrier()  # every rank starts step 1 together, so step timings are comparable
    setup_s = time.perf_counter() - t0
    results = [runtime.train_step(s, actions) for s in range(job.first_step, job.first_step + job.steps)]
    params = runtime.full_state() if job.collect_params else {}
    extra = finish() if finish is not None else None
    runtime.destroy()
    return {"results": results, "params": params, "extra": extra, "setup_s": setup_s}


def _worker_main(worker_id: int, inbox: Any, outbox: Any) -> None:
    """A pool worker: run jobs from ``inbox`` until ``None``; every outcome goes to ``outbox``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import logging
    import warnings

    import torch

    torch.set_num_threads(1)
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # FSDP2 + SP + our stage outputs: harmless here, nothing modifies a stage output in place (gotcha 15).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    outbox.put(("ready", worker_id, 0, True, b""))
    while True:
        message = inbox.get()
        if message is None:
            return
        rank, store_port, generation, job = message
        try:
            # Plain pickle: the queue's ForkingPickler would hand tensors over through shared memory.
            payload = pickle.dumps(_run_job(rank, store_port, generation, job))
            outbox.put(("result", worker_id, generation, True, payload))
        except BaseException:  # noqa: BLE001 - everything goes back to the parent as text
            outbox.put(("result", worker_id, generation, False, traceback.format_exc()))
            # The other ranks may be blocked in a collective with us; the parent kills the pool.


# --- the parent side -----------------------------------------------------------------------------


class _Pool:
    def __init__(self) -> None:
        import datetime

        import torch.distributed as dist

        self.ctx = mp.get_context(START_METHOD)
        if START_METHOD == "forkserver":
            self.ctx.set_forkserver_preload(PRELOAD)
        # Driver-hosted store on a free port: it outlives every rank, and each run gets a fresh
        # "gen<N>" prefix inside build_process_groups (gotcha 5).
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip
        self.outbox = self.ctx.Queue()
        self.workers: list[tuple[mp.Process, Any]] = []
        self.generation = 0

    def ensure(self, n: int) -> None:
        """Grow the pool to ``n`` workers and wait until each has its imports done."""
        new = []
        for worker_id in range(len(self.workers), n):
            inbox = self.ctx.Queue()
            proc = self.ctx.Process(
                target=_worker_main, args=(worker_id, inbox, self.outbox), daemon=True,
                name=f"mesh-worker-{worker_id}",
            )  # fmt: skip
            proc.start()
            self.workers.append((proc, inbox))
            new.append(worker_id)
        pending = set(new)
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while pending:
            try:
                kind, worker_id, _, _, _ = self.outbox.get(timeout=0.5)
                if kind == "ready":
                    pending.discard(worker_id)
                continue
            except queue.Empty:
                pass
            dead = [w for w in pending if self.workers[w][0].exitcode is not None]
            if dead or time.monotonic() > deadline:
                codes = {w: self.workers[w][0].exitcode for w in sorted(pending)}
                raise MeshRunError(f"pool workers did not start (worker -> exit code): {codes}")

    def run(self, job: _Job, world: int, timeout: float) -> dict[int, dict[str, Any]]:
        self.ensure(world)
        self.generation += 1
        generation = self.generation
        for rank in range(world):
            self.workers[rank][1].put((rank, self.store.port, generation, job))
        done: dict[int, dict[str, Any]] = {}
        failed: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(done) + len(failed) < world:
            try:
                kind, worker_id, gen, ok, payload = self.outbox.get(timeout=0.5)
                if kind == "result" and gen == generation:
                    if ok:
                        done[worker_id] = pickle.loads(payload)
                    else:
                        failed[worker_id] = payload
                        deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                continue
            except queue.Empty:
                pass
            dead = {
                r: self.workers[r][0].exitcode
                for r in range(world)
                if r not in done and r not in failed and self.workers[r][0].exitcode is not None
            }
            if dead or time.monotonic() > deadline:
                missing = [r for r in range(world) if r not in done and r not in failed and r not in dead]
                why = []
                if dead:
                    why.append(f"ranks died (rank -> exit code): {dead}")
                if failed:
                    why.append(f"ranks raised: {sorted(failed)}")
                if missing:
                    why.append(f"no result from ranks {missing} (killed after the timeout or the first failure)")
                raise MeshRunError(_failure_text(world, timeout, why, failed))
        if failed:
            raise MeshRunError(_failure_text(world, timeout, [f"ranks raised: {sorted(failed)}"], failed))
        return done

    def close(self) -> None:
        for proc, inbox in self.workers:
            if proc.is_alive():
                try:
                    inbox.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + 3.0
        for proc, _ in self.workers:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc, _ in self.workers:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for _, inbox in self.workers:
            inbox.close()
            inbox.cancel_join_thread()
        self.outbox.close()
        self.outbox.cancel_join_thread()
        self.workers.clear()


def _failure_text(world: int, timeout: float, why: list[str], failed: dict[int, str]) -> str:
    head = f"mesh run of {world} ranks failed (timeout {timeout:.0f}s): " + "; ".join(why)
    return "\n".join([head, *(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))])


_POOL: _Pool | None = None


def shutdown_pool() -> None:
    """Stop the shared worker pool (a later run starts a new one). Safe to call at any time."""
    global _POOL
    pool, _POOL = _POOL, None
    if pool is not None:
        pool.close()


atexit.register(shutdown_pool)


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
        fresh: run in a pool of its own, closed afterwards, instead of the shared one.

    Raises:
        MeshRunError: a rank raised, died or timed out; the pool is killed, nothing is left hanging.
        ConfigError: the overrides do not describe a valid job for this mesh.
    """
    global _POOL
    cfg = mesh_config(dp, pp, tp, overrides, schedule, virtual_stages)
    layers = stage_layers(cfg)
    shape = MeshShape(dp, pp, tp)
    microbatches = microbatches_per_replica(cfg.train, dp)
    job = _Job(
        overrides=(
            *overrides, f"mesh.dp={dp}", f"mesh.pp={pp}", f"mesh.tp={tp}",
            f'pipeline.schedule="{schedule}"', f"pipeline.virtual_stages={virtual_stages}",
        ),
        layers_per_stage=layers,
        steps=steps,
        first_step=first_step,
        collect_params=collect_params,
        collective_timeout_s=collective_timeout_s,
        instrument=instrument,
    )  # fmt: skip
    if fresh:
        pool = _Pool()
    else:
        if _POOL is None:
            _POOL = _Pool()
        pool = _POOL
    t0 = time.monotonic()
    try:
        pool.ensure(shape.world)
        t0 = time.monotonic()
        out = pool.run(job, shape.world, timeout)
    except BaseException:
        # A failed, timed-out or interrupted run leaves ranks blocked in collectives: kill them all.
        if pool is _POOL:
            shutdown_pool()
        else:
            pool.close()
        raise
    wall = time.monotonic() - t0
    if fresh:
        pool.close()

    results = {rank: out[rank]["results"] for rank in range(shape.world)}
    losses = []
    for i in range(steps):
        shares = [results[r][i].loss for r in results if results[r][i].loss is not None]
        if len(shares) != dp:
            raise MeshRunError(f"step {first_step + i}: {len(shares)} loss shares reported, expected dp={dp}")
        losses.append(float(sum(shares)))
    params: dict[str, np.ndarray] = {}
    for rank in range(shape.world):
        for name, value in out[rank]["params"].items():
            if name in params:
                raise MeshRunError(f"parameter {name} reported by two ranks (rank {rank} is the second)")
            params[name] = value
    return MeshRun(
        shape=shape,
        schedule=schedule,
        virtual_stages=virtual_stages,
        layers_per_stage=layers,
        microbatches=microbatches,
        actions=make_schedule(schedule, pp, microbatches, virtual_stages),
        losses=losses,
        params=params,
        results=results,
        extras={rank: out[rank]["extra"] for rank in range(shape.world)},
        setup_s={rank: out[rank]["setup_s"] for rank in range(shape.world)},
        wall_s=wall,
    )


# --- the single-process reference ----------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    losses: tuple[float, ...]
    params: dict[str, np.ndarray]  # read-only arrays: the object is shared by every caller


def reference(overrides: Sequence[str] = (), steps: int = 10) -> Reference:
    """The single-process ``ReferenceTrainer`` on steps 1..``steps``, cached per (overrides, steps).

    Only the ``model.``, ``train.`` and ``data.`` overrides matter (and are the cache key): the mesh and
    the schedule must not change the math, which is what the mesh tests check.
    """
    keep = tuple(o for o in overrides if o.split(".", 1)[0].strip() in ("model", "train", "data"))
    return _reference(keep, steps)


@functools.lru_cache(maxsize=None)
def _reference(overrides: tuple[str, ...], steps: int) -> Reference:
    import torch

    from workers.reference import ReferenceTrainer

    cfg = load_config(None, [*overrides, "mesh.dp=1", "mesh.pp=1", "mesh.tp=1"])
    # One intra-op thread, like the ranks: on 2 busy cores OpenMP's spinning threads make a step
    # of the tiny model 10-50x slower (measured 45 ms vs 0.4-3.5 s at load ~10).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = ReferenceTrainer(cfg.model, cfg.train, cfg.data.path)
        losses = tuple(trainer.run(1, steps))
        params = trainer.params()
    finally:
        torch.set_num_threads(threads)
    for value in params.values():
        value.setflags(write=False)
    return Reference(losses=losses, params=params)
