"""The zero-bubble part of bench/pipeline_bubble.py: ZB-H1 and ZB-V against 1F1B and interleaved 1F1B.

For each pp in {2, 4} and m in {8, 16} (``--quick``: pp=2, m=8) the four schedules train the same model
(``n_layers = 2 pp``): 1F1B and ZB-H1 with two layers per stage, interleaved 1F1B and ZB-V with one
layer per virtual stage (two per rank: the same work per rank). The runs of one (pp, m) alternate
A/B/C/D for ``rounds`` rounds to spread the other jobs' load over all four. Per schedule:

* ``bottleneck_idle_over_busy``: the zero-bubble paper's bubble rate (Qi et al., section 5): per step,
  the idle time of the rank that computes longest over its compute (a step lasts exactly that), median
  over the steps of every round. 1F1B (p-1)/m, interleaved (p-1)/(2m), ZB-H1 (p-1)/(3m) at F = I = W;
* ``idle_over_busy`` from ``measured`` (the idle share of the pipeline window averaged over the ranks):
  it also counts the time a faster stage waits for a slower one, which no schedule removes and which
  therefore pulls every ratio towards 1;
* ``simulated_idle_over_busy``, ``replay_stage_costs_bottleneck_idle_over_busy``: the schedule
  simulated with the run's mean F, I, W (or B) costs, and with each stage's own means (communication
  free): what the schedule allows at these costs;
* ``action_s_per_stage``, and per row ``zb_h1_over_1f1b_formula_at_measured_costs``, the paper's
  ZB-H1 / 1F1B = (F + I - W) / (F + I + W) at the measured costs: below 1/3 only where 2W >= F + I;
* ``peak_in_flight_stage_units``: the most microbatches a rank holds until their W (or B), in units of
  a whole pp stage (a virtual stage holds half), from the action lists.

Two model shapes (``SHAPES``). ``gemm_bound`` (d_model 512, seq_len 64, 4 sequences per microbatch)
is where the schedule's premise F = I = W holds on this CPU (a 2-layer stage: F 59, I 61, W 61 ms):
the weight GEMMs are as large as the input-gradient ones and attention is ~4% of the work.
``attention_heavy`` (d_model 256, seq_len 256, 2 sequences: the rest of pipeline_bubble's model) puts
attention's and the elementwise ops' backward, all of it in I, at I = 1.36 W (F 43, I 49, W 36 ms):
there the formula itself is 0.45, so no measurement can reach a third; it is run to show the ratio
follows the costs.

Goal (issue 27): at the ``gemm_bound`` shape, ZB-H1's ``bottleneck_idle_over_busy`` <= 1/3 of 1F1B's at
the same activation peak, on the median over every round's steps (``goal_met_pooled``) and in every
round (``zb_h1_over_1f1b_bottleneck_per_round``: each round's ratio, their median and spread;
``rounds_meeting_goal``); ``goal_met`` needs both.
"""

from __future__ import annotations

import os
import statistics

from pipeline_analysis import bubble_stats
from pipeline_probes import timing_probe
from stats import paired_ratios, repeats_meeting, spread

from meshspeak.schedule import peak_in_flight, theoretical_bubble
from testbed.world import run_mesh

SCHEDULES = ("1f1b", "interleaved_1f1b", "zb-h1", "zbv")
# name -> (model overrides, sequences per microbatch); the docstring says why two.
SHAPES = {
    "gemm_bound": (("model.d_model=512", "model.n_heads=8", "model.seq_len=64"), 4),
    "attention_heavy": (("model.d_model=256", "model.n_heads=4", "model.seq_len=256"), 2),
}
GOAL_SHAPE = "gemm_bound"


def _variant(name: str, pp: int) -> tuple[int, tuple[str, ...]]:
    v = 2 if name in ("interleaved_1f1b", "zbv") else 1
    return v, (f"pipeline.layers={[2 // v] * pp * v}",)


def zero_bubble_shapes(shapes, pps, ms, steps: int, rounds: int) -> dict[str, list[dict]]:
    """:func:`zero_bubble_sweep` for each named shape of ``SHAPES``."""
    out = {}
    for name in shapes:
        model, micro = SHAPES[name]
        print(f" shape {name}: {' '.join(model)}, {micro} sequences per microbatch", flush=True)
        out[name] = zero_bubble_sweep((*model, f"train.micro_batch_size={micro}"), micro, pps, ms, steps, rounds)
    return out


