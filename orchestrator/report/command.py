"""`elastimesh report METRICS.jsonl [--out DIR]`: print the goodput table, write report.json, the
figures and report.html to DIR (default: ``report/``). Bad input (a missing metrics file, no
matplotlib) is one line and exit 2, before anything is written."""

from __future__ import annotations

import os
import sys

from orchestrator.errors import UserInputError


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserInputError("elastimesh report draws with matplotlib: pip install 'elastimesh[report]'") from None


def report_command(args) -> int:
    import logging

    from rich.console import Console

    from orchestrator.report.goodput import account
    from orchestrator.report.page import render_table, write_html, write_json
    from orchestrator.report.plots import write_figures
    from orchestrator.report.read import read_records
    from orchestrator.report.sources import last_sources, render_sources

    # The report logs nothing itself; keep the libraries' INFO lines (fsspec, botocore, matplotlib's
    # font cache) off stderr, which holds the error line only.
    logging.getLogger().setLevel(logging.WARNING)
    require_matplotlib()
    records = read_records(args.metrics)
    out = args.out or "report"
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise UserInputError(f"--out {out}: cannot create it ({exc.strerror or exc}): give a writable directory") from None
    ledger = account(records)
    sources = last_sources(records)  # data.mix: per-source counters of the last step
    figures = write_figures(records, ledger, out)
    write_json(ledger, args.metrics, figures, out, sources)
    page = write_html(ledger, args.metrics, figures, out, sources)
    Console().print(render_table(ledger, args.metrics))
    if sources:
        Console().print(render_sources(sources))
    sys.stdout.write(f"report: {page} ({len(figures)} figures, report.json) in {out}\n")
    return 0
