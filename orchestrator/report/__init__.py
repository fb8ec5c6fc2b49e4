"""`elastimesh report METRICS.jsonl [--out DIR]`: a run's goodput and pictures from its metrics.

``read``: the JSONL from a path or an fsspec URI (``s3://``...), a run still going included;
``goodput``: the wall-time accounting (pure); ``plots``: the matplotlib figures; ``page``: the rich
table, ``report.json`` and the self-contained HTML page; ``command``: the CLI entry.
"""
