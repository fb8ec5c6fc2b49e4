"""What ``elastimesh data prepare`` reads: text inputs, split into units of work, read as documents.

Inputs are ``.txt`` files (one document each), JSON lines (``.jsonl``/``.json``; one object per line,
the text under ``--text-key``; a ``.json`` file holding one array of objects works too) and Parquet
files (the text in ``--text-column``), given as files, directories (searched recursively for those
extensions) or glob patterns; with ``--chat``, JSON lines of ``{"messages": [...]}`` rows
(``read_rows``; ``meshdata.chat`` checks and renders them). The corpus is cut into *units* — groups
of small files, newline-aligned byte ranges of big JSON-lines files, row-group ranges of Parquet
files — in input order; each unit is
one task (``meshdata.prepare``) and its shards sort after the previous unit's, so the token stream
keeps the input order.

Every bad input is a DataError naming the file (and, for JSON, the line) and the fix.
"""

from __future__ import annotations

import functools
import glob
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from meshdata.errors import DataError, one_line

KEY = "data.prepare"
TEXT_EXT = (".txt",)
JSON_EXT = (".jsonl", ".json")
PARQUET_EXT = (".parquet",)
KNOWN_EXT = TEXT_EXT + JSON_EXT + PARQUET_EXT
UNIT_BYTES = 32 * 2**20  # text bytes per unit at most: bounds a task's memory and its shard output


@dataclass(frozen=True)
class Unit:
    """One task's share of the input: ``files`` whole, or one file's byte / row-group range."""

    files: tuple[str, ...]
    start: int = 0  # byte offset (JSON lines) or first row group (Parquet)
    stop: int = -1  # end byte / row group (exclusive); -1 = the whole file
    size: int = 0  # text bytes (for progress)


def expand_inputs(inputs: list[str]) -> list[str]:
    """Files in input order: each INPUT as given, a directory's files sorted, a glob's matches sorted."""
    if not inputs:
        raise DataError("data prepare needs at least one INPUT (text, JSON lines or Parquet file, "
                        "directory or glob)", key=KEY)
    out: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(item) for f in fs
                           if f.lower().endswith(KNOWN_EXT) and not f.startswith("."))
            if not found:
                raise DataError(f"data prepare: directory {item!r} holds no {', '.join(KNOWN_EXT)} files; "
                                "pass a directory with text inputs", key=KEY)
            out.extend(found)
        elif os.path.exists(item):
            out.append(item)
        elif any(c in item for c in "*?["):
            found = sorted(f for f in glob.glob(item, recursive=True) if os.path.isfile(f))
            if not found:
                raise DataError(f"data prepare: pattern {item!r} matches no file; fix the pattern", key=KEY)
            out.extend(found)
        else:
            raise DataError(f"data prepare: input {item!r} is not an existing file; pass text files that "
                            "exist", key=KEY)
    for f in out:
        if not f.lower().endswith(KNOWN_EXT):
            ext = os.path.splitext(f)[1] or "no extension"
            raise DataError(f"data prepare: input {f!r} has an unknown extension ({ext}); pass .txt (one "
                            "document per file), .jsonl/.json (JSON lines) or .parquet files", key=KEY)
        if not os.access(f, os.R_OK) or not os.path.isfile(f):
            raise DataError(f"data prepare: cannot read input {f!r} (permission denied or not a file); "
                            "fix its permissions or leave it out", key=KEY)
    return out


