"""The report's figures (matplotlib, PNG of a fixed size): what a run did, to look at instead of read.

``loss.png`` loss (each step's last record; re-run records faint) and eval loss over steps;
``throughput.png`` tokens/s over wall time; ``mesh.png`` dp, pp, tp and world size over wall time;
``events.png`` every event on the time axis, one row per kind; ``recovery.png`` the time of each
recovery, coloured by fault kind; ``goodput.png`` where the wall time went. The time-axis figures
mark the failures, rebuilds, grows, preemptions, evictions and checkpoints with vertical lines.

Figures are made with ``matplotlib.figure.Figure`` and the Agg canvas: no pyplot, no global
backend switch, nothing shown.
"""

from __future__ import annotations

import os

from orchestrator.report.goodput import BUCKETS, FAULT_KINDS, Ledger, is_step

WIDTH_IN, HEIGHT_IN, DPI = 10.0, 4.0, 100  # every PNG is 1000 x 400 pixels
SIZE_PX = (int(WIDTH_IN * DPI), int(HEIGHT_IN * DPI))
FIGURES = ("goodput", "loss", "throughput", "mesh", "events", "recovery")
COLORS = {"failure": "#d62728", "hang": "#ff7f0e", "preemption": "#9467bd", "eviction": "#8c564b",
          "evict": "#8c564b", "grow": "#2ca02c", "resize": "#17becf", "rollback": "#e377c2",
          "rebuild": "#bcbd22", "checkpoint": "#1f77b4", "start": "#7f7f7f", "stopped": "#000000",
          "done": "#000000", "eval": "#aec7e8", "snapshot": "#c7c7c7"}
MARKED = ("failure", "rebuild", "grow", "preemption", "evict", "checkpoint", "rollback", "stopped")
BUCKET_COLORS = {"useful": "#2ca02c", "startup": "#7f7f7f", "checkpoint": "#1f77b4", "snapshot": "#aec7e8",
                 "evaluation": "#bcbd22", "recovery": "#d62728", "rerun": "#ff7f0e", "overhead": "#c7c7c7",
                 "down": "#000000"}


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _mark_events(ax, records: list[dict], t0: float) -> None:
    seen = set()
    for rec in records:
        kind = rec.get("event")
        if kind in MARKED and isinstance(rec.get("time"), (int, float)):
            ax.axvline(rec["time"] - t0, color=COLORS[kind], lw=0.8, alpha=0.7,
                       label=kind if kind not in seen else None)
            seen.add(kind)


