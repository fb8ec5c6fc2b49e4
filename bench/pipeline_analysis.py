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
    tally = _Tally(pp)
    for i in steps:
        _tally_step(run, i, tally)
    costs = _MeanCosts(tally.costs)
    sim = simulate(run.actions, pp, run.virtual_stages, f_cost=costs.f_mean, b_cost=costs.b_mean,
                   i_cost=costs.op_mean.get(Op.BACKWARD_INPUT), w_cost=costs.op_mean.get(Op.BACKWARD_WEIGHT),
                   placement=placement_of(run.schedule))
    stage_cost_sim = _simulate(run, lambda a: costs.mean_cost[(a.stage, a.op)])
    return {**_bubble_figures(tally, sim, stage_cost_sim), **_time_figures(run, steps, tally, costs)}


class _Tally:
    """What ``bubble_stats`` gathers over the measured steps."""

    def __init__(self, pp: int) -> None:
        self.per_step: list[float] = []
        self.per_rank_window: list[list[float]] = [[] for _ in range(pp)]
        self.per_rank_step: list[list[float]] = [[] for _ in range(pp)]
        self.bottleneck: list[float] = []  # per step: idle / compute of the rank that computed longest
        # Per step: that rank's (compute, receive waits, send posts, the rest) in s.
        self.bottleneck_parts: list[tuple] = []
        self.cpu_share: list[float] = []
        self.windows: list[float] = []
        # Fractions of the window.
        self.parts: dict[str, list[float]] = {"compute": [], "recv_wait": [], "send_post": [], "other": []}
        self.costs: dict[tuple[int, Op], list[float]] = {}
        self.replay_per_step: list[float] = []
        self.handoffs: list[float] = []
        self.late_recvs: list[float] = []


def _tally_step(run, i: int, tally: _Tally) -> None:
    """Step ``i``: each rank's split of the pipeline window, the busiest rank, the replay at the step's
    own action durations, the hand-off latencies."""
    pp = run.shape.pp
    win = [run.extras[r][i] for r in range(pp)]
    start, end = min(w[0] for w in win), max(w[1] for w in win)
    window = end - start
    tally.windows.append(window)
    busy_total = 0.0
    splits = []  # per rank: (compute, receive waits, send posts, the rest) of the window, s
    durations: dict[Action, float] = {}  # this step's F/B actions, all ranks
    spans: dict[Action, tuple[float, float]] = {}  # absolute (start, end) of every action
    for r in range(pp):
        result = run.results[r][i]
        busy, recv, send = _rank_times(result.timings, win[r][0], spans, durations, tally.costs)
        busy_total += busy
        splits.append((busy, recv, send, window - busy - recv - send))
        for key, seconds in zip(tally.parts, splits[-1]):
            tally.parts[key].append(seconds / window)
        tally.per_rank_window[r].append(1.0 - busy / window)
        tally.per_rank_step[r].append(1.0 - busy / result.step_time_s)
    tally.per_step.append(1.0 - busy_total / (pp * window))
    busiest = max(splits)  # the rank that computed longest
    tally.bottleneck.append((window - busiest[0]) / busiest[0])
    tally.bottleneck_parts.append(busiest)
    tally.cpu_share.append(sum(w[2] for w in win) / (pp * window))
    tally.replay_per_step.append(_replay(run, durations.__getitem__))
    waiting, late = _handoff_latencies(spans)
    tally.handoffs += waiting
    tally.late_recvs += late


def _rank_times(timings, origin: float, spans: dict, durations: dict, costs: dict) -> tuple[float, float, float]:
    """One rank's (compute, receive waits, send posts) in a step, in s; each action's absolute span,
    each F/B's duration and its cost by (stage, op) are recorded on the way."""
    busy = recv = send = 0.0
    for t in timings:
        a = _parse(t.action)
        spans[a] = (origin + t.start_s, origin + t.end_s)
        if a.op in COMPUTE_OPS:
            busy += t.end_s - t.start_s
            durations[a] = t.end_s - t.start_s
            costs.setdefault((a.stage, a.op), []).append(t.end_s - t.start_s)
        elif a.op in (Op.RECV_F, Op.RECV_B):
            recv += t.end_s - t.start_s
        else:
            send += t.end_s - t.start_s
    return busy, recv, send