def plan_units(files: list[str], text_column: str, unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """Cut the input into units of at most ``unit_bytes`` text bytes (a bigger single row group or
    document stays whole), in input order."""
    units: list[Unit] = []
    batch: list[str] = []
    batch_size = 0

    def flush() -> None:
        nonlocal batch, batch_size
        if batch:
            units.append(Unit(tuple(batch), size=batch_size))
            batch, batch_size = [], 0

    for f in files:
        size = os.path.getsize(f)
        low = f.lower()
        if low.endswith(TEXT_EXT) or (low.endswith(JSON_EXT) and (size <= unit_bytes or _starts_array(f))):
            if batch_size + size > unit_bytes:
                flush()
            batch.append(f)
            batch_size += size
            continue
        flush()
        if low.endswith(JSON_EXT):
            for start in range(0, size, unit_bytes):  # newline-aligned when read (see _json_lines)
                units.append(Unit((f,), start, min(size, start + unit_bytes), min(unit_bytes, size - start)))
        else:
            units.extend(_parquet_units(f, text_column, unit_bytes))
    flush()
    return units


def _parquet_units(f: str, column: str, unit_bytes: int) -> list[Unit]:
    md = _parquet_file(f, column).metadata
    units, first, acc = [], 0, 0
    for rg in range(md.num_row_groups):
        acc += md.row_group(rg).total_byte_size
        if acc >= unit_bytes:
            units.append(Unit((f,), first, rg + 1, acc))
            first, acc = rg + 1, 0
    if first < md.num_row_groups or not units:
        units.append(Unit((f,), first, md.num_row_groups, acc))
    return units


def _parquet_file(f: str, column: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f, memory_map=True)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"data prepare: cannot read {f!r} as Parquet ({one_line(e)}); pass a valid "
                        "Parquet file", key=KEY) from None
    names = pf.schema_arrow.names
    if column not in names:
        raise DataError(f"data prepare: {f!r} has no column {column!r} (columns: {names}); pass "
                        "--text-column NAME", key=KEY)
    t = pf.schema_arrow.field(column).type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        raise DataError(f"data prepare: column {column!r} of {f!r} has type {t}, not text; pass "
                        "--text-column naming a string column", key=KEY)
    return pf


def read_documents(unit: Unit, text_key: str, text_column: str, encoding: str) -> Iterator[str]:
    """The unit's documents in order (empty documents included; the caller skips them)."""
    for f in unit.files:
        low = f.lower()
        if low.endswith(TEXT_EXT):
            yield _text_file(f, encoding)
        elif low.endswith(JSON_EXT):
            yield from _json_lines(f, unit.start, unit.stop, text_key, encoding)
        else:
            pf = _parquet_file(f, text_column)
            stop = pf.metadata.num_row_groups if unit.stop < 0 else unit.stop
            for rg in range(unit.start, stop):
                for text in pf.read_row_group(rg, columns=[text_column]).column(0).to_pylist():
                    if text is not None:
                        yield text


def read_rows(unit: Unit, encoding: str) -> Iterator[tuple[object, Callable[[], str]]]:
    """``--chat``: the unit's JSON objects in order (one conversation each), each with its ``where()``."""
    for f in unit.files:
        yield from json_objects(f, unit.start, unit.stop, encoding)


def check_chat_inputs(files: list[str]) -> None:
    """``--chat`` reads JSON lines (or a JSON array) of ``{"messages": [...]}`` only."""
    for f in files:
        if not f.lower().endswith(JSON_EXT):
            raise DataError(f"data prepare --chat: input {f!r} is not JSON lines; --chat reads .jsonl/.json files "
                            'of {"messages": [{"role": ..., "content": ...}, ...]} rows', key=KEY)


def _text_file(f: str, encoding: str) -> str:
    try:
        with open(f, "rb") as fh:  # bytes, not text mode: keep \r\n as written
            return fh.read().decode(encoding)
    except OSError as e:
        raise DataError(f"data prepare: cannot read {f!r} ({one_line(e)}); fix its permissions or leave "
                        "it out", key=KEY) from None
    except (UnicodeDecodeError, LookupError) as e:
        raise DataError(f"data prepare: cannot decode {f!r} as {encoding} ({one_line(e)}); pass the "
                        "file's real encoding with --encoding", key=KEY) from None


def _json_lines(f: str, start: int, stop: int, text_key: str, encoding: str) -> Iterator[str]:
    """Documents of the lines that *start* in ``[start, stop)`` (all lines when stop < 0)."""
    for obj, where in json_objects(f, start, stop, encoding):
        yield _text_of(obj, text_key, where)


