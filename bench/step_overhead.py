"""Goal (a): one rank, one process: elastimesh's step time vs a plain PyTorch training loop.

Both sides train the same model on the same samples with the same math (AdamW, global-norm clipping,
warm-up + cosine LR), in this one process, on the CPU:

* **elastimesh**: a world-1 gloo process group (an in-process ``TCPStore`` on port 0,
  ``build_process_groups`` with dp = pp = tp = 1) and a ``RankRuntime`` running the driver-made
  1F1B action list through the pipeline executor, exactly as a rank actor does (minus Ray).
* **plain PyTorch**: ``workers.reference.ReferenceTrainer``: the whole model, a loop over the
  microbatches, ``loss.backward()``, clip, ``optimizer.step()``.

Each side is warmed up, then the measured steps run in alternating blocks (A B A B ...) so that
drift in machine load (other processes, thermal) hits both sides alike; each side runs the same step
numbers, so the losses must agree (they are compared and reported). The figure is the ratio of the
median step times (goal: <= 1.05); its spread is that of the per-block ratios (``ratio_per_block``:
each block of elastimesh steps over the plain block interleaved with it; ``blocks_meeting_goal``).

    python bench/step_overhead.py [--steps N] [--quick] [--threads T] [--out PATH]

Writes ``bench/results/step_overhead.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

# bench/ is on sys.path; importing common puts the repository root there too (for workers.*).
from common import bench_config, environment, load_average, parser, rank_runtime, write_result
from stats import paired_ratios, repeats_meeting, spread

from workers.reference import ReferenceTrainer

GOAL_RATIO = 1.05
# A step of ~0.3 s on one CPU thread: compute dominates any fixed per-step cost.
FULL_MODEL = {"n_layers": 4, "d_model": 256, "n_heads": 8, "seq_len": 128}
FULL_TRAIN = {"global_batch_size": 8, "micro_batch_size": 2}
# --quick: the default tiny model, a few steps (a smoke run for the tests, not a measurement).
QUICK_MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 64}
QUICK_TRAIN = {"global_batch_size": 4, "micro_batch_size": 2}


def build_runtime(cfg):
    """A world-1 process group + RankRuntime in this process (what a rank actor builds, minus Ray)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    runtime, actions = rank_runtime(cfg, store_port=store.port, timeout_s=60)
    return store, runtime, actions


def run(steps: int, warmup: int, block: int, threads: int, quick: bool) -> dict:
    torch.set_num_threads(threads)
    model, train = (QUICK_MODEL, QUICK_TRAIN) if quick else (FULL_MODEL, FULL_TRAIN)
    total_steps = warmup + steps
    # The LR schedule depends on train.steps; give it the real length of the run so both sides see
    # a non-degenerate cosine decay.
    cfg = bench_config(model, steps=total_steps, global_batch=train["global_batch_size"],
                       micro_batch=train["micro_batch_size"])

    store, runtime, actions = build_runtime(cfg)
    reference = ReferenceTrainer(cfg.model, cfg.train, cfg.data.path)
    num_params = sum(p.numel() for p in reference.model.parameters())

    def mesh_step(step: int) -> float:
        return runtime.train_step(step, actions).loss

    sides = {"elastimesh": mesh_step, "plain": reference.step}
    load_before = load_average()
    try:
        times, cpu_times, losses = _interleave(sides, warmup, total_steps, block)
    finally:
        runtime.destroy()
        del store
    per_block = block_ratios(times["elastimesh"], times["plain"], block)
    return {
        **_figures(times, cpu_times, losses, total_steps, quick),
        "ratio_per_block": spread(per_block),
        "blocks_meeting_goal": repeats_meeting(per_block, lambda r: r <= GOAL_RATIO)[0],
        "cpu_ratio_per_block": spread(block_ratios(cpu_times["elastimesh"], cpu_times["plain"], block)),
        "config": _config(cfg, num_params, warmup=warmup, steps=steps, block=block, threads=threads),
        "environment": {**environment(), "machine": platform.machine(),
                        "load_average_before": load_before, "load_average_after": load_average()},
    }


def _interleave(sides: dict, warmup: int, total_steps: int, block: int) -> tuple[dict, dict, dict]:
    """Both sides' warm-up, then blocks of ``block`` steps in turn, A B then B A: each side's wall and
    CPU seconds of the measured steps, and every step's loss."""
    times = {"elastimesh": [], "plain": []}
    cpu_times = {"elastimesh": [], "plain": []}
    losses = {"elastimesh": {}, "plain": {}}

    def run_block(name: str, first: int, count: int, record: bool) -> None:
        fn = sides[name]
        for step in range(first, first + count):
            c0, t0 = time.process_time(), time.perf_counter()
            loss = fn(step)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            losses[name][step] = loss
            if record:
                times[name].append(dt)
                cpu_times[name].append(dc)

    # Warm-up: first-touch allocations, autograd graph caches, the data cache.
    for name in sides:
        run_block(name, 1, warmup, record=False)
    step = warmup + 1
    order = ["elastimesh", "plain"]
    blocks = 0
    while step <= total_steps:
        count = min(block, total_steps - step + 1)
        # A B, then B A: each side goes first in half of the rounds.
        pair = order if blocks % 2 == 0 else order[::-1]
        for name in pair:
            run_block(name, step, count, record=True)
        step += count
        blocks += 1
    return times, cpu_times, losses