def _legend_outside(ax) -> None:
    """Right of the axes: inside, the legend hid the lines at the top (the world size back at its peak)."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)


def _steps(records: list[dict]) -> list[dict]:
    return [r for r in records if is_step(r) and isinstance(r.get("time"), (int, float))]


def loss_figure(ax, records: list[dict]) -> None:
    steps = [r for r in records if is_step(r)]
    last = {r["step"]: r for r in steps}
    rerun = [r for r in steps if last[r["step"]] is not r]
    xs = sorted(last)
    ax.plot(xs, [last[s]["loss"] for s in xs], color="#1f77b4", lw=1.2, label="loss")
    if rerun:
        ax.scatter([r["step"] for r in rerun], [r["loss"] for r in rerun], s=10, color="#ff7f0e", alpha=0.6,
                   label="re-run steps (first try)")
    evals = [r for r in records if r.get("event") == "eval"]
    if evals:
        ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", color="#d62728", label="eval loss")
    ax.set(xlabel="step", ylabel="loss", title="loss over steps")
    ax.legend(loc="upper right", fontsize=8)


def throughput_figure(ax, records: list[dict], t0: float) -> None:
    steps = _steps(records)
    ax.plot([r["time"] - t0 for r in steps], [r.get("tokens_per_s", 0.0) for r in steps], ".-", ms=3, lw=0.8,
            color="#2ca02c", label="tokens/s")
    _mark_events(ax, records, t0)
    ax.set(xlabel="wall time (s)", ylabel="tokens/s", title="throughput over wall time")
    _legend_outside(ax)


def mesh_figure(ax, records: list[dict], t0: float) -> None:
    points = [(r["time"] - t0, r) for r in records if isinstance(r.get("time"), (int, float))
              and (is_step(r) or r.get("event") in ("start", "rebuild", "grow")) and "dp" in r]
    if points:
        xs = [x for x, _ in points]
        # world first, wide and pale: with pp = tp = 1 the dp line lies on it and must stay visible
        ax.step(xs, [r.get("dp", 1) * r.get("pp", 1) * r.get("tp", 1) for _, r in points], where="post",
                color="#000000", lw=4, alpha=0.3, label="world")
        for axis, color, style in (("dp", "#1f77b4", "-"), ("pp", "#ff7f0e", "--"), ("tp", "#9467bd", ":")):
            ax.step(xs, [r.get(axis, 1) for _, r in points], where="post", color=color, ls=style, label=axis)
    _mark_events(ax, records, t0)
    ax.set(xlabel="wall time (s)", ylabel="ranks", title="mesh size over wall time")
    ax.yaxis.get_major_locator().set_params(integer=True)
    _legend_outside(ax)


def events_figure(ax, records: list[dict], t0: float) -> None:
    kinds = sorted({r["event"] for r in records if "event" in r and isinstance(r.get("time"), (int, float))})
    for row, kind in enumerate(kinds):
        xs = [r["time"] - t0 for r in records if r.get("event") == kind and isinstance(r.get("time"), (int, float))]
        ax.scatter(xs, [row] * len(xs), s=18, marker="|" if kind == "snapshot" else "o",
                   color=COLORS.get(kind, "#333333"))
    ax.set_yticks(range(len(kinds)), kinds, fontsize=8)
    ax.set(xlabel="wall time (s)", title="events on the time axis")
    ax.grid(axis="x", alpha=0.3)


def recovery_figure(ax, ledger: Ledger) -> None:
    recs = ledger.recoveries
    t0 = ledger.start or 0.0
    ax.bar(range(len(recs)), [r.seconds for r in recs], color=[COLORS.get(r.kind, "#333333") for r in recs])
    ax.set_xticks(range(len(recs)), [f"{r.kind}\n@{r.start - t0:.0f}s" for r in recs], fontsize=7)
    for kind in FAULT_KINDS:
        if any(r.kind == kind for r in recs):
            ax.bar([0], [0], color=COLORS[kind], label=kind)
    ax.set(ylabel="seconds", title=f"recovery time per fault ({len(recs)})")
    if recs:
        ax.legend(loc="upper right", fontsize=8)


def goodput_figure(ax, ledger: Ledger) -> None:
    left = 0.0
    for bucket in BUCKETS:
        seconds = ledger.seconds[bucket]
        if seconds > 0:
            ax.barh([0], [seconds], left=left, color=BUCKET_COLORS[bucket],
                    label=f"{bucket} {seconds:.0f}s ({seconds / max(ledger.wall_s, 1e-9):.0%})")
            left += seconds
    ax.set_yticks([])
    ax.set(xlabel="wall time (s)", title=f"where the wall time went: goodput {ledger.goodput:.1%} "
                                         f"of {ledger.wall_s:.0f}s")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, fontsize=8)


def write_figures(records: list[dict], ledger: Ledger, out_dir: str) -> dict[str, str]:
    """Every figure as ``out_dir/<name>.png``; name -> path."""
    t0 = ledger.start or 0.0
    draw = {"goodput": lambda ax: goodput_figure(ax, ledger), "loss": lambda ax: loss_figure(ax, records),
            "throughput": lambda ax: throughput_figure(ax, records, t0),
            "mesh": lambda ax: mesh_figure(ax, records, t0), "events": lambda ax: events_figure(ax, records, t0),
            "recovery": lambda ax: recovery_figure(ax, ledger)}
    paths = {}
    for name in FIGURES:
        fig, ax = _figure()
        draw[name](ax)
        paths[name] = os.path.join(out_dir, f"{name}.png")
        fig.savefig(paths[name], dpi=DPI)
    return paths