def goal_met(by_shape: dict[str, list[dict]]) -> bool:
    """Issue 27's goal, on the rows of ``GOAL_SHAPE``."""
    return all(row["goal_met"] for row in by_shape[GOAL_SHAPE])


def zero_bubble_sweep(model: tuple[str, ...], micro: int, pps, ms, steps: int, rounds: int) -> list[dict]:
    rows = []
    for pp in pps:
        for m in ms:
            samples, actions = _measure_schedules(model, micro, pp, m, steps, rounds)
            row: dict = {"pp": pp, "m": m, "rounds": rounds}
            for name, runs in samples.items():
                lists, v = actions[name]
                row[name] = _schedule_figures(runs, lists, v)
            _compare_with_1f1b(row, pp, m)
            per_round, every_round = _per_round(samples)
            row.update(per_round)
            # The goal on the median over every round's steps, and in every round (bench/README.md's rule).
            row["goal_met_pooled"], row["goal_met"] = row["goal_met"], row["goal_met"] and every_round
            _print_row(row, pp, m)
            rows.append(row)
    return rows


def _measure_schedules(model: tuple[str, ...], micro: int, pp: int, m: int, steps: int,
                       rounds: int) -> tuple[dict[str, list[dict]], dict]:
    """``rounds`` runs of every schedule at (pp, m), interleaved: each run's bubble_stats, and each
    schedule's action lists with its virtual stages."""
    base = (*model, f"model.n_layers={2 * pp}", f"train.global_batch_size={m * micro}")
    samples: dict[str, list[dict]] = {name: [] for name in SCHEDULES}
    actions = {}
    for _ in range(rounds):
        for name in SCHEDULES:
            v, layers = _variant(name, pp)
            run = run_mesh(1, pp, 1, (*base, *layers), steps, schedule=name, virtual_stages=v,
                           collect_params=False, instrument=timing_probe, timeout=900)  # fmt: skip
            samples[name].append(bubble_stats(run))
            actions[name] = (run.actions, v)
    return samples, actions


def _schedule_figures(runs: list[dict], lists, v: int) -> dict:
    """One schedule's figures over its runs (medians of the per-step values, means of the per-run ones)."""
    per_step = [b for r in runs for b in r["measured_per_step"]]
    measured = statistics.median(per_step)
    return {
        "measured": measured,
        "measured_mean": statistics.mean(per_step),
        "idle_over_busy": measured / (1 - measured),
        "bottleneck_idle_over_busy": statistics.median(
            b for r in runs for b in r["bottleneck_idle_over_busy_per_step"]),
        "bottleneck_window_ms": {k: statistics.mean(r["bottleneck_window_ms"][k] for r in runs)
                                 for k in runs[0]["bottleneck_window_ms"]},
        "simulated_idle_over_busy": statistics.mean(r["simulated_idle_over_busy"] for r in runs),
        "replay_stage_costs_bottleneck_idle_over_busy": statistics.mean(
            r["replay_stage_costs_bottleneck_idle_over_busy"] for r in runs),
        "replay_measured_action_durations": statistics.mean(
            r["replay_measured_action_durations"] for r in runs),
        "peak_in_flight_stage_units": max(peak_in_flight(a) for a in lists) / v,
        "mean_action_s": {k: statistics.mean(r[k] for r in runs)
                          for k in ("mean_F_s", "mean_B_s", "mean_I_s", "mean_W_s") if k in runs[0]},
        "action_s_per_stage": {k: [statistics.mean(x) for x in zip(*(r[k] for r in runs))]
                               for k in runs[0] if k.endswith("_s_per_stage")},
        "step_time_s_median": statistics.median(r["step_time_s"] for r in runs),
        "cpu_busy_share": statistics.mean(r["cpu_busy_share"] for r in runs),
    }  # fmt: skip


