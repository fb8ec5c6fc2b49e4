"""The outside oracle for PowerSGD's loss gap: torch's own DDP with ``powerSGD_hook``, same model, data and math.

Usage: ``python bench/powersgd_ddp_oracle.py [--config NAME ...] [--variant NAME ...] [--steps N] [--quick]
[--out PATH]``; writes (merges into) ``bench/results/powersgd_ddp_oracle.json`` and prints one line per run.

bench/powersgd_convergence.py measures how far PowerSGD ends from the uncompressed run on elastimesh's
meshes (FSDP2's all-reduce hook handing each unit to torch's DDP hook, workers/compression.py). Whether
that gap is PowerSGD's or the adapter's is answered here: the same configs and variants
(``powersgd_convergence.CONFIGS`` / ``VARIANTS``) on two spawned gloo ranks (dp = 2) running torch's
``DistributedDataParallel`` with ``register_comm_hook(state, powerSGD_hook)``: the state made by
``workers.compression.powersgd_state`` (the runtime's settings: rank, ``start_powerSGD_iter`` =
``train.powersgd_plain_steps``, seed, epsilon), knobs set by ``powersgd_probes.set_knobs``; the step
is ``ddp_loop.DDPLoop.step`` (the same samples per replica, summed-token loss over the global count,
all-reduce on the last microbatch only, global-norm clipping, AdamW, warm-up + cosine lr).

DDP runs with one bucket (``bucket_cap_mb`` = 1024): with several buckets the hook's chained
asynchronous all-reduces were issued in different orders on the two ranks and gloo aborted with a
size mismatch. Each run records DDP's bucket sizes and fails unless there is exactly one (so only
models under 1 GiB of gradients: every config here).

For each run: ``final_loss`` (the mean of the last ``TAIL`` steps' global losses, as
powersgd_convergence), the per-step losses and bytes all-reduced per step (rank 0; the hook's
all-reduces counted by ``workers.compression.ByteCounter``, or the parameters' bytes without a hook).
``summary``: per compressed run, its gap against DDP's uncompressed run of the same config, and beside
it elastimesh's gap for the same (config, variant, steps) read from ``bench/results/powersgd.json``
(null where that file has no such run), and how far DDP's uncompressed final loss is from
elastimesh's (the same math: it should be ~0).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

# bench/ is on sys.path; importing common puts the repository root there too.
from common import RESULTS, environment, load_average, parser, write_result
from powersgd_convergence import CONFIGS, TAIL, VARIANTS
from powersgd_convergence import summarise as summarise_mesh

from testbed.gloo_world import run_ranks

WORLD = 2
BUCKET_MB = 1024
MESH_RESULTS = RESULTS / "powersgd.json"


def _rank(rank: int, port: int, overrides: tuple[str, ...], knobs: dict, steps: int) -> dict:
    from datetime import timedelta

    import torch.distributed as dist
    from ddp_loop import DDPLoop
    from powersgd_probes import set_knobs
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    from orchestrator.config.load import load_config
    from workers.compression import ByteCounter, powersgd_state

    timeout = timedelta(seconds=600)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    train = load_config(None, list(overrides)).train
    counter = ByteCounter()

    def wrap(model):
        ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        if train.grad_compression == "powersgd":
            state = powersgd_state(None, train.powersgd_rank, counter, train.seed, train.powersgd_plain_steps)
            set_knobs(state, knobs)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return ddp

    loop = DDPLoop(list(overrides), wrap=wrap, rank=rank, world=WORLD)
    param_bytes = sum(p.numel() * p.element_size() for p in loop.params if p.requires_grad)
    losses, sent = [], []
    for step in range(1, steps + 1):
        losses.append(loop.step(step))
        sent.append(counter.take() if train.grad_compression == "powersgd" else param_bytes)
    buckets = loop.model._get_ddp_logging_data().get("bucket_sizes")
    dist.destroy_process_group()
    return {"losses": losses, "bytes": sent, "bucket_sizes": buckets}


def run_one(config: str, variant: str, steps: int) -> dict:
    extra, knobs = VARIANTS[variant]
    overrides = (*CONFIGS[config], *extra, f"train.steps={steps}", "mesh.zero=0", f"mesh.dp={WORLD}")
    load0, t0 = load_average(), time.monotonic()
    ranks = run_ranks(WORLD, _rank, overrides, knobs, steps, timeout=3000)
    wall = time.monotonic() - t0
    buckets = ranks[0]["bucket_sizes"]  # DDP's logging data: the sizes as one comma-separated string
    if len(str(buckets).split(",")) != 1:
        raise RuntimeError(f"{config} {variant}: DDP made several buckets ({buckets}); the oracle needs one")
    losses = [float(sum(r["losses"][i] for r in ranks)) for i in range(steps)]
    sent = ranks[0]["bytes"]
    return {"config": config, "variant": variant, "steps": steps, "overrides": list(overrides), "knobs": knobs,
            "final_loss": float(np.mean(losses[-TAIL:])), "losses": [round(x, 5) for x in losses],
            "bytes_compressed_step": sent[-1], "bytes_first_step": sent[0], "bytes_mean": float(np.mean(sent)),
            "bucket_sizes": buckets, "wall_s": round(wall, 1), "load_average": [load0, load_average()]}


def summarise(runs: list[dict], mesh_runs: list[dict]) -> list[dict]:
    """Per compressed DDP run: its gap against DDP's plain run, beside elastimesh's for the same run."""
    plain = {(r["config"], r["steps"]): r for r in runs if r["variant"] == "plain"}
    mesh_rows = {(r["config"], r["variant"], r["steps"]): r for r in summarise_mesh(mesh_runs)}
    mesh_plain = {(r["config"], r["steps"]): r for r in mesh_runs if r["variant"] == "plain"}
    rows = []
    for r in runs:
        base = plain.get((r["config"], r["steps"]))
        if r["variant"] == "plain" or base is None:
            continue
        mesh = mesh_rows.get((r["config"], r["variant"], r["steps"]))
        mesh_base = mesh_plain.get((r["config"], r["steps"]))
        rows.append({"config": r["config"], "variant": r["variant"], "steps": r["steps"],
                     "ddp_plain_loss": round(base["final_loss"], 4), "ddp_powersgd_loss": round(r["final_loss"], 4),
                     "ddp_gap": round(r["final_loss"] / base["final_loss"] - 1, 4),
                     "ddp_bytes_ratio": round(base["bytes_compressed_step"] / r["bytes_compressed_step"], 2),
                     "elastimesh_gap": mesh["gap"] if mesh else None,
                     "elastimesh_bytes_ratio": mesh["bytes_ratio"] if mesh else None,
                     # same math, uncompressed: DDP's final loss against elastimesh's (relative)
                     "plain_ddp_vs_elastimesh": (round(base["final_loss"] / mesh_base["final_loss"] - 1, 6)
                                                 if mesh_base else None)})
    return sorted(rows, key=lambda row: (row["config"], row["variant"]))


def main() -> None:
    p = parser(__doc__, "powersgd_ddp_oracle", "20 steps of the default lr config, plain and r2 (a smoke run)")
    p.add_argument("--config", action="append", choices=sorted(CONFIGS))
    p.add_argument("--variant", action="append", choices=sorted(VARIANTS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--mesh-results", type=Path, default=MESH_RESULTS,
                   help="powersgd_convergence's results, for elastimesh's gaps beside DDP's")
    args = p.parse_args()
    configs = args.config or (["d64_b8_lr3e-3"] if args.quick else ["d64_b8_lr3e-3", "d64_b8_lr1e-3", "d64_b8_lr3e-4"])
    variants = args.variant or (["plain", "r2"] if args.quick else ["plain", "r2", "r8"])
    steps = 20 if args.quick else args.steps
    mesh_runs = json.loads(args.mesh_results.read_text())["runs"] if args.mesh_results.exists() else []
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    runs = {(r["config"], r["variant"], r["steps"]): r for r in previous.get("runs", [])}
    for config in configs:
        for variant in variants:
            r = run_one(config, variant, steps)
            runs[(config, variant, steps)] = r
            print(f"DDP {config} {variant} steps={steps}: final loss {r['final_loss']:.4f}, bytes/step "
                  f"{r['bytes_first_step']} -> {r['bytes_compressed_step']}, {r['wall_s']} s", flush=True)
            write_result(args.out, {
                "benchmark": "powersgd_ddp_oracle", "quick": args.quick, "tail_steps": TAIL,
                "mesh": f"torch DDP, dp={WORLD} spawned gloo ranks, one bucket, built-in corpus",
                "mesh_results": str(args.mesh_results.name), "environment": environment(),
                "summary": summarise(list(runs.values()), mesh_runs), "runs": list(runs.values())})
    for row in summarise(list(runs.values()), mesh_runs):
        print(row)


if __name__ == "__main__":
    main()
