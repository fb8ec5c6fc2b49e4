"""Reading a metrics JSONL for the report: a local path or an fsspec URI (``s3://bucket/run/m.jsonl``).

A run still going is read as far as it has written: every complete line; a last line without its
newline (being written right now) is left out. A missing or unreadable file, or one with no record,
is bad input (``UserInputError``: one line, exit 2).
"""

from __future__ import annotations

import json

from orchestrator.errors import UserInputError


def read_records(uri: str) -> list[dict]:
    """Every complete JSON object line of ``uri``, in file order."""
    import fsspec

    try:
        with fsspec.open(uri, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise UserInputError(f"{uri}: no such metrics file: give the JSONL a run wrote (its metrics.path)") from None
    except ImportError as exc:  # e.g. s3:// without s3fs
        raise UserInputError(f"{uri}: cannot open it ({exc}): pip install 'elastimesh[cloud]'") from None
    except (OSError, ValueError) as exc:
        raise UserInputError(f"{uri}: cannot read the metrics file ({type(exc).__name__}: {exc})") from None
    text = raw.decode("utf-8", errors="replace")
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]  # still being written
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise UserInputError(f"{uri}: line {number} is not JSON: is this a metrics.jsonl of elastimesh?") from None
        if isinstance(rec, dict):
            records.append(rec)
    if not records:
        raise UserInputError(f"{uri}: no records yet: the run has not written its first line")
    return records
