"""Pipeline benchmark: measured 1F1B bubble vs theory, interleaved vs 1F1B, zero-bubble vs both, activation memory.

Usage: ``python bench/pipeline_bubble.py [--quick] [--only zero_bubble] [--out PATH]``; writes
``bench/results/pipeline_bubble.json`` (``--only zero_bubble``: ``pipeline_zero_bubble.json``, parts 4 and
3's ZB-H1 row only) and prints a short summary. Runs real local gloo meshes (``testbed.world.run_mesh``: the
``RankRuntime`` ranks and the driver's schedules), dp=1, tp=1.

1. Bubble, pp in {2, 4} x m in {4, 8, 16}, 1F1B, ``n_layers = 2 pp`` with ``pipeline.layers`` = 2 per
   stage (equal cost; embedding and head are <5% of a stage here). For each measured step (steps 3..N;
   1-2 are warm-up) the *pipeline window* is [earliest start, latest end] of ``Executor.run`` over the
   pp ranks (``time.perf_counter`` is CLOCK_MONOTONIC, shared by all processes), and

       bubble = 1 - sum over ranks of (F + B action time) / (pp * window)

   i.e. each rank's idle share of the common window, averaged over ranks: what
   ``schedule.theoretical_bubble`` = (pp-1)/(m+pp-1) predicts. Also reported: the same per rank against
   its own whole ``train_step`` time (optimizer, clipping and data included), the simulated bubble of
   the schedule (``schedule_sim``) with the measured mean F and B, a replay of the schedule with the
   measured per-stage F/B costs (stage imbalance, no comm cost), and the CPU the ranks got.
2. Interleaved 1F1B (v=2, one layer per virtual stage) vs 1F1B (two layers per stage), pp=2, m=4 and 8, same
   model; runs alternate A/B/A/B to spread the machine's load drift over both.
3. Activation memory, pp=2, m=8, 1F1B vs GPipe vs ZB-H1: the stage forward runs under
   ``torch.autograd.graph.saved_tensors_hooks`` that count the bytes of the distinct storages autograd
   saves (parameters and buffers excluded) while they are alive; the peak over the step is compared with
   ``peak_in_flight(actions) x`` the bytes one microbatch's forward saves (measured on its first F).
   ZB-H1 keeps a microbatch's saved tensors until its W: its peak should equal 1F1B's (rank 0's).
4. Zero bubble: ZB-H1 and ZB-V vs 1F1B and interleaved 1F1B at pp in {2, 4}, m in {8, 16}, at two model
   shapes (``pipeline_zero_bubble.py`` says what is measured, and why two shapes).
"""

from __future__ import annotations

import statistics
import time

# bench/ is on sys.path; importing common puts the repository root there too.
from common import load_average, machine, parser, write_result
from pipeline_analysis import WARMUP_STEPS, bubble_stats
from pipeline_probes import memory_probe, timing_probe
from pipeline_zero_bubble import GOAL_SHAPE, SHAPES, goal_met, zero_bubble_shapes

from meshspeak.schedule import peak_in_flight, theoretical_bubble
from testbed.world import run_mesh, shutdown_pool

# d_model 256, seq 256, 2 sequences per microbatch: one 2-layer stage costs ~35 ms F / ~75 ms B on one
# idle core, against <1 ms to send the 512 KB boundary activation, so compute dominates communication.
MICRO = 2  # sequences per microbatch
MODEL = ("model.d_model=256", "model.n_heads=4", "model.seq_len=256", f"train.micro_batch_size={MICRO}")
GOAL_POINTS = 0.05
# Interleaved vs 1F1B at pp=2 for these microbatch counts: the fewer microbatches, the bigger the bubble
# interleaving removes (theory 1.11x at m=4, 1.06x at m=8).
IV_MS = (4, 8)


# --- the three experiments -------------------------------------------------------------------------


def bubble_sweep(pps, ms, steps) -> list[dict]:
    rows = []
    for pp in pps:
        for m in ms:
            overrides = (*MODEL, f"model.n_layers={2 * pp}", f"pipeline.layers={[2] * pp}",
                         f"train.global_batch_size={m * MICRO}")  # fmt: skip
            run = run_mesh(1, pp, 1, overrides, steps, collect_params=False, instrument=timing_probe, timeout=400)
            stats = bubble_stats(run)
            theory = theoretical_bubble(pp, m)
            rows.append({
                "pp": pp, "m": m, "theory": theory, **stats,
                "measured_minus_theory": stats["measured"] - theory,
                "goal_met": stats["measured"] <= theory + GOAL_POINTS,
                "load_average": load_average(),
            })  # fmt: skip
            print(f"  pp={pp} m={m:2d}: bubble measured {stats['measured']:.3f} theory {theory:.3f} "
                  f"replay {stats['replay_measured_stage_costs']:.3f} (per action "
                  f"{stats['replay_measured_action_durations']:.3f}) cpu {stats['cpu_busy_share']:.2f} "
                  f"hand-off {stats['handoff_latency_ms'].get('median', float('nan')):.2f} ms "
                  f"F {stats['mean_F_s'] * 1e3:.1f} ms B {stats['mean_B_s'] * 1e3:.1f} ms", flush=True)  # fmt: skip
    return rows


