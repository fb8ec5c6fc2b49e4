"""Time to full speed: step 2 of a generation vs the steady step, after start and after each rebuild.

One elastimesh run on a local Ray (``testbed.ray_cluster.make_group`` + the real ``Controller``, as
``recovery.py``): dp=4, tp=1, a requested shrink to dp=2 and a grow back to dp=4
(``controller.resize_requests``; each resize commits a checkpoint of the step before it and the
next generation loads it), no periodic checkpoints (a save's staging would slow the step after it
and blur the steady figure), ``--zero`` picking ``mesh.zero``.
Per generation the script reads every step's ``step_time_s`` from the metrics JSONL and reports:

* ``step2_ratio``: the generation's 2nd step time / the median of its steps from the 4th on (goal
  <= 1.3: the first step pays one-time costs (FSDP lazy init, allocator warm-up, DTensor caches);
  from the second on a generation should run at full speed);
* ``step1_ratio`` for information;
* ``cpu_step2_ratio``: the same ratio of the step records' ``cpu_s`` (README, Metrics: the most CPU
  seconds one rank's training thread spent in the step), which other processes on a loaded machine
  do not inflate: a wall ratio above it means the step waited (for a peer, or for a core), not that
  it did more work.

    python bench/full_speed.py [--zero {0,1,2,3}] [--steps-per-gen N] [--quick] [--out PATH]

Writes ``bench/results/full_speed.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

# bench/ is on sys.path; importing common puts the repository root there too.
from common import load_average, local_ray, machine, parser, write_result

os.environ.setdefault("RAY_DEDUP_LOGS", "0")

GOAL_RATIO = 1.3
DP = 4
MODEL = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64",
         "train.global_batch_size=8", "train.micro_batch_size=2"]
QUICK = ["model.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2"]


def run(zero: int, per_gen: int, model: list[str], workdir: str) -> dict:
    import ray

    from orchestrator.config.load import load_config
    from testbed.ray_cluster import make_group
    from testbed.ray_harness import make_controller
    from workers.store import StoreHost

    steps = 3 * per_gen
    mpath = os.path.join(workdir, "em.jsonl")
    cfg = load_config(None, model + [
        f"mesh.dp={DP}", "mesh.tp=1", f"mesh.zero={zero}", f"train.steps={steps}", f"checkpoint.every={10 * steps}",
        f"checkpoint.dir={os.path.join(workdir, 'ckpt')}", f"metrics.path={mpath}",
        "elastic.collective_timeout_s=60", "elastic.grow_check_s=1e6"])
    t0 = time.time()
    with local_ray():
        host = StoreHost.remote()
        store_address = ray.get(host.address.remote(), timeout=60)
        group = make_group(cfg.mesh.world)
        try:
            controller = make_controller(cfg, group, store_address)
            controller.resize_requests = {per_gen + 1: DP // 2, 2 * per_gen + 1: DP}
            summary = controller.run()
            controller.metrics.close()
        finally:
            group.shutdown()
    records = [json.loads(line) for line in open(mpath)]
    by_gen: dict[int, list[tuple[int, float]]] = {}
    for r in records:
        if "step_time_s" in r:
            by_gen.setdefault(r["generation"], []).append((r["step"], r["step_time_s"], r["cpu_s"]))
    gens = []
    for g, steps_of in sorted(by_gen.items()):
        times = [t for _, t, _ in sorted(steps_of)]
        cpu = [c for _, _, c in sorted(steps_of)]
        steady = statistics.median(times[3:]) if len(times) > 3 else float("nan")
        cpu_steady = statistics.median(cpu[3:]) if len(cpu) > 3 else float("nan")
        gens.append({"generation": g, "dp": next(r["dp"] for r in records if r.get("generation") == g
                                                  and "step_time_s" in r),
                     "steps": [s for s, _, _ in sorted(steps_of)], "step_time_s": times, "steady_s": steady,
                     "step1_ratio": times[0] / steady, "step2_ratio": times[1] / steady,
                     "cpu_s": cpu, "cpu_steady_s": cpu_steady, "cpu_step2_ratio": cpu[1] / cpu_steady})
    return {"generations": gens, "final_step": summary.final_step, "total_wall_s": time.time() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, "full_speed", "the default tiny model, 8 steps per generation")
    ap.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="mesh.zero (default 0)")
    ap.add_argument("--steps-per-gen", type=int, default=None, help="steps per generation (default 12, quick 8)")
    args = ap.parse_args(argv)
    per_gen = args.steps_per_gen or (8 if args.quick else 12)
    if per_gen < 6:
        ap.error("--steps-per-gen must be >= 6 (the steady figure needs steps 4 on)")
    with tempfile.TemporaryDirectory(prefix="em_full_speed_") as workdir:
        out = run(args.zero, per_gen, QUICK if args.quick else MODEL, workdir)
    worst = max(g["step2_ratio"] for g in out["generations"])
    result = {
        "benchmark": "full_speed",
        "goal": f"step 2 of every generation / its steady step <= {GOAL_RATIO}",
        "config": {"zero": args.zero, "dp": DP, "steps_per_generation": per_gen, "quick": args.quick,
                   "model": QUICK if args.quick else MODEL, "resizes": f"dp {DP} -> {DP // 2} -> {DP}"},
        **out,
        "worst_step2_ratio": worst,
        "goal_met": worst <= GOAL_RATIO,
        "machine": machine(loadavg_at_end=load_average()),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_result(args.out, result)
    per = ", ".join(f"gen{g['generation']} dp={g['dp']}: step2 {g['step2_ratio']:.2f}x (cpu {g['cpu_step2_ratio']:.2f}x) "
                    f"step1 {g['step1_ratio']:.2f}x"
                    for g in out["generations"])
    print(f"full_speed (zero={args.zero}): {per} of steady; goal <= {GOAL_RATIO}: "
          f"{'met' if result['goal_met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