def block_ratios(mesh_times: list[float], plain_times: list[float], block: int) -> list[float | None]:
    """Block by block (``block`` steps each, in the order they ran, A B / B A), the elastimesh block's
    time over the plain block interleaved with it: the repeats the headline's spread is taken over."""
    def sums(times: list[float]) -> list[float]:
        return [sum(times[i:i + block]) for i in range(0, len(times), block)]

    return paired_ratios(sums(mesh_times), sums(plain_times))


def _figures(times: dict, cpu_times: dict, losses: dict, total_steps: int, quick: bool) -> dict:
    """The goal's ratio of median step times, the spread, the CPU cross-check, the losses compared."""
    mesh_losses = [losses["elastimesh"][s] for s in range(1, total_steps + 1)]
    plain_losses = [losses["plain"][s] for s in range(1, total_steps + 1)]
    max_abs = max(abs(a - b) for a, b in zip(mesh_losses, plain_losses))
    max_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(mesh_losses, plain_losses))
    med_mesh = statistics.median(times["elastimesh"])
    med_plain = statistics.median(times["plain"])
    ratio = med_mesh / med_plain
    cpu_med = {k: statistics.median(v) for k, v in cpu_times.items()}
    return {
        "benchmark": "step_overhead",
        "goal": "elastimesh median step time / plain PyTorch median step time <= 1.05 "
        "(one rank, one process)",
        "goal_ratio": GOAL_RATIO,
        "ratio": ratio,
        "goal_met": ratio <= GOAL_RATIO,
        "quick": quick,
        "median_step_s": {"elastimesh": med_mesh, "plain": med_plain},
        "mean_step_s": {k: statistics.fmean(v) for k, v in times.items()},
        "min_step_s": {k: min(v) for k, v in times.items()},
        "min_ratio": min(times["elastimesh"]) / min(times["plain"]),
        "step_times_s": times,
        # Process CPU seconds per step: far less sensitive than wall time to other processes
        # competing for the cores, so a cross-check when the machine is shared.
        "median_step_cpu_s": cpu_med,
        "cpu_ratio": cpu_med["elastimesh"] / cpu_med["plain"],
        "step_cpu_times_s": cpu_times,
        "losses": {"elastimesh": mesh_losses, "plain": plain_losses},
        "losses_match": max_rel < 1e-5,
        "loss_max_abs_diff": max_abs,
        "loss_max_rel_diff": max_rel,
    }


def _config(cfg, num_params: int, *, warmup: int, steps: int, block: int, threads: int) -> dict:
    return {
        "model": {
            k: getattr(cfg.model, k)
            for k in ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len", "ffn_dim")
        },
        "num_params": num_params,
        "global_batch_size": cfg.train.global_batch_size,
        "micro_batch_size": cfg.train.micro_batch_size,
        "dtype": cfg.train.dtype,
        "grad_clip": cfg.train.grad_clip,
        "mesh": {"dp": 1, "pp": 1, "tp": 1, "zero": cfg.mesh.zero, "schedule": "1f1b"},
        "warmup_steps_per_side": warmup,
        "measured_steps_per_side": steps,
        "block_steps": block,
        "torch_num_threads": threads,
    }


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, "step_overhead", "tiny model, few steps: a smoke run, not a measurement")
    add = ap.add_argument
    add("--steps", type=int, default=None, help="measured steps per side (default 30; 4 with --quick)")
    add("--warmup", type=int, default=3, help="unmeasured steps per side first (default 3)")
    add("--block", type=int, default=2, help="steps per alternating block (default 2)")
    add("--threads", type=int, default=1, help="torch.set_num_threads for both sides (default 1)")
    args = ap.parse_args(argv)
    steps = args.steps if args.steps is not None else (4 if args.quick else 30)
    if steps < 1 or args.warmup < 0 or args.block < 1 or args.threads < 1:
        ap.error("--steps, --block and --threads must be >= 1; --warmup >= 0")
    result = run(steps, args.warmup, args.block, args.threads, args.quick)
    write_result(args.out, result)
    med = result["median_step_s"]
    print(
        f"step_overhead: elastimesh {med['elastimesh'] * 1e3:.1f} ms, plain {med['plain'] * 1e3:.1f} ms, "
        f"ratio {result['ratio']:.3f} (cpu-time ratio {result['cpu_ratio']:.3f}) "
        f"(goal <= 1.05: {'met' if result['goal_met'] else 'NOT met'}); "
        f"losses match: {result['losses_match']} "
        f"(max rel diff {result['loss_max_rel_diff']:.2e}) -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