def json_objects(f: str, start: int, stop: int, encoding: str) -> Iterator[tuple[object, Callable[[], str]]]:
    """(object, where) of the lines that *start* in ``[start, stop)`` (all lines when stop < 0);
    ``where()`` names the line ("file:line"), worked out only when called (it reads the file's prefix
    to count lines: the error path only).

    The range is read in one block and its lines parsed ``JSON_BATCH`` at a time as one JSON array
    (a third of the per-line cost); a batch that fails is parsed line by line to name the bad line.
    """
    try:
        fh = open(f, "rb")
    except OSError as e:
        raise DataError(f"data prepare: cannot read {f!r} ({one_line(e)}); fix its permissions or leave "
                        "it out", key=KEY) from None
    with fh:
        if start == 0 and stop < 0 and _is_json_array(fh):
            yield from _json_array(f, fh, encoding)
            return
        if start > 0:
            fh.seek(start - 1)
            fh.readline()  # the line holding byte start-1 belongs to the previous unit
        first = fh.tell()
        if 0 <= stop <= first:
            return
        block = fh.read(stop - first) if stop >= 0 else fh.read()
        if block and not block.endswith(b"\n"):
            block += fh.readline()  # the last line started before stop: it is ours, whole
    lines = block.split(b"\n")
    for lo in range(0, len(lines), JSON_BATCH):
        batch = [(lo + i, line) for i, line in enumerate(lines[lo : lo + JSON_BATCH]) if line.strip()]
        objs = _parse_batch([line for _, line in batch], encoding)
        if objs is None:  # something in this batch is bad: find it line by line
            objs = [_parse_line(f, first, lines, i, encoding) for i, _ in batch]
        for (i, _), obj in zip(batch, objs):
            yield obj, functools.partial(_where, f, first, lines, i)


JSON_BATCH = 2048


def _parse_batch(lines: list[bytes], encoding: str) -> list | None:
    try:
        objs = json.loads((b"[" + b",".join(lines) + b"]").decode(encoding))
    except (ValueError, UnicodeDecodeError, LookupError):
        return None
    # Lines that are not one value each could still join into a valid array: then count differs.
    return objs if len(objs) == len(lines) else None


def _where(f: str, first: int, lines: list[bytes], i: int) -> str:
    pos = first + sum(len(line) + 1 for line in lines[:i])
    return f"{f}:{_line_no(f, pos)}"


def _parse_line(f: str, first: int, lines: list[bytes], i: int, encoding: str):
    try:
        return json.loads(lines[i].decode(encoding))
    except (UnicodeDecodeError, LookupError) as e:
        raise DataError(f"data prepare: {_where(f, first, lines, i)}: cannot decode as {encoding} "
                        f"({one_line(e)}); pass the real encoding with --encoding", key=KEY) from None
    except ValueError as e:
        raise DataError(f"data prepare: {_where(f, first, lines, i)}: invalid JSON ({one_line(e)}); fix "
                        "or remove that line (JSON lines: one object per line)", key=KEY) from None


def _has_text(obj, key: str) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get(key), str)


def _text_of(obj, key: str, where: Callable[[], str]) -> str:
    if _has_text(obj, key):
        return obj[key]
    where = where()
    if not isinstance(obj, dict):
        raise DataError(f"data prepare: {where}: expected a JSON object with a {key!r} string, got "
                        f"{type(obj).__name__}; write one object per line", key=KEY)
    if key not in obj:
        raise DataError(f"data prepare: {where}: no key {key!r} (keys: {sorted(obj)[:8]}); pass "
                        "--text-key NAME", key=KEY)
    raise DataError(f"data prepare: {where}: {key!r} is {type(obj[key]).__name__}, not a string; pass "
                    "--text-key naming the text field", key=KEY)


def _starts_array(f: str) -> bool:
    with open(f, "rb") as fh:
        return _is_json_array(fh)


def _is_json_array(fh) -> bool:
    head = fh.read(64).lstrip()
    fh.seek(0)
    return head.startswith(b"[")


def _json_array(f: str, fh, encoding: str) -> Iterator[tuple[object, Callable[[], str]]]:
    try:
        items = json.loads(fh.read().decode(encoding))
    except (UnicodeDecodeError, ValueError) as e:
        line = f":{e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
        raise DataError(f"data prepare: {f}{line}: invalid JSON ({one_line(e)}); fix the file", key=KEY) from None
    for i, obj in enumerate(items):
        yield obj, functools.partial(str.format, "{} item {}", f, i)


def _line_no(f: str, pos: int) -> int:
    """1-based line number of the line starting at byte ``pos`` (error path only: reads the prefix)."""
    count = 1
    with open(f, "rb") as fh:
        remaining = pos
        while remaining > 0:
            block = fh.read(min(remaining, 2**22))
            if not block:
                break
            count += block.count(b"\n")
            remaining -= len(block)
    return count
