"""PowerSGD convergence: final loss after N steps vs uncompressed ZeRO-0, and the bytes it sends.

Usage: ``python bench/powersgd_convergence.py [--config NAME ...] [--variant NAME ...] [--steps N]
[--quick] [--out PATH]``; writes (merges into) ``bench/results/powersgd.json`` and prints one line per
run. Issue #19's goal: PowerSGD at rank 2 ends within 5% of the uncompressed final loss after 200 steps
on the built-in corpus, and sends >= 4x fewer bytes per step.

Each run is a real local gloo mesh at dp = 2 (``testbed.world.run_mesh``: ``RankRuntime`` ranks,
``mesh.zero=0``), as tests/distributed/test_powersgd.py runs it. A *config* fixes the model, batch and
learning rate (``CONFIGS``); a *variant* is uncompressed (``plain``) or PowerSGD with a rank, where
given ``train.powersgd_plain_steps`` (uncompressed steps first: ``r2_plain50``), and where given torch
``PowerSGDState`` knobs the config does not expose (``warm_start``, ``use_error_feedback``,
``min_compression_rate``), set on every rank before step 1 by ``powersgd_probes.powersgd_knobs``.
For each run the JSON holds:

* ``final_loss``: the mean of the last 10 steps' global losses (step-to-step noise averages out);
* ``gap``: ``final_loss / final_loss(plain of the same config) - 1`` (goal: ``abs(gap) <= 0.05``);
* ``bytes_compressed_step``: ``StepResult.dp_bytes``, max over the ranks, of the last step (a
  compressed one), and ``bytes_mean``: that per-step figure averaged over all steps (uncompressed
  warm-up steps included); ``bytes_ratio`` / ``bytes_ratio_mean``: plain's over these (goal >= 4,
  both: a run that is mostly uncompressed does not meet it);
* the per-step losses (rounded), the run's wall time and the load average.

Results are keyed by (config, variant, steps) and merged into the output file, so runs can be made one
at a time on a busy machine. ``--quick``: 20 steps, the default config, plain and r2 (a smoke run).
"""

from __future__ import annotations

import functools
import json
import time

import numpy as np

# bench/ is on sys.path; importing common puts the repository root there too.
from common import environment, load_average, parser, write_result
from powersgd_probes import powersgd_knobs

from testbed.world import run_mesh, shutdown_pool

GOAL_GAP, GOAL_BYTES = 0.05, 4.0
TAIL = 10  # steps averaged for the final loss

# model / batch / lr; the built-in corpus (byte tokens) always; warmup 10 steps of the cosine schedule.
CONFIGS: dict[str, tuple[str, ...]] = {
    # the defaults: d_model 64, 4 layers, seq 64, global batch 8, lr 3e-3, 2 warm-up steps
    "d64_b8_lr3e-3_warmup2": (),
    "d64_b8_lr3e-3": ("train.lr=3e-3", "train.warmup_steps=10"),
    "d64_b8_lr1e-3": ("train.lr=1e-3", "train.warmup_steps=10"),
    "d128_b16_s128_lr1e-3": ("model.d_model=128", "model.seq_len=128", "train.global_batch_size=16",
                             "train.micro_batch_size=4", "train.lr=1e-3", "train.warmup_steps=10"),
    "d128_b32_s128_lr1e-3": ("model.d_model=128", "model.seq_len=128", "train.global_batch_size=32",
                             "train.micro_batch_size=8", "train.lr=1e-3", "train.warmup_steps=10"),
    "d256_b32_s128_lr1e-3": ("model.d_model=256", "model.seq_len=128", "train.global_batch_size=32",
                             "train.micro_batch_size=8", "train.lr=1e-3", "train.warmup_steps=10"),
    "d64_b32_s128_lr1e-3": ("model.seq_len=128", "train.global_batch_size=32", "train.micro_batch_size=8",
                            "train.lr=1e-3", "train.warmup_steps=10"),
    "d64_b8_lr5e-4": ("train.lr=5e-4", "train.warmup_steps=10"),
    "d64_b8_lr3e-4": ("train.lr=3e-4", "train.warmup_steps=10"),
    "d64_b8_lr3e-4_seed1": ("train.lr=3e-4", "train.warmup_steps=10", "train.seed=1"),
    "d128_b8_lr1e-3": ("model.d_model=128", "train.lr=1e-3", "train.warmup_steps=10"),
    "d128_b8_lr3e-4": ("model.d_model=128", "train.lr=3e-4", "train.warmup_steps=10"),
}

