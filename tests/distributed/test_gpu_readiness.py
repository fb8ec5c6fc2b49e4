"""What the first GPU run needs from a rank, shown on local gloo ranks (issue 26).

* Leaving a generation releases it: FSDP2's modules sit in reference cycles, so the actor's leave
  runs the cyclic GC (and empties CUDA's cache on a GPU) before the next generation is built. With
  automatic GC off, a weakref to a stage module and to a parameter is dead right after
  ``RankActor._leave``.
* ``mesh.cpu_offload``: every parameter's local shard is on the CPU when FSDP2 first runs (its lazy
  init refuses any other device under ``CPUOffloadPolicy``), whatever device the rank computes on.
* A rebuild that the driver resumes (``RuntimeSpec.load_follows``) skips the random init the load
  would overwrite, refuses to train before the load came, and after it holds the saved parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from testbed.rank_pool import shared_pool, shutdown_pool
from testbed.world import mesh_config, stage_layers

SMALL = ("model.d_model=32", "model.n_heads=4", "model.seq_len=32", "model.n_layers=2",
         "train.global_batch_size=4", "train.micro_batch_size=1")


@pytest.fixture(scope="module", autouse=True)
def _worker_pool():
    yield
    shutdown_pool()


def build_runtime(rank: int, store_port: int, generation: int, dp: int, overrides: tuple[str, ...], *,
                  load_follows: bool = False, prefix: str | None = None):
    """(runtime, this rank's action list) for a (dp, 1, 1) mesh, as the actor builds it."""
    import dataclasses

    import torch

    from meshspeak.mesh import MeshShape
    from meshspeak.schedule import make_schedule
    from meshspeak.sections import microbatches_per_replica
    from orchestrator.control.generation import runtime_spec
    from orchestrator.plan.mesh_plan import make_plan
    from workers.groups import build_process_groups
    from workers.runtime import RankRuntime

    cfg = mesh_config(dp, 1, 1, overrides)
    shape = MeshShape(dp, 1, 1)
    # The driver's own construction (testbed/world.py does the same); the stage split and the groups'
    # timeout are the test's.
    spec = dataclasses.replace(
        runtime_spec(cfg, make_plan(cfg), data_path=cfg.data.path, use_gpu=False, mask_eos_id=None,
                     resuming=False, load_follows=load_follows),
        layers_per_stage=stage_layers(cfg), collective_timeout_s=60.0)
    groups = build_process_groups(store_addr="127.0.0.1", store_port=store_port, generation=generation,
                                  shape=shape, world_rank=rank, timeout_s=60.0, device=torch.device("cpu"),
                                  store_prefix=prefix)
    actions = make_schedule(cfg.pipeline.schedule, 1, microbatches_per_replica(cfg.train, dp), 1)[0]
    return RankRuntime(spec, groups), actions


@dataclass(frozen=True)
class _LeaveReleases:
    def __call__(self, rank: int, store_port: int, generation: int) -> dict:
        import gc
        import weakref

        from workers.actor import RankActor

        actor = RankActor(rank)
        gc.collect()
        gc.disable()  # only the leave may collect: what it leaves alive stays alive
        try:
            actor.runtime, actions = build_runtime(rank, store_port, generation, 2, SMALL)
            actor.runtime.train_step(1, actions)
            stage = next(iter(actor.runtime.stages.values())).module
            refs = {"module": weakref.ref(stage), "parameter": weakref.ref(actor.runtime.params[0])}
            fsdp = type(stage).__name__
            del stage
            actor._leave()
            return {"alive": sorted(k for k, r in refs.items() if r() is not None), "class": fsdp}
        finally:
            gc.enable()


@pytest.mark.timeout(900)
def test_leaving_a_generation_releases_its_modules():
    pool = shared_pool()
    pool.ensure(2)
    out = pool.run(_LeaveReleases(), 2, 600)
    for rank in (0, 1):
        assert out[rank]["class"].startswith("FSDP")  # the cycles to free are FSDP2's
        assert out[rank]["alive"] == [], rank


@dataclass(frozen=True)
class _OffloadBuild:
    """Build a stage for a compute device that is not the host ("meta" stands in for CUDA here)
    with mesh.cpu_offload; report where the shards are and run FSDP2's own check from its lazy init."""

    def __call__(self, rank: int, store_port: int, generation: int) -> dict:
        import torch
        from torch.distributed.tensor import DTensor

        from meshmodels.build import build_local_stage
        from meshmodels.family import resolve_model
        from meshspeak.mesh import MeshShape
        from orchestrator.plan.mesh_plan import make_plan
        from workers.groups import build_process_groups
        from workers.parallelize import parallelize_stage

        cfg = mesh_config(2, 1, 1, (*SMALL, "mesh.cpu_offload=true"))
        resolved = resolve_model(cfg.model)
        dp_plan = make_plan(cfg).dp  # the driver's decision: FSDP2 over dp with CPUOffloadPolicy
        groups = build_process_groups(store_addr="127.0.0.1", store_port=store_port, generation=generation,
                                      shape=MeshShape(2, 1, 1), world_rank=rank, timeout_s=60.0,
                                      device=torch.device("cpu"))
        try:
            module = build_local_stage(
                resolved.family, resolved.shape, range(resolved.shape.n_layers), device=torch.device("meta"),
                seed=0, cpu_offload=True,
                parallelize=lambda m: parallelize_stage(
                    m, resolved.family, dp_plan, dp_mesh=groups.dp_mesh, tp_mesh=groups.tp_mesh,
                    param_dtype=torch.float32))
            devices = {name: (p.to_local() if isinstance(p, DTensor) else p).device.type
                       for name, p in module.named_parameters()}
            checked = 0
            for sub in module.modules():
                if hasattr(sub, "_get_fsdp_state") and sub._get_fsdp_state()._fsdp_param_group is not None:
                    sub._get_fsdp_state()._fsdp_param_group._validate_cpu_offload_params()  # raises if not
                    checked += 1
            return {"devices": devices, "checked": checked}
        finally:
            groups.destroy()


@pytest.mark.timeout(900)
def test_offloaded_parameters_are_made_on_the_host_before_fsdp_initialises():
    pool = shared_pool()
    pool.ensure(2)
    out = pool.run(_OffloadBuild(), 2, 600)
    for rank in (0, 1):
        assert out[rank]["devices"] and set(out[rank]["devices"].values()) == {"cpu"}, out[rank]["devices"]
        assert out[rank]["checked"] >= 2  # the blocks' groups and the root's


@dataclass(frozen=True)
class _LoadFollows:
    path: str

    def __call__(self, rank: int, store_port: int, generation: int) -> dict:
        import numpy as np

        from meshmodels import build

        first, actions = build_runtime(rank, store_port, generation, 2, SMALL)
        first.train_step(1, actions)
        first.save_checkpoint(self.path, 1)
        first.wait_checkpoint()
        saved = first.full_state()
        first.destroy()
        inits = []
        real_init = build.init_local
        build.init_local = lambda *a, **k: inits.append(1) or real_init(*a, **k)
        try:
            second, _ = build_runtime(rank, store_port, generation, 2, SMALL, load_follows=True,
                                      prefix=f"readiness-{generation}-second")
        finally:
            build.init_local = real_init
        try:
            second.train_step(2, actions)
            refused = ""
        except RuntimeError as exc:
            refused = str(exc)
        second.load_checkpoint(self.path)
        loaded = second.full_state()
        result = second.train_step(2, actions)
        second.destroy()
        return {"inits": len(inits), "refused": refused, "ok": result.ok,
                "same": sorted(saved) == sorted(loaded) and all(np.array_equal(saved[k], loaded[k]) for k in saved)}


@pytest.mark.timeout(900)
def test_a_resumed_rebuild_skips_the_random_init_and_trains_only_after_the_load(tmp_path):
    pool = shared_pool()
    pool.ensure(2)
    out = pool.run(_LoadFollows(str(tmp_path / "step-1")), 2, 600)
    for rank in (0, 1):
        assert out[rank]["inits"] == 0, rank
        assert "never came" in out[rank]["refused"], rank
        assert out[rank]["same"] and out[rank]["ok"], rank
