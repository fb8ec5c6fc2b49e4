"""Analysis for bench/pipeline_bubble.py: the measured bubble of a run and where the rest went.

Pure functions over a ``testbed.world.MeshRun`` made with ``pipeline_probes.timing_probe``:
the bubble over each step's pipeline window, replays of the schedule (``meshspeak.schedule_sim``,
communication free) with the measured per-stage means and with every action's own duration, and
hand-off latencies.
"""

from __future__ import annotations

import statistics

from meshspeak.schedule import COMPUTE_OPS, Action, Op, message_key, placement_of
from meshspeak.schedule_sim import simulate

WARMUP_STEPS = 2  # steps 1-2 are left out of every figure


def _parse(name: str) -> Action:
    """ActionTiming.action text ("2F0", "1SEND_F3") back to an Action."""
    i = 0
    while name[i].isdigit():
        i += 1
    j = len(name)
    while name[j - 1].isdigit():
        j -= 1
    return Action(int(name[:i]), Op(name[i:j]), int(name[j:]))


def bubble_stats(run) -> dict:
    """Measured bubble of a run (pp ranks, dp = tp = 1) over the steps after the warm-up.

    ``measured`` is the idle share of the pipeline window, averaged over the ranks; ``idle_over_busy``
    = measured / (1 - measured) is the same idle time relative to the compute time (Megatron's (p-1)/m
    for 1F1B, ZB-H1's (p-1)/(3m)). ``bottleneck_idle_over_busy`` is the zero-bubble paper's bubble
    rate (Qi et al., section 5): the idle time of the rank with the most compute in the step, over
    that compute, median over steps. The step lasts that rank's compute plus its idle, so this is the
    time the schedule adds to a step; the average also counts the idle a faster stage spends waiting
    for a slower one, which no schedule removes (it is the same under every schedule)."""
    pp = run.shape.pp
    steps = range(WARMUP_STEPS, len(run.results[0]))
    per_step, per_rank_window, per_rank_step = [], [[] for _ in range(pp)], [[] for _ in range(pp)]
    bottleneck = []  # per step: idle / compute of the rank that computed longest
    bottleneck_parts = []  # per step: that rank's (compute, receive waits, send posts, the rest) in s
    cpu_share, windows = [], []
    parts = {"compute": [], "recv_wait": [], "send_post": [], "other": []}  # fractions of the window
    costs: dict[tuple[int, Op], list[float]] = {}
    replay_per_step, handoffs, late_recvs = [], [], []
    for i in steps:
        win = [run.extras[r][i] for r in range(pp)]
        start, end = min(w[0] for w in win), max(w[1] for w in win)
        window = end - start
        windows.append(window)
        busy_total = 0.0
        splits = []  # per rank: (compute, receive waits, send posts, the rest) of the window, s
        durations: dict[Action, float] = {}  # this step's F/B actions, all ranks
        spans: dict[Action, tuple[float, float]] = {}  # absolute (start, end) of every action
        for r in range(pp):
            result = run.results[r][i]
            busy = recv = send = 0.0
            for t in result.timings:
                a = _parse(t.action)
                spans[a] = (win[r][0] + t.start_s, win[r][0] + t.end_s)
                if a.op in COMPUTE_OPS:
                    busy += t.end_s - t.start_s
                    durations[a] = t.end_s - t.start_s
                    costs.setdefault((a.stage, a.op), []).append(t.end_s - t.start_s)
                elif a.op in (Op.RECV_F, Op.RECV_B):
                    recv += t.end_s - t.start_s
                else:
                    send += t.end_s - t.start_s
            busy_total += busy
            splits.append((busy, recv, send, window - busy - recv - send))
            for key, seconds in zip(parts, splits[-1]):
                parts[key].append(seconds / window)
            per_rank_window[r].append(1.0 - busy / window)
            per_rank_step[r].append(1.0 - busy / result.step_time_s)
        per_step.append(1.0 - busy_total / (pp * window))
        busiest = max(splits)  # the rank that computed longest
        bottleneck.append((window - busiest[0]) / busiest[0])
        bottleneck_parts.append(busiest)
        cpu_share.append(sum(w[2] for w in win) / (pp * window))
        replay_per_step.append(_replay(run, durations.__getitem__))
        waiting, late = _handoff_latencies(spans)
        handoffs += waiting
        late_recvs += late
    mean_cost = {k: statistics.mean(v) for k, v in costs.items()}
    op_mean = {op: statistics.mean(v for (s, o), v in mean_cost.items() if o == op)
               for op in COMPUTE_OPS if any(o == op for _, o in mean_cost)}  # fmt: skip
    f_mean = op_mean[Op.FORWARD]
    # A zero-bubble run has I and W instead of B: its "B" is their sum.
    b_mean = op_mean.get(Op.BACKWARD, op_mean.get(Op.BACKWARD_INPUT, 0.0) + op_mean.get(Op.BACKWARD_WEIGHT, 0.0))
    sim = simulate(run.actions, pp, run.virtual_stages, f_cost=f_mean, b_cost=b_mean,
                   i_cost=op_mean.get(Op.BACKWARD_INPUT), w_cost=op_mean.get(Op.BACKWARD_WEIGHT),
                   placement=placement_of(run.schedule))
    stage_cost_sim = _simulate(run, lambda a: mean_cost[(a.stage, a.op)])
    replayed = stage_cost_sim.bubble_fraction
    measured = statistics.mean(per_step)
    per_stage = {
        f"{op.value}_s_per_stage": [mean_cost[(s, op)] for s in range(pp * run.virtual_stages)]
        for op in op_mean
    }
    return {
        "measured": measured,
        "idle_over_busy": measured / (1 - measured),
        "simulated_idle_over_busy": sim.bubble_fraction / (1 - sim.bubble_fraction),
        "bottleneck_idle_over_busy": statistics.median(bottleneck),
        "bottleneck_idle_over_busy_per_step": bottleneck,
        # Where the busiest rank's window went, ms (medians over steps): compute, waiting in receives,
        # posting sends (free in the theory), and the rest: before its first and after its last action
        # within the ranks' common window (a rank done before the others waits there), and between
        # actions.
        "bottleneck_window_ms": {
            key: 1e3 * statistics.median(p[i] for p in bottleneck_parts)
            for i, key in enumerate(parts)
        },
        "simulated_bottleneck_idle_over_busy": _bottleneck(sim),
        # The schedule at each stage's own mean costs (the first stage's I is empty, see
        # workers/split_backward.py): what the schedule itself allows on this model.
        "replay_stage_costs_bottleneck_idle_over_busy": _bottleneck(stage_cost_sim),
        "measured_median_over_steps": statistics.median(per_step),
        "measured_per_step": per_step,
        "measured_per_rank": [statistics.mean(x) for x in per_rank_window],
        "measured_vs_full_step_per_rank": [statistics.mean(x) for x in per_rank_step],
        "simulated_mean_costs": sim.bubble_fraction,
        "replay_measured_stage_costs": replayed,
        # The schedule replayed with every F/B action's own measured duration, communication free:
        # what stage imbalance and the run-to-run jitter of action times alone make of the bubble.
        # measured - this = what hand-offs and the executor between actions add.
        "replay_measured_action_durations": statistics.mean(replay_per_step),
        "replay_measured_action_durations_per_step": replay_per_step,
        "handoff_latency_ms": _quantiles_ms(handoffs),
        "recv_of_an_already_sent_tensor_ms": _quantiles_ms(late_recvs),
        "action_time_cv_per_stage_op": {
            f"{s}{op.value}": statistics.pstdev(v) / statistics.mean(v) for (s, op), v in sorted(costs.items())
        },
        "mean_F_s": f_mean,
        "mean_B_s": b_mean,
        **{f"mean_{op.value}_s": op_mean[op] for op in (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT) if op in op_mean},
        **per_stage,
        "pipeline_window_s": statistics.mean(windows),
        "pipeline_window_s_per_step": windows,
        "step_time_s": statistics.mean(
            max(run.results[r][i].step_time_s for r in range(pp)) for i in steps
        ),
        "cpu_busy_share": statistics.mean(cpu_share),
        # Where each rank's window went (mean over ranks and steps); "other" is the skew between the
        # ranks' starts/ends, Python between actions and waiting for the step's last sends.
        "window_breakdown": {k: statistics.mean(v) for k, v in parts.items()},
    }