def _per_round(samples: dict[str, list[dict]]) -> tuple[dict, bool]:
    """The headline ratio round by round (each round's ZB-H1 bottleneck bubble rate over the 1F1B run
    interleaved with it, medians over their steps) with its median and spread, in how many rounds it
    was <= 1/3, and whether every round was."""
    def medians(name: str) -> list[float]:
        return [statistics.median(r["bottleneck_idle_over_busy_per_step"]) for r in samples[name]]

    ratios = paired_ratios(medians("zb-h1"), medians("1f1b"))
    meeting, every_round = repeats_meeting(ratios, lambda r: r <= 1 / 3)
    return {"zb_h1_over_1f1b_bottleneck_per_round": spread(ratios), "rounds_meeting_goal": meeting}, every_round


def _compare_with_1f1b(row: dict, pp: int, m: int) -> None:
    """The theory beside the measures, the zero-bubble schedules over 1F1B, and the goal (in ``row``)."""
    ofob, h1 = row["1f1b"], row["zb-h1"]
    row["1f1b"]["theory_idle_over_busy"] = (pp - 1) / m
    row["interleaved_1f1b"]["theory_idle_over_busy"] = (pp - 1) / (2 * m)
    row["zb-h1"]["theory_idle_over_busy"] = (pp - 1) / (3 * m)  # F = I = W
    row["1f1b"]["theory_bubble"] = theoretical_bubble(pp, m)
    for key, field in (("idle", "idle_over_busy"), ("bottleneck", "bottleneck_idle_over_busy"),
                       ("idle_simulated_at_measured_costs", "simulated_idle_over_busy"),
                       ("bottleneck_at_stage_costs", "replay_stage_costs_bottleneck_idle_over_busy")):
        row[f"zb_h1_over_1f1b_{key}"] = h1[field] / ofob[field]
    row["zb_h1_over_1f1b_formula_at_measured_costs"] = formula_ratio(h1["action_s_per_stage"])
    for key, field in (("idle", "idle_over_busy"), ("bottleneck", "bottleneck_idle_over_busy")):
        row[f"zbv_over_1f1b_{key}"] = row["zbv"][field] / ofob[field]
    row["same_activation_peak"] = h1["peak_in_flight_stage_units"] == ofob["peak_in_flight_stage_units"]
    row["goal_met"] = row["same_activation_peak"] and row["zb_h1_over_1f1b_bottleneck"] <= 1 / 3
    # With fewer cores than ranks a rank waiting in a receive hands its core to the others, so
    # the phases where 1F1B idles run faster than they would with a core each: its bubble is
    # measured below its theory and the ratio is not the schedule's. Reported, still judged.
    row["one_core_per_rank"] = pp <= (os.cpu_count() or 1)


def _print_row(row: dict, pp: int, m: int) -> None:
    ofob, h1 = row["1f1b"], row["zb-h1"]
    print(f"  pp={pp} m={m:2d}: idle/busy at the bottleneck rank (averaged over ranks) 1f1b "
          f"{ofob['bottleneck_idle_over_busy']:.3f} ({ofob['idle_over_busy']:.3f}) interleaved "
          f"{row['interleaved_1f1b']['bottleneck_idle_over_busy']:.3f} zb-h1 "
          f"{h1['bottleneck_idle_over_busy']:.3f} ({h1['idle_over_busy']:.3f}) zbv "
          f"{row['zbv']['bottleneck_idle_over_busy']:.3f}; zb-h1/1f1b {row['zb_h1_over_1f1b_bottleneck']:.2f} "
          f"({row['zb_h1_over_1f1b_idle']:.2f}); at the stage costs "
          f"{row['zb_h1_over_1f1b_bottleneck_at_stage_costs']:.2f}, formula "
          f"{row['zb_h1_over_1f1b_formula_at_measured_costs']:.2f}", flush=True)


def formula_ratio(per_stage: dict[str, list[float]]) -> float:
    """The paper's ZB-H1 / 1F1B bubble, (F + I - W) / (F + I + W), at the measured mean costs of the
    stages after the first (the first stage's I is empty and its W the whole backward; nothing waits
    for its input gradient). Below 1/3 only where 2 W >= F + I."""
    f, i, w = (statistics.mean(per_stage[f"{op}_s_per_stage"][1:]) for op in "FIW")
    return (f + i - w) / (f + i + w)