class _MeanCosts:
    """Mean compute time per (stage, op) and per op over the measured steps."""

    def __init__(self, costs: dict[tuple[int, Op], list[float]]) -> None:
        self.costs = costs
        self.mean_cost = {k: statistics.mean(v) for k, v in costs.items()}
        self.op_mean = {op: statistics.mean(v for (s, o), v in self.mean_cost.items() if o == op)
                        for op in COMPUTE_OPS if any(o == op for _, o in self.mean_cost)}  # fmt: skip
        self.f_mean = self.op_mean[Op.FORWARD]
        # A zero-bubble run has I and W instead of B: its "B" is their sum.
        self.b_mean = self.op_mean.get(Op.BACKWARD, self.op_mean.get(Op.BACKWARD_INPUT, 0.0)
                                       + self.op_mean.get(Op.BACKWARD_WEIGHT, 0.0))


def _bubble_figures(tally: _Tally, sim, stage_cost_sim) -> dict:
    """The bubble measured, simulated and replayed, and the hand-off latencies."""
    measured = statistics.mean(tally.per_step)
    return {
        "measured": measured,
        "idle_over_busy": measured / (1 - measured),
        "simulated_idle_over_busy": sim.bubble_fraction / (1 - sim.bubble_fraction),
        "bottleneck_idle_over_busy": statistics.median(tally.bottleneck),
        "bottleneck_idle_over_busy_per_step": tally.bottleneck,
        # Where the busiest rank's window went, ms (medians over steps): compute, waiting in receives,
        # posting sends (free in the theory), and the rest: before its first and after its last action
        # within the ranks' common window (a rank done before the others waits there), and between
        # actions.
        "bottleneck_window_ms": {
            key: 1e3 * statistics.median(p[i] for p in tally.bottleneck_parts)
            for i, key in enumerate(tally.parts)
        },
        "simulated_bottleneck_idle_over_busy": _bottleneck(sim),
        # The schedule at each stage's own mean costs (the first stage's I is empty, see
        # workers/split_backward.py): what the schedule itself allows on this model.
        "replay_stage_costs_bottleneck_idle_over_busy": _bottleneck(stage_cost_sim),
        "measured_median_over_steps": statistics.median(tally.per_step),
        "measured_per_step": tally.per_step,
        "measured_per_rank": [statistics.mean(x) for x in tally.per_rank_window],
        "measured_vs_full_step_per_rank": [statistics.mean(x) for x in tally.per_rank_step],
        "simulated_mean_costs": sim.bubble_fraction,
        "replay_measured_stage_costs": stage_cost_sim.bubble_fraction,
        # The schedule replayed with every F/B action's own measured duration, communication free:
        # what stage imbalance and the run-to-run jitter of action times alone make of the bubble.
        # measured - this = what hand-offs and the executor between actions add.
        "replay_measured_action_durations": statistics.mean(tally.replay_per_step),
        "replay_measured_action_durations_per_step": tally.replay_per_step,
        "handoff_latency_ms": _quantiles_ms(tally.handoffs),
        "recv_of_an_already_sent_tensor_ms": _quantiles_ms(tally.late_recvs),
    }


def _time_figures(run, steps: range, tally: _Tally, costs: _MeanCosts) -> dict:
    """The action times (their spread, the means per op and per stage), the window, the step, and
    where each rank's window went."""
    pp = run.shape.pp
    per_stage = {
        f"{op.value}_s_per_stage": [costs.mean_cost[(s, op)] for s in range(pp * run.virtual_stages)]
        for op in costs.op_mean
    }
    return {
        "action_time_cv_per_stage_op": {
            f"{s}{op.value}": statistics.pstdev(v) / statistics.mean(v) for (s, op), v in sorted(costs.costs.items())
        },
        "mean_F_s": costs.f_mean,
        "mean_B_s": costs.b_mean,
        **{f"mean_{op.value}_s": costs.op_mean[op] for op in (Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
           if op in costs.op_mean},
        **per_stage,
        "pipeline_window_s": statistics.mean(tally.windows),
        "pipeline_window_s_per_step": tally.windows,
        "step_time_s": statistics.mean(
            max(run.results[r][i].step_time_s for r in range(pp)) for i in steps
        ),
        "cpu_busy_share": statistics.mean(tally.cpu_share),
        # Where each rank's window went (mean over ranks and steps); "other" is the skew between the
        # ranks' starts/ends, Python between actions and waiting for the step's last sends.
        "window_breakdown": {k: statistics.mean(v) for k, v in tally.parts.items()},
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
