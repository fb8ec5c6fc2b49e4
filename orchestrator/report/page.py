"""The report's words: the goodput table (rich), ``report.json`` and one self-contained HTML page
that embeds the figures (base64 PNG) beside the same table, so the page can be mailed or attached."""

from __future__ import annotations

import base64
import html
import json
import os

from orchestrator.report.goodput import BUCKETS, FAULT_KINDS, Ledger, per_kind_counts
from orchestrator.report.sources import HEADERS, source_rows

LABELS = {"useful": "useful step time", "startup": "start-up", "checkpoint": "checkpoint stall",
          "snapshot": "snapshot stall", "evaluation": "evaluation", "recovery": "recovery",
          "rerun": "re-run / lost steps", "overhead": "driver overhead between steps", "down": "down between runs"}


def table_rows(ledger: Ledger) -> list[tuple[str, str, str]]:
    """(what, seconds, share of the wall time) rows: the buckets, recovery by fault kind, the total."""
    wall = ledger.wall_s or 1e-9
    counts = per_kind_counts(ledger)
    rows = []
    for bucket in BUCKETS:
        seconds = ledger.seconds[bucket]
        rows.append((LABELS[bucket], f"{seconds:.2f}", f"{seconds / wall:.1%}"))
        if bucket == "recovery":
            for kind in FAULT_KINDS:
                if counts.get(kind):
                    s = ledger.recovery_by_kind[kind]
                    rows.append((f"  {kind} ({counts[kind]}x)", f"{s:.2f}", f"{s / wall:.1%}"))
    rows.append(("total (wall time)", f"{sum(ledger.seconds.values()):.2f}", f"{ledger.wall_s:.2f} s"))
    return rows


def facts(ledger: Ledger) -> list[tuple[str, str]]:
    return [("goodput", f"{ledger.goodput:.1%}"), ("steps trained", str(ledger.steps_final)),
            ("steps re-run", str(ledger.steps_rerun)), ("bad steps", str(ledger.bad_steps)),
            ("restarts (failures)", str(ledger.restarts)), ("generations", str(ledger.generations)),
            ("processes", str(ledger.sessions)), ("finished", "yes" if ledger.finished else "no (still going?)")]


def render_table(ledger: Ledger, source: str):
    from rich.table import Table

    table = Table(title=f"goodput of {source}")
    table.add_column("where the wall time went")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for what, seconds, share in table_rows(ledger):
        table.add_row(what, seconds, share, style="bold" if what.startswith(("useful", "total")) else None)
    table.add_section()
    for what, value in facts(ledger):
        table.add_row(what, value, "")
    return table


def write_json(ledger: Ledger, source: str, figures: dict[str, str], out_dir: str, sources: list[dict] = ()) -> str:
    """``sources``: data.mix's per-source counters at the last step (orchestrator/report/sources.py)."""
    path = os.path.join(out_dir, "report.json")
    doc = {"metrics": source, **ledger.as_dict(), "figures": {k: os.path.basename(v) for k, v in figures.items()}}
    if sources:
        doc["sources"] = list(sources)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=2)
    return path


def write_html(ledger: Ledger, source: str, figures: dict[str, str], out_dir: str, sources: list[dict] = ()) -> str:
    rows = "".join(f"<tr><td>{html.escape(a)}</td><td>{b}</td><td>{c}</td></tr>" for a, b, c in table_rows(ledger))
    rows += "".join(f"<tr><td>{html.escape(a)}</td><td>{html.escape(b)}</td><td></td></tr>" for a, b in facts(ledger))
    mix = ""
    if sources:
        cells = ["".join(f"<td>{html.escape(c)}</td>" for c in row) for row in source_rows(sources)]
        mix = ("<h2>data mixture (as of the last step)</h2><table><tr>" + "".join(f"<th>{h}</th>" for h in HEADERS)
               + "</tr>" + "".join(f"<tr>{c}</tr>" for c in cells) + "</table>")
    images = []
    for name, path in figures.items():
        with open(path, "rb") as fh:
            data = base64.b64encode(fh.read()).decode("ascii")
        images.append(f'<h2>{name}</h2><img alt="{name}" src="data:image/png;base64,{data}">')
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>elastimesh report: {html.escape(source)}"
            "</title><style>body{font-family:sans-serif;max-width:1040px;margin:auto}td{padding:2px 12px}"
            "td+td{text-align:right}img{max-width:100%}</style></head><body>"
            f"<h1>elastimesh report</h1><p>{html.escape(source)}</p><table>{rows}</table>{mix}"
            + "".join(images) + "</body></html>\n")
    path = os.path.join(out_dir, "report.html")
    with open(path, "w") as fh:
        fh.write(page)
    return path