def _bottleneck(sim) -> float:
    """Idle over compute of the simulated rank that computes longest (the paper's bubble rate)."""
    busiest = max(sum(b.end - b.start for b in rank) for rank in sim.busy)
    return (sim.makespan - busiest) / busiest


def _simulate(run, cost):
    """The run's schedule under the simulator's model (free communication), where ``cost(action)``
    is the seconds an F or B action takes."""
    return simulate(run.actions, run.shape.pp, run.virtual_stages, cost=cost, placement=placement_of(run.schedule))


def _replay(run, cost) -> float:
    """Bubble fraction of :func:`_simulate`."""
    return _simulate(run, cost).bubble_fraction


def _handoff_latencies(spans: dict[Action, tuple[float, float]]) -> tuple[list[float], list[float]]:
    """(send posted -> receive done, where the receiver was already waiting; receive call -> done,
    where the send was posted before the receive was called)."""
    sends, recvs = {}, {}
    for a, span in spans.items():
        if a.op in (Op.SEND_F, Op.SEND_B):
            sends[message_key(a)] = span[0]
        elif a.op in (Op.RECV_F, Op.RECV_B):
            recvs[message_key(a)] = span
    waiting, late = [], []
    for key, send_start in sends.items():
        recv_start, recv_end = recvs[key]
        if recv_start < send_start:
            waiting.append(recv_end - send_start)
        else:
            late.append(recv_end - recv_start)
    return waiting, late


def _quantiles_ms(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    values = sorted(values)
    return {"n": len(values), "median": 1e3 * statistics.median(values),
            "p90": 1e3 * values[int(0.9 * (len(values) - 1))], "max": 1e3 * values[-1]}  # fmt: skip
