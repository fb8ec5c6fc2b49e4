"""Goal (b): dp=2 on a local Ray: elastimesh throughput vs Ray Train ``TorchTrainer`` + DDP (goal >= 1.05x).

Both sides train the same model (``meshmodels.gpt_model.build_stage`` over all layers, same seed), on the same
samples (``meshdata.order.replica_microbatches``: each of the 2 replicas takes its contiguous half of the
same global batch), with the same math (AdamW from ``workers.optim.build_optimizer``, global-norm
clipping, ``lr_at`` warm-up + cosine), one torch thread per worker, on the CPU with gloo:

* **elastimesh**: ``orchestrator.launch.run_job`` with ``mesh.dp=2, mesh.tp=1`` (it starts and stops its
  own embedded local Ray). Per-step ``tokens_per_s`` comes from the metrics JSONL (global tokens over the
  slowest rank's step time).
* **Ray Train**: ``ray.init(address="local")`` then ``TorchTrainer`` with ``ScalingConfig(num_workers=2,
  use_gpu=False)``; the loop wraps the model with ``ray.train.torch.prepare_model`` (DDP on gloo) and
  times each step; per step the slowest worker's time is used (same convention as elastimesh).

elastimesh runs at ``--zero`` (default 0: replicated parameters, one all-reduce per FSDP unit, the
fastest level for a model this small; the headline figure), or with ``--zero all`` at every variant:
ZeRO-0, the defaults (``mesh.zero=3``, small blocks grouped into one FSDP unit by ``mesh.fsdp_unit_mb``),
``mesh.zero=2``, and zero=3 with one FSDP unit per block (``mesh.fsdp_unit_mb=0``); the headline is then
ZeRO-0, fixed before measuring (never the best of the variants). Each side runs ``--repeats`` times,
interleaved (A B, then B A, ...). Figures, per run: the median tokens/s over steps >= 3, the "loop"
throughput (all steps' tokens over the first-step-start .. last-step-end wall time of the loop; for
elastimesh from generation 1 formed, when step 1 is sent, to the driver's record of the last step, so
a little longer than the steps themselves), the same with elastimesh's teardown after the last step
(actors, store, the embedded Ray: ``loop_tokens_per_s_lower_bound``, the loop figure until #37 item 2,
which Ray Train's side never counted), and the start-up / total wall times (elastimesh: ``run_job``
incl. ``ray.init``; Ray Train: ``ray.init`` + ``fit()``); per
repeat, the ratios elastimesh / Ray Train of the runs interleaved together; the headline ratios are the
medians over the repeats with their spread (min, max, each repeat's), and ``goal_met`` holds only when
every repeat meets the goal (``repeats_meeting_goal`` says how many did). Losses of both sides are recorded and compared (they should agree to ~1e-5 relative).

    python bench/ray_train_compare.py [--zero {0,1,2,3,all}] [--steps N] [--repeats R] [--quick] [--out PATH]

Writes ``bench/results/ray_train_compare.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

# bench/ is on sys.path; importing common puts the repository root there too.
from common import ROOT, load_average, local_ray, machine, parser, write_result
from stats import paired_ratios, repeats_meeting, spread

os.environ.setdefault("RAY_DEDUP_LOGS", "0")

GOAL_RATIO = 1.05
DP = 2
# elastimesh variants (name -> extra overrides). zero3 = the defaults (the headline); zero2 keeps params
# gathered for the step; zero3_per_block shards every block as its own FSDP unit (mesh.fsdp_unit_mb=0,
# TorchTitan's wrapping) to show what grouping this model's small blocks into one unit buys.
VARIANTS = {"zero0": ["mesh.zero=0"], "zero3": ["mesh.zero=3"], "zero2": ["mesh.zero=2"],
            "zero3_per_block": ["mesh.zero=3", "mesh.fsdp_unit_mb=0"]}

# A bit larger than the default tiny model so that compute, not fixed per-step cost, dominates.
FULL = ["model.d_model=128", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64",
        "train.global_batch_size=8", "train.micro_batch_size=2"]
QUICK = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.seq_len=64",
         "train.global_batch_size=4", "train.micro_batch_size=2"]


def _median_from(per_step: dict[int, float], first: int = 3) -> float:
    vals = [v for s, v in sorted(per_step.items()) if s >= first] or list(per_step.values())
    return statistics.median(vals)


# -- elastimesh ------------------------------------------------------------------------------------
def run_elastimesh(overrides: list[str], steps: int, workdir: str) -> dict:
    import ray

    from orchestrator.config.load import load_config
    from orchestrator.launch import run_job

    # One file per run: the metrics file is appended to, and an earlier run's "start" event would
    # otherwise be read as this run's.
    mpath = os.path.join(workdir, f"elastimesh-{time.time_ns()}.jsonl")
    cfg = load_config(None, overrides + [f"mesh.dp={DP}", "mesh.tp=1", f"train.steps={steps}",
                                         f"metrics.path={mpath}"])
    assert not ray.is_initialized()
    # Each step record's cpu_s: the most CPU seconds one rank's training thread spent in it (README, Metrics).
    t0 = time.time()
    summary = run_job(cfg, progress=False)
    t_end = time.time()
    records = [json.loads(line) for line in open(mpath)]
    tps = {r["step"]: r["tokens_per_s"] for r in records if "tokens_per_s" in r}
    step_time = {r["step"]: r["step_time_s"] for r in records if "step_time_s" in r}
    cpu = {r["step"]: r["cpu_s"] for r in records if "cpu_s" in r}
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    start_ev = next((r for r in records if r.get("event") == "start"), None)
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    out = {
        "tokens_per_s_median": _median_from(tps),
        "step_time_s_median": _median_from(step_time),
        "step_time_s_min": min(v for s, v in step_time.items() if s >= 3),
        "cpu_s_median": _median_from(cpu),
        "tokens_per_s_by_step": tps,
        "losses": losses,
        "final_step": summary.final_step,
        "total_wall_s": t_end - t0,
    }
    if start_ev is not None:
        # First step to last, as Ray Train's loop is timed: generation 1 formed (step 1 goes out at
        # once) to the driver's record of the last step. The teardown after it is reported apart.
        last_step_at = max(r["time"] for r in records if "step_time_s" in r)
        out["startup_s"] = start_ev["time"] - t0
        out["loop_s"] = last_step_at - start_ev["time"]
        out["loop_tokens_per_s"] = tokens * steps / out["loop_s"]
        out["teardown_s"] = t_end - last_step_at
        # From "generation 1 formed" to run_job's return (includes teardown of actors and Ray).
        out["loop_plus_teardown_s"] = t_end - start_ev["time"]
        out["loop_tokens_per_s_lower_bound"] = tokens * steps / (t_end - start_ev["time"])
    return out


# -- Ray Train -------------------------------------------------------------------------------------
def _train_loop(config: dict) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, config["root"])
    from bench.ddp_loop import DDPLoop

    loop = DDPLoop(config["overrides"])
    log = []
    for step in range(1, config["steps"] + 1):
        c0, t0 = time.thread_time(), time.perf_counter()
        share = loop.step(step)
        t1, c1 = time.perf_counter(), time.thread_time()
        loss_t = torch.tensor([share])
        dist.all_reduce(loss_t)  # outside the timed region: only for the loss comparison
        log.append({"step": step, "t0": time.time() - (t1 - t0), "t1": time.time(), "dt": t1 - t0, "cpu": c1 - c0,
                    "loss": float(loss_t)})
    with open(os.path.join(config["logdir"], f"rank{loop.rank}.json"), "w") as f:
        json.dump(log, f)


def run_ray_train(overrides: list[str], steps: int, workdir: str) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from orchestrator.config.load import load_config

    cfg = load_config(None, overrides)
    logdir = os.path.join(workdir, "raytrain_logs")
    os.makedirs(logdir, exist_ok=True)
    t0 = time.time()
    with local_ray():
        t_init = time.time()
        trainer = TorchTrainer(
            _train_loop,
            train_loop_config={"overrides": overrides + [f"train.steps={steps}"], "steps": steps,
                               "logdir": logdir, "root": str(ROOT)},
            scaling_config=ScalingConfig(num_workers=DP, use_gpu=False),
            run_config=RunConfig(name="rt_compare", storage_path=os.path.join(workdir, "rt_storage")),
        )
        trainer.fit()
        t_fit = time.time()
    t_end = time.time()
    logs = [json.load(open(os.path.join(logdir, f"rank{r}.json"))) for r in range(DP)]
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    dt = {rec["step"]: max(lg[i]["dt"] for lg in logs) for i, rec in enumerate(logs[0])}
    tps = {s: tokens / v for s, v in dt.items()}
    cpu = {rec["step"]: max(lg[i]["cpu"] for lg in logs) for i, rec in enumerate(logs[0])}
    loop_wall = max(lg[-1]["t1"] for lg in logs) - min(lg[0]["t0"] for lg in logs)
    return {
        "tokens_per_s_median": _median_from(tps),
        "step_time_s_median": _median_from(dt),
        "step_time_s_min": min(v for s, v in dt.items() if s >= 3),
        "cpu_s_median": _median_from(cpu),
        "tokens_per_s_by_step": tps,
        "losses": {rec["step"]: rec["loss"] for rec in logs[0]},
        "ray_init_s": t_init - t0,
        "fit_s": t_fit - t_init,
        "startup_s": min(lg[0]["t0"] for lg in logs) - t0,
        "total_wall_s": t_end - t0,
        "loop_tokens_per_s": tokens * steps / loop_wall,
    }


def _median_run(runs: list[dict]) -> dict:
    """A side's representative run: the one with the median tokens/s (the lower middle one of an even
    count; never the fastest), with every repeat's tokens/s beside it. The ratios are per repeat
    (``ratios_by_variant``), not this run's."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s_median"])
    median_run = dict(ranked[(len(ranked) - 1) // 2])
    median_run["tokens_per_s_median_of_repeats"] = [r["tokens_per_s_median"] for r in runs]
    # Load-robust cross-checks: the median over repeats of each run's median step CPU seconds, and
    # the fastest step of all repeats (what the step costs when nothing else competes: a labelled
    # minimum, never a headline).
    median_run["cpu_s_median_of_repeats"] = statistics.median(r["cpu_s_median"] for r in runs)
    median_run["step_time_s_min_of_repeats"] = min(r["step_time_s_min"] for r in runs)
    return median_run


def ratios_by_variant(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per variant, repeat by repeat (each elastimesh run against the Ray Train run interleaved with it):
    steady tokens/s ratio and loop tokens/s ratio, as medians with their spread, and in how many
    repeats the steady ratio met the goal."""
    out = {}
    rts = runs["ray_train"]
    for name, ems in ((n, r) for n, r in runs.items() if n != "ray_train"):
        steady = _per_repeat(ems, rts, "tokens_per_s_median")
        meeting, every_repeat = repeats_meeting(steady, lambda r: r >= GOAL_RATIO)
        out[name] = {"steady": spread(steady),
                     "loop": spread(_per_repeat(ems, rts, "loop_tokens_per_s")),
                     "loop_with_teardown": spread(_per_repeat(ems, rts, "loop_tokens_per_s_lower_bound",
                                                              "loop_tokens_per_s")),
                     "total_wall": spread(_per_repeat(ems, rts, "total_wall_s")),
                     "repeats_meeting_goal": meeting, "all_repeats_meet_goal": every_repeat}
    return out


def _per_repeat(ems: list[dict], rts: list[dict], key: str, rt_key: str | None = None) -> list[float | None]:
    """Repeat by repeat, the elastimesh run's ``key`` over the Ray Train run's ``rt_key`` (default the same)."""
    return paired_ratios([em.get(key) for em in ems], [rt.get(rt_key or key) for rt in rts])


def run_interleaved(variants: dict, overrides: list[str], steps: int, repeats: int) -> dict[str, list[dict]]:
    """Repeats interleaved A B, B A, ... so slow phases of the machine hit every side alike."""
    runs: dict[str, list[dict]] = {name: [] for name in variants} | {"ray_train": []}
    with tempfile.TemporaryDirectory(prefix="em_rt_cmp_") as workdir:
        for r in range(repeats):
            order = list(variants) + ["ray_train"]
            for name in order if r % 2 == 0 else order[::-1]:
                if name == "ray_train":
                    run = _started(run_ray_train, overrides, steps, workdir)
                else:
                    run = _started(run_elastimesh, overrides + variants[name], steps, workdir)
                runs[name].append({**run, "loadavg_after": load_average()})
    return runs


START_TRIES = 3


def _started(run, *args) -> dict:
    """``run(*args)``, again (up to twice more) when the embedded Ray did not start: on a 2-core machine
    loaded by others its raylet can miss Ray's fixed 30 s registration wait ("timed out during
    startup"), which is neither side's figure (``ray_start_retries`` says how often)."""
    import ray

    for attempt in range(START_TRIES):
        try:
            return {**run(*args), "ray_start_retries": attempt}
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == START_TRIES - 1:
                raise
            ray.shutdown()  # whatever part of it came up
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, "ray_train_compare", "tiny model, few steps: a smoke run")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per side (default 20, quick 6)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per side, interleaved (default 3, quick 1)")
    ap.add_argument("--zero", choices=("0", "1", "2", "3", "all"), default="0",
                    help="mesh.zero of the elastimesh side (default 0), or every variant")
    args = ap.parse_args(argv)
    variants = VARIANTS if args.zero == "all" else {f"zero{args.zero}": [f"mesh.zero={args.zero}"]}
    steps = args.steps or (6 if args.quick else 20)
    repeats = args.repeats or (1 if args.quick else 3)
    overrides = QUICK if args.quick else FULL
    runs = run_interleaved(variants, overrides, steps, repeats)
    rt = _median_run(runs["ray_train"])
    sides = {name: _median_run(r) for name, r in runs.items() if name != "ray_train"}
    paired = ratios_by_variant(runs)
    # The headline is fixed before measuring (the level asked for; with --zero all, ZeRO-0, the fastest
    # level for a model this small), never the best of the variants.
    headline = "zero0" if args.zero == "all" else f"zero{args.zero}"
    em, head = sides[headline], paired[headline]
    common = sorted(set(em["losses"]) & set(rt["losses"]))
    max_rel = max((abs(em["losses"][s] - rt["losses"][s]) / abs(rt["losses"][s]) for s in common), default=None)
    result = {
        "benchmark": "ray_train_compare",
        "goal": f"elastimesh tokens/s / Ray Train tokens/s >= {GOAL_RATIO} (dp={DP}, local Ray, CPU gloo), "
                "median of interleaved repeats; goal_met only when every repeat meets it",
        "headline_variant": headline,
        "config": {"overrides": overrides, "dp": DP, "zero": args.zero, "steps": steps, "repeats": repeats,
                   "quick": args.quick, "threads_per_worker": 1,
                   "median_over": "steps >= 3 within a run; the ratio per repeat (each elastimesh run over the "
                                  "Ray Train run interleaved with it), then the median over repeats"},
        "elastimesh": em,
        "elastimesh_by_variant": sides,
        "ray_train": rt,
        "ratio_tokens_per_s": head["steady"]["median"],
        "ratio_tokens_per_s_spread": head["steady"],
        "ratio_loop_tokens_per_s": head["loop"]["median"],
        "ratio_loop_tokens_per_s_spread": head["loop"],
        "ratio_loop_with_teardown_spread": head["loop_with_teardown"],
        "ratio_total_wall_spread": head["total_wall"],
        "ratios_by_variant": paired,
        # Load-robust cross-checks (> 1: elastimesh does the step with less CPU / faster at best).
        "ratio_cpu_per_step_by_variant": {n: rt["cpu_s_median_of_repeats"] / em_["cpu_s_median_of_repeats"]
                                          for n, em_ in sides.items()},
        "loss_max_rel_diff": max_rel,
        "repeats_meeting_goal": head["repeats_meeting_goal"],
        "goal_met_median": head["steady"]["median"] >= GOAL_RATIO,
        "goal_met": head["all_repeats_meet_goal"],
        "goal_met_by_variant": {name: p["all_repeats_meet_goal"] for name, p in paired.items()},
        "machine": machine(loadavg_at_end=load_average()),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_result(args.out, result)
    _print_summary(result, sides, rt)
    return 0


def _print_summary(result: dict, sides: dict, rt: dict) -> None:
    by_variant = ", ".join(
        f"{n} {sides[n]['tokens_per_s_median']:,.0f} tok/s ({p['steady']['median']:.2f}x "
        f"[{p['steady']['min']:.2f}, {p['steady']['max']:.2f}], loop {p['loop']['median']:.2f}x "
        f"(with teardown {p['loop_with_teardown']['median']:.2f}x), "
        f"{p['repeats_meeting_goal']} repeats >= {GOAL_RATIO})"
        for n, p in result["ratios_by_variant"].items())
    print(f"ray_train_compare: elastimesh {by_variant} vs Ray Train {rt['tokens_per_s_median']:,.0f} tok/s; "
          f"goal at {result['headline_variant']}: {'met' if result['goal_met'] else 'NOT met'} "
          f"({result['repeats_meeting_goal']} repeats); loss max rel diff {result['loss_max_rel_diff']}; "
          f"load {result['machine']['loadavg_at_end']}")


if __name__ == "__main__":
    sys.exit(main())
