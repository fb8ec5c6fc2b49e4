"""The report's data mixture table: per ``data.mix`` source, the samples and tokens trained and the
pass (epoch, from 0) it is in, as of the run's last step (step records' ``sources``, README "Metrics").
Empty for a run on one ``data.path``. Pure: no matplotlib."""

from __future__ import annotations

from orchestrator.report.goodput import is_step


def last_sources(records: list[dict]) -> list[dict]:
    """The ``sources`` of the newest step's last record (a re-run step is logged again), or []."""
    newest: dict | None = None
    for rec in records:
        if is_step(rec) and rec.get("sources") and (newest is None or rec["step"] >= newest["step"]):
            newest = rec
    return list(newest["sources"]) if newest else []


def source_rows(sources: list[dict]) -> list[tuple[str, str, str, str, str, str]]:
    """(source, weight, share of the samples, samples, tokens, epoch) per source."""
    total = sum(s["samples"] for s in sources) or 1
    return [(s["path"], f"{s['weight']:g}", f"{s['samples'] / total:.1%}", f"{s['samples']:,}",
             f"{s['tokens']:,}", str(s["epoch"])) for s in sources]


HEADERS = ("data.mix source", "weight", "share", "samples", "tokens", "epoch")


def render_sources(sources: list[dict]):
    from rich.table import Table

    table = Table(title="data mixture (as of the last step)")
    for i, header in enumerate(HEADERS):
        table.add_column(header, justify="left" if i == 0 else "right")
    for row in source_rows(sources):
        table.add_row(*row)
    return table