PSGD = ('train.grad_compression="powersgd"',)
# name -> (extra overrides, PowerSGDState knobs)
VARIANTS: dict[str, tuple[tuple[str, ...], dict]] = {
    "plain": ((), {}),
    "r2": ((*PSGD, "train.powersgd_rank=2"), {}),
    "r4": ((*PSGD, "train.powersgd_rank=4"), {}),
    "r8": ((*PSGD, "train.powersgd_rank=8"), {}),
    "r2_plain20": ((*PSGD, "train.powersgd_rank=2", "train.powersgd_plain_steps=20"), {}),
    "r2_plain50": ((*PSGD, "train.powersgd_rank=2", "train.powersgd_plain_steps=50"), {}),
    "r2_plain100": ((*PSGD, "train.powersgd_rank=2", "train.powersgd_plain_steps=100"), {}),
    "r2_mcr20": ((*PSGD, "train.powersgd_rank=2"), {"min_compression_rate": 20}),
    "r2_nowarm": ((*PSGD, "train.powersgd_rank=2"), {"warm_start": False}),
    "r2_noef": ((*PSGD, "train.powersgd_rank=2"), {"use_error_feedback": False}),
}


def run_one(config: str, variant: str, steps: int, timeout: float = 3000) -> dict:
    extra, knobs = VARIANTS[variant]
    # mesh.zero=0 before the variant's own keys: a variant may name another level (bench/compression.py)
    overrides = (*CONFIGS[config], "mesh.zero=0", *extra, f"train.steps={steps}")
    instrument = functools.partial(powersgd_knobs, knobs) if knobs else None
    load0, t0 = load_average(), time.monotonic()
    run = run_mesh(2, 1, 1, overrides, steps, collect_params=False, instrument=instrument, timeout=timeout,
                   collective_timeout_s=300)
    wall = time.monotonic() - t0
    sent = [max(r[i].dp_bytes for r in run.results.values()) for i in range(steps)]
    return {"config": config, "variant": variant, "steps": steps, "overrides": list(overrides),
            "knobs": knobs, "final_loss": float(np.mean(run.losses[-TAIL:])),
            "losses": [round(x, 5) for x in run.losses], "bytes_compressed_step": sent[-1],
            "bytes_first_step": sent[0], "bytes_mean": float(np.mean(sent)), "wall_s": round(wall, 1),
            "load_average": [load0, load_average()]}


def summarise(runs: list[dict]) -> list[dict]:
    """One row per compressed run: its gap and bytes ratios against the plain run of its config."""
    plain = {(r["config"], r["steps"]): r for r in runs if r["variant"] == "plain"}
    rows = []
    for r in runs:
        base = plain.get((r["config"], r["steps"]))
        if r["variant"] == "plain" or base is None:
            continue
        gap = r["final_loss"] / base["final_loss"] - 1
        ratio = base["bytes_compressed_step"] / r["bytes_compressed_step"]
        ratio_mean = base["bytes_mean"] / r["bytes_mean"]
        rows.append({"config": r["config"], "variant": r["variant"], "steps": r["steps"],
                     "plain_loss": round(base["final_loss"], 4), "powersgd_loss": round(r["final_loss"], 4),
                     "gap": round(gap, 4), "bytes_ratio": round(ratio, 2), "bytes_ratio_mean": round(ratio_mean, 2),
                     # the bytes goal on every compressed step and averaged over the run (plain steps in)
                     "met": abs(gap) <= GOAL_GAP and min(ratio, ratio_mean) >= GOAL_BYTES})
    return sorted(rows, key=lambda row: (row["config"], row["variant"]))


def main() -> None:
    p = parser(__doc__, "powersgd", "20 steps of the default config, plain and r2 (a smoke run)")
    p.add_argument("--config", action="append", choices=sorted(CONFIGS))
    p.add_argument("--variant", action="append", choices=sorted(VARIANTS))
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    configs = args.config or (["d64_b8_lr3e-3"] if args.quick else list(CONFIGS))
    variants = args.variant or (["plain", "r2"] if args.quick else ["plain", "r2", "r8"])
    steps = 20 if args.quick else args.steps
    previous = {}
    if args.out.exists():
        previous = json.loads(args.out.read_text())
    runs = {(r["config"], r["variant"], r["steps"]): r for r in previous.get("runs", [])}
    try:
        for config in configs:
            for variant in variants:
                r = run_one(config, variant, steps)
                runs[(config, variant, steps)] = r
                print(f"{config} {variant} steps={steps}: final loss {r['final_loss']:.4f}, bytes/step "
                      f"{r['bytes_first_step']} -> {r['bytes_compressed_step']} (mean {r['bytes_mean']:.0f}), "
                      f"{r['wall_s']} s", flush=True)
                result = {"benchmark": "powersgd_convergence", "quick": args.quick,
                          "goal": {"gap_abs_max": GOAL_GAP, "bytes_ratio_min": GOAL_BYTES},
                          "tail_steps": TAIL, "mesh": "dp=2, mesh.zero=0, built-in corpus",
                          "environment": environment(), "summary": summarise(list(runs.values())),
                          "runs": list(runs.values())}
                write_result(args.out, result)
    finally:
        shutdown_pool()
    for row in summarise(list(runs.values())):
        print(row)


if __name__ == "__main__":
    main()
