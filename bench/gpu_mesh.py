"""Part (d) of bench/gpu.py: NCCL meshes on Ray actors with one GPU each, and a killed rank recovered.

The real driver path: a ``StoreHost``, a ``WorkerGroup`` of rank actors asking for one GPU each, and
the ``Controller``. Each of the meshes (2,1,1), (1,2,1), (1,1,2) trains 10 fp32 steps; its per-step
losses must equal the single-process ``ReferenceTrainer`` on the CPU within 1e-4 relative (TF32 off
in the actors: ``NVIDIA_TF32_OVERRIDE=0`` through Ray's runtime env). Then a dp=2 run checkpoints
every 2 steps and rank 1 SIGKILLs itself 0.2 s into step 5: the run must finish all steps (shrunk,
and grown back onto the freed GPU when the controller finds it), with the reference's losses.

In a dry run (``bench/gpu.py --dry-run --ray``) the same code runs on CPU actors with gloo.
"""

from __future__ import annotations

import json
import os

import torch

MODEL = ["model.d_model=64", "model.n_heads=4", "model.n_layers=4", "model.seq_len=64",
         "train.global_batch_size=8", "train.micro_batch_size=1"]
STEPS, FAIL_STEP, VICTIM = 10, 5, 1
LOSS_RTOL = 1e-4


def part_nccl_mesh(dry: bool, run: bool, workdir: str) -> dict:
    gpus = torch.cuda.device_count()
    if not run:
        return {"skipped": "dry run: part d starts Ray actors (minutes on a small CPU); "
                           "--dry-run --ray runs it on CPU actors"}
    if not dry and gpus < 2:
        return {"skipped": f"needs >= 2 GPUs for NCCL meshes; this machine has {gpus}"}
    import ray

    from workers.store import StoreHost

    env = {"NVIDIA_TF32_OVERRIDE": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 4), num_gpus=0 if dry else gpus,
             include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        host = StoreHost.remote()  # keep the handle: the store lives as long as the actor
        store = ray.get(host.address.remote(), timeout=120)
        out: dict = {"meshes": {}}
        for shape in ((2, 1, 1), (1, 2, 1), (1, 1, 2)):
            out["meshes"]["dp{}-pp{}-tp{}".format(*shape)] = _train(shape, dry, store, workdir)
        out["recovery"] = _train((2, 1, 1), dry, store, workdir, kill=True)
    finally:
        ray.shutdown()
    runs = [*out["meshes"].values(), out["recovery"]]
    out["goal"] = f"every mesh and the recovered run within {LOSS_RTOL} of the reference; the kill recovered"
    out["goal_met"] = all(r["max_rel_diff"] <= LOSS_RTOL and r["final_step"] == STEPS for r in runs) and \
        out["recovery"].get("rebuilds", 0) >= 1
    return out


def _train(shape: tuple[int, int, int], dry: bool, store, workdir: str, kill: bool = False) -> dict:
    from meshdata import open_source
    from meshspeak.rank_calls import RankCalls
    from orchestrator.cluster.worker_group import ActorResources, WorkerGroup
    from orchestrator.config.load import load_config
    from orchestrator.control.controller import Controller
    from orchestrator.metrics import MetricsLog
    from testbed.driver_steps import form_first_generation
    from testbed.reference import reference

    dp, pp, tp = shape
    name = "recovery" if kill else f"dp{dp}-pp{pp}-tp{tp}"
    metrics_path = os.path.join(workdir, f"{name}.jsonl")
    overrides = [*MODEL, f"mesh.dp={dp}", f"mesh.pp={pp}", f"mesh.tp={tp}", f"train.steps={STEPS}",
                 f"metrics.path={metrics_path}", "elastic.collective_timeout_s=60"]
    if kill:
        overrides += ["checkpoint.every=2", f"checkpoint.dir={os.path.join(workdir, 'ckpt')}",
                      "elastic.grow_check_s=1"]
    else:
        overrides += ["elastic.grow_check_s=1e6"]
    cfg = load_config(None, overrides)
    group = WorkerGroup(ActorResources(cpus=1, gpus=0 if dry else 1), placement_timeout_s=300)
    group.add(cfg.mesh.world)
    try:
        controller = Controller(cfg, group, metrics=MetricsLog(cfg.metrics, progress_total=None, ray_metrics=False),
                                store_address=store, use_gpu=not dry, data_path=open_source(cfg.data.path).name)
        formed = form_first_generation(controller)
        if kill:
            victim = formed[VICTIM]
            group.call([victim], RankCalls.arm_fault, (FAIL_STEP, "kill", 0.2), timeout_s=30)
        summary = controller.run()
        controller.metrics.close()
    finally:
        group.shutdown()
    ref_losses = list(reference(overrides, STEPS).losses)  # one CPU process, cached across the runs
    losses = [summary.losses[s] for s in range(1, STEPS + 1)]
    records = [json.loads(line) for line in open(metrics_path)]
    rebuilds = [r for r in records if r.get("event") in ("rebuild", "grow")]
    result = {"losses": losses, "reference": ref_losses, "final_step": summary.final_step,
              "max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
              "generations": summary.generations}
    if kill:
        failure = next((r for r in records if r.get("event") == "failure"), {})
        result.update(failure_step=failure.get("step"), failure_reason=failure.get("reason"),
                      rebuilds=len(rebuilds), recovery_s=[r.get("recovery_s") for r in rebuilds],
                      resumed_from=[r.get("resumed_from_step") for r in rebuilds],
                      dp_after=[r.get("dp") for r in rebuilds])
    return result