def interleaved_vs_1f1b(steps: int, rounds: int, m: int) -> dict:
    pp = 2
    base = (*MODEL, "model.n_layers=4", f"train.global_batch_size={m * MICRO}")
    variants = {
        "1f1b": dict(schedule="1f1b", virtual_stages=1, overrides=(*base, "pipeline.layers=[2, 2]")),
        "interleaved_1f1b": dict(schedule="interleaved_1f1b", virtual_stages=2,
                                 overrides=(*base, "pipeline.layers=[1, 1, 1, 1]")),  # fmt: skip
    }
    samples: dict[str, list[dict]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, v in variants.items():
            run = run_mesh(1, pp, 1, v["overrides"], steps, schedule=v["schedule"], virtual_stages=v["virtual_stages"],
                           collect_params=False, instrument=timing_probe, timeout=400)  # fmt: skip
            samples[name].append(bubble_stats(run))
    out = {"pp": pp, "m": m, "rounds": rounds}
    for name, runs in samples.items():
        bubbles = [b for r in runs for b in r["measured_per_step"]]
        out[name] = {
            "step_time_s_median": statistics.median(r["step_time_s"] for r in runs),
            "pipeline_window_s_median": statistics.median(w for r in runs for w in r["pipeline_window_s_per_step"]),
            "step_time_s_runs": [r["step_time_s"] for r in runs],
            "bubble_measured": statistics.mean(bubbles),
            "bubble_measured_median": statistics.median(bubbles),
            "bubble_theory": theoretical_bubble(pp, m, variants[name]["virtual_stages"]),
            "bubble_replay_measured_action_durations": statistics.mean(
                r["replay_measured_action_durations"] for r in runs),
            "recv_of_an_already_sent_tensor_ms_median": statistics.median(
                r["recv_of_an_already_sent_tensor_ms"].get("median", 0.0) for r in runs),
            "mean_F_s": statistics.mean(r["mean_F_s"] for r in runs),
            "mean_B_s": statistics.mean(r["mean_B_s"] for r in runs),
        }
    a, b = out["1f1b"], out["interleaved_1f1b"]
    out["speedup_step"] = a["step_time_s_median"] / b["step_time_s_median"]
    out["speedup_pipeline_window"] = a["pipeline_window_s_median"] / b["pipeline_window_s_median"]
    # Same work at the same compute speed: how much less of the window interleaved leaves idle. Less
    # sensitive to the other jobs' load, which changes how fast F/B run from one run to the next.
    out["speedup_at_equal_compute"] = (1 - b["bubble_measured_median"]) / (1 - a["bubble_measured_median"])
    out["speedup_at_equal_compute_theory"] = (1 - b["bubble_theory"]) / (1 - a["bubble_theory"])
    out["goal_met"] = out["speedup_step"] > 1.0
    return out


def activation_memory(steps: int, schedules=("1f1b", "gpipe", "zb-h1")) -> dict:
    pp, m = 2, 8
    overrides = (*MODEL, "model.n_layers=4", "pipeline.layers=[2, 2]", f"train.global_batch_size={m * MICRO}")
    out: dict = {"pp": pp, "m": m}
    for schedule in schedules:
        run = run_mesh(1, pp, 1, overrides, steps, schedule=schedule, collect_params=False,
                       instrument=memory_probe, timeout=400)  # fmt: skip
        ranks = []
        for r in range(pp):
            last = run.extras[r][-1]
            inflight = peak_in_flight(run.actions[r])
            per_mb = last["one_microbatch_bytes"]
            ranks.append({
                "pp_rank": r,
                "peak_saved_bytes": last["peak_bytes"],
                "one_microbatch_saved_bytes": per_mb,
                "measured_peak_microbatches": last["peak_bytes"] / per_mb if per_mb else None,
                "expected_peak_microbatches": inflight,
                "expected_peak_bytes": inflight * per_mb,
                "live_after_step_bytes": last["live_after_step"],
                # zero-bubble: saved activations plus the gradients pending W's keep (0 otherwise)
                "peak_with_kept_gradients_bytes": last["peak_with_kept_gradients_bytes"],
                "kept_after_step_bytes": last["kept_after_step"],
            })  # fmt: skip
        out[schedule] = {"ranks": ranks, "peak_saved_bytes_max": max(x["peak_saved_bytes"] for x in ranks),
                         "peak_in_flight_max": max(x["expected_peak_microbatches"] for x in ranks),
                         "peak_with_kept_gradients_bytes_max": max(x["peak_with_kept_gradients_bytes"]
                                                                   for x in ranks)}  # fmt: skip
    matches = all(abs(x["measured_peak_microbatches"] - x["expected_peak_microbatches"]) < 0.5
                  for s in schedules for x in out[s]["ranks"])  # fmt: skip
    if "gpipe" in out:
        out["gpipe_over_1f1b"] = out["gpipe"]["peak_saved_bytes_max"] / out["1f1b"]["peak_saved_bytes_max"]
        out["expected_gpipe_over_1f1b"] = m / pp  # rank 0 holds m (GPipe) vs pp (1F1B) microbatches
        out["goal_met"] = out["gpipe_over_1f1b"] > 1.0 and matches
    if "zb-h1" in out:
        zb, ofob = out["zb-h1"], out["1f1b"]
        # The schedule's claim (Qi et al.): no rank holds more microbatches than 1F1B's busiest one;
        # measured: every rank's saved bytes peak at what its list says (`matches`).
        out["zb_h1_same_peak_microbatches"] = zb["peak_in_flight_max"] == ofob["peak_in_flight_max"] and matches
        # In bytes the busiest ZB-H1 rank is the last one (it holds pp microbatches where 1F1B's holds
        # 1), whose microbatch saves more than the first stage's (the head and the loss), and pending
        # W's also keep gradients: both ratios are reported as measured.
        out["zb_h1_over_1f1b"] = zb["peak_saved_bytes_max"] / ofob["peak_saved_bytes_max"]
        out["zb_h1_over_1f1b_with_kept_gradients"] = (
            zb["peak_with_kept_gradients_bytes_max"] / ofob["peak_with_kept_gradients_bytes_max"])
        out["zb_h1_goal_met"] = out["zb_h1_same_peak_microbatches"]
    return out


def main() -> None:
    p = parser(__doc__, "pipeline_bubble", "fewer steps and microbatch counts (~2 min)")
    p.add_argument("--only", choices=("zero_bubble",), help="run only the zero-bubble part (4) and ZB-H1's memory")
    args = p.parse_args()
    if args.only and args.out.name == "pipeline_bubble.json":  # never overwrite the full run's figures
        args.out = args.out.with_name("pipeline_zero_bubble.json")

    import torch

    if args.only:
        return zero_bubble_main(args, torch)
    t0 = time.monotonic()
    steps = 5 if args.quick else 8
    ms = (4, 8) if args.quick else (4, 8, 16)
    report: dict = {
        "machine": machine(torch=torch.__version__, load_average_start=load_average()),
        "config": {"model": list(MODEL), "layers_per_stage": 2, "dp": 1, "tp": 1, "steps": steps,
                   "warmup_steps_skipped": WARMUP_STEPS, "quick": args.quick, "zero_bubble_shapes": SHAPES,
                   "zero_bubble_steps": ZB_STEPS[args.quick]},  # fmt: skip
    }
    try:
        print("1F1B bubble sweep", flush=True)
        report["bubble_1f1b"] = bubble_sweep((2, 4), ms, steps)
        report["interleaved_vs_1f1b_by_m"] = {}
        for m in IV_MS:
            print(f"interleaved vs 1F1B (pp=2, m={m})", flush=True)
            report["interleaved_vs_1f1b_by_m"][m] = interleaved_vs_1f1b(steps, 1 if args.quick else 5, m)
        print("activation memory 1F1B vs GPipe vs ZB-H1 (pp=2, m=8)", flush=True)
        report["activation_memory"] = activation_memory(3)
        print("zero bubble vs 1F1B and interleaved", flush=True)
        report["zero_bubble"] = zero_bubble(args.quick)
    finally:
        shutdown_pool()
    rows = report["bubble_1f1b"]
    report["goals"] = {
        "bubble_within_5_points_pp2": all(r["goal_met"] for r in rows if r["pp"] == 2),
        "bubble_within_5_points_pp4": all(r["goal_met"] for r in rows if r["pp"] == 4),
        "interleaved_faster": all(r["goal_met"] for r in report["interleaved_vs_1f1b_by_m"].values()),
        "gpipe_holds_more_activations": report["activation_memory"]["goal_met"],
        "zb_h1_same_activation_peak": report["activation_memory"]["zb_h1_goal_met"],
        "zb_h1_bubble_third_of_1f1b": goal_met(report["zero_bubble"]),
    }
    report["machine"]["load_average_end"] = load_average()
    report["wall_s"] = time.monotonic() - t0
    report["notes"] = notes(report) + zero_bubble_notes(report)
    path = args.out
    write_result(path, report)
    mem = report["activation_memory"]
    for m, iv in report["interleaved_vs_1f1b_by_m"].items():
        print(f"interleaved speedup m={m}: {iv['speedup_step']:.3f}x (step), {iv['speedup_pipeline_window']:.3f}x "
              f"(window), {iv['speedup_at_equal_compute']:.3f}x at equal compute (theory "
              f"{iv['speedup_at_equal_compute_theory']:.3f}x)")
    print(f"activation peak GPipe/1F1B {mem['gpipe_over_1f1b']:.2f}x (expected {mem['expected_gpipe_over_1f1b']:.1f}x)")
    print(f"goals {report['goals']}; wall {report['wall_s']:.0f}s; wrote {path}")


# Zero-bubble sweep: (model shapes, pps, ms) for the full run and for --quick.
ZB_SWEEP = {False: (tuple(SHAPES), (2, 4), (8, 16)), True: ((GOAL_SHAPE,), (2,), (8,))}
ZB_STEPS = {False: 10, True: 5}  # steps 3..N are measured: more steps than part 1's 8, steadier medians


def zero_bubble(quick: bool) -> dict[str, list[dict]]:
    return zero_bubble_shapes(*ZB_SWEEP[quick], ZB_STEPS[quick], 1 if quick else 3)  # rounds: >= 3 for a median


def zero_bubble_main(args, torch) -> None:
    """``--only zero_bubble``: part 4 and ZB-H1's activation peak, in a file of their own."""
    t0 = time.monotonic()
    steps = 5 if args.quick else 8
    report: dict = {
        "machine": machine(torch=torch.__version__, load_average_start=load_average()),
        "config": {"model": list(MODEL), "dp": 1, "tp": 1, "steps": steps, "warmup_steps_skipped": WARMUP_STEPS,
                   "quick": args.quick, "layers_per_pp_rank": 2, "zero_bubble_shapes": SHAPES,
                   "zero_bubble_steps": ZB_STEPS[args.quick]},  # fmt: skip
    }
    try:
        print("activation memory 1F1B vs ZB-H1 (pp=2, m=8)", flush=True)
        report["activation_memory"] = activation_memory(3, ("1f1b", "zb-h1"))
        mem = report["activation_memory"]
        print(f"ZB-H1 / 1F1B peak: microbatches {mem['zb-h1']['peak_in_flight_max']} / "
              f"{mem['1f1b']['peak_in_flight_max']}, saved bytes {mem['zb_h1_over_1f1b']:.3f}, with kept gradients "
              f"{mem['zb_h1_over_1f1b_with_kept_gradients']:.3f}", flush=True)
        print("zero bubble vs 1F1B and interleaved", flush=True)
        report["zero_bubble"] = zero_bubble(args.quick)
    finally:
        shutdown_pool()
    report["goals"] = {
        "zb_h1_same_activation_peak": report["activation_memory"]["zb_h1_goal_met"],
        "zb_h1_bubble_third_of_1f1b": goal_met(report["zero_bubble"]),
    }
    report["machine"]["load_average_end"] = load_average()
    report["wall_s"] = time.monotonic() - t0
    report["notes"] = zero_bubble_notes(report)
    write_result(args.out, report)
    print(f"goals {report['goals']}; wall {report['wall_s']:.0f}s; wrote {args.out}")


def zero_bubble_notes(report: dict) -> list[str]:
    cpus = report["machine"]["cpus"]
    return [
        f"Zero bubble. Machine: {cpus} cores, no GPU, one intra-op thread per rank; load average "
        f"{report['machine']['load_average_start']} at start, {report['machine']['load_average_end']} at the "
        "end (the bench's own ranks included: above the core count, ranks waited for a core, and with pp > "
        "cores an idle rank hands its core to the others, so the pp=4 figures are not wall-clock idle of a "
        "one-core-per-rank machine). Medians over steps 3..N of every round.",
        "bottleneck_idle_over_busy is the zero-bubble paper's bubble rate: the idle time of the rank that "
        "computes longest in a step over its compute. idle_over_busy (idle share of the window averaged "
        "over ranks, as idle/compute) also counts a faster stage waiting for a slower one: the same under "
        "every schedule, so it pulls ZB-H1 / 1F1B towards 1. Theory at F = I = W: 1F1B (p-1)/m, interleaved "
        "(p-1)/(2m), ZB-H1 (p-1)/(3m): a third is the schedule's own value at equal costs, so measured "
        "ratios sit at it, on either side by the noise of the machine.",
        "zb_h1_over_1f1b_formula_at_measured_costs is the paper's (F+I-W)/(F+I+W) at the measured means of "
        "the stages after the first (the first stage's I is empty and its W the whole backward, as in "
        "torch's zero-bubble schedules; nothing waits for that stage's input gradient). attention_heavy "
        "puts I at ~1.36 W: the formula is ~0.45 there and the measurement follows it; the goal is judged "
        "at gemm_bound, where F, I and W are within a few percent (bench/pipeline_zero_bubble.py).",
        "peak_in_flight_stage_units: microbatches held until their W (or B) on the busiest rank, in whole "
        "pp-stage units (zbv and interleaved hold half-size virtual stages); activation_memory measures "
        "ZB-H1's saved bytes against 1F1B's.",
    ]


def notes(report: dict) -> list[str]:
    cpus = report["machine"]["cpus"]
    return [
        f"Machine: {cpus} cores, no GPU; each rank is a process with one intra-op thread. Load average "
        f"{report['machine']['load_average_start']} at start, {report['machine']['load_average_end']} at "
        "the end (the bench's own ranks included): above the core count, ranks waited for a core and absolute "
        "times are noisy.",
        "measured = 1 - sum(F+B action time over ranks) / (pp x pipeline window), window = earliest "
        "Executor.run start to latest end over the pp ranks, averaged over steps 3..N. It is the quantity "
        "theory (pp-1)/(m+pp-1) describes; measured_vs_full_step_per_rank also counts the optimizer step, "
        "gradient clipping (a pp all-reduce) and data loading as idle, so it is larger.",
        f"pp=4 runs 4 single-threaded ranks on {cpus} cores: in the steady state every rank is runnable, "
        "so each F/B takes ~2x longer in wall time (time spent descheduled counts as busy) and its length "
        "varies a lot from one action to the next (action_time_cv_per_stage_op), while the fill/drain "
        "phases run with fewer ranks competing. cpu_busy_share (process CPU seconds / (pp x window)) is "
        f"capped at {min(1.0, cpus / 4):.2f} for pp=4 here. Three replays split measured - theory: "
        "replay_measured_stage_costs (the schedule with each stage's mean F/B, communication free: stage "
        "imbalance), replay_measured_action_durations (each step replayed with every action's own "
        "measured duration: imbalance plus the jitter of action times, which 1F1B's slack-free steady "
        "state turns into idle time), and measured - replay_measured_action_durations = what the "
        "hand-offs and the executor between actions add. handoff_latency_ms is send posted -> receive "
        "done where the receiver already waited; recv_of_an_already_sent_tensor_ms is the receive call "
        "itself where the send came first (gloo moves the data only once the receive is posted, so "
        "the executor posts up to 4 receives ahead on gloo; see workers/pipeline.py).",
        "simulated_mean_costs runs meshspeak.schedule_sim with the measured mean F and B: with one cost "
        "for every stage it equals the theory, which checks the schedule, not the machine.",
        "interleaved_vs_1f1b_by_m: same model (4 layers), 1F1B with 2 layers per stage vs interleaved with 1 "
        "layer per virtual stage (twice the sends, half-size actions); A/B runs alternate and medians are "
        "compared. Theory at m=8: bubble 1/9 -> 1/17 of the step, i.e. 1.06x faster at best (m=4: 1/5 -> 1/9, "
        "1.11x). That gain is smaller "
        "than the run-to-run swing of F/B speed caused by the other jobs on these 2 cores (F/B times "
        "vary 2x between runs), so the raw step-time ratio can land on either side of 1; "
        "speedup_at_equal_compute = (1 - bubble_interleaved) / (1 - bubble_1f1b) from the measured bubbles "
        "factors the compute speed out.",
        "activation_memory: bytes of distinct storages saved by autograd inside the stage forward "
        "(saved_tensors_hooks; parameters and buffers excluded), live until their backward frees them; "
        "one_microbatch_saved_bytes is what the first F of a step saved; expected = "
        "schedule.peak_in_flight x that. Stage boundary buffers are included only where autograd saves "
        "them (the received input is saved by the first norm).",
    ]


if __name__ == "__main__":
    main()
