"""The sample index of a shard directory, built from row-group token counts, never from the tokens.

A shard directory is ``*.parquet`` files (sorted by name; names starting with ``.`` or ``_`` are
skipped, as Spark/Arrow writers use them for temporaries) with a column ``tokens: list<int32>``, plus
an optional sidecar ``elastimesh-data.json`` written last by ``elastimesh data prepare``. The token
stream is the rows concatenated in that order, so all a reader needs to find token ``t`` is how many
tokens each row group holds. They come from, in order of preference:

1. the sidecar's ``shards[name].row_group_tokens`` (one small JSON read for the whole directory);
2. each file's Parquet footer: for the leaf column ``tokens.list.element`` a row group's
   ``num_values - null_count`` is exactly its token count (an empty or null row counts as one null
   level, a token as one value), and ``statistics.max`` gives the largest id for free;
3. only when a writer stored no statistics: one streaming pass over that row group's column.

The content identity (:func:`content_identity`) is what a checkpoint remembers about its data: a hash of
the sidecar (which holds each shard's sha256) or, for third-party shards, of names, counts and each
file's head and tail. Moving or copying the directory keeps it; different data changes it.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from meshdata.errors import DataError, one_line
from meshdata.storage import Location

SIDECAR = "elastimesh-data.json"
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2, 3)  # 1: byte shards of elastimesh <= 0.1 (no per-shard index, no tokenizer dict);
# 3: chat shards (data prepare --chat: one conversation per row, a loss_mask column; meshdata.chat_source)
_FIX_PATH = 'set data.path to "builtin" or to a directory made by `elastimesh data prepare INPUT... --out DIR`'
_FIX_COPY = "copy the whole directory again or re-run `elastimesh data prepare`"


@dataclass(frozen=True)
class DataIndex:
    name: str  # absolute path or URI
    files: tuple[str, ...]  # shard base names, in stream order
    rg_file: np.ndarray  # int32 per row group (stream order): index into files
    rg_index: np.ndarray  # int32 per row group: its number inside the file
    rg_tokens: np.ndarray  # int64 per row group: its token count
    meta: dict = field(default_factory=dict)  # the sidecar, {} when there is none
    max_token_id: int | None = None  # from footer statistics when there is no sidecar
    identity: str = ""

    @property
    def num_tokens(self) -> int:
        return int(self.rg_tokens.sum())


def shard_names(listing: dict[str, int]) -> list[str]:
    return sorted(f for f in listing if f.endswith(".parquet") and not f.startswith((".", "_")))


def read_sidecar(loc: Location, listing: dict[str, int]) -> dict:
    if SIDECAR not in listing:
        return {}
    try:
        meta = json.loads(loc.read_bytes(SIDECAR))
        fmt = meta["format"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"data.path = {loc.name!r}: unreadable {SIDECAR} ({one_line(e)}); delete it or "
                        "re-run `elastimesh data prepare`") from None
    if fmt not in READABLE_FORMATS:
        raise DataError(f"data.path = {loc.name!r}: {SIDECAR} has format {fmt!r}, this elastimesh reads "
                        f"formats {list(READABLE_FORMATS)}; re-run `elastimesh data prepare` with this version")
    return meta


def build_index(loc: Location, *, check_files: bool = False) -> DataIndex:
    """Index ``loc``. ``check_files`` also opens every footer (the driver does, once, before a run)."""
    kind = loc.kind()
    if kind == "missing":
        where = "" if loc.is_local else " (check the bucket and the path)"
        raise DataError(f"data.path = {loc.name!r} does not exist{where}; {_FIX_PATH}")
    if kind == "file":
        raise DataError(f"data.path = {loc.name!r} is a file, not a directory of Parquet shards; {_FIX_PATH}")
    listing = loc.files()
    files = shard_names(listing)
    meta = read_sidecar(loc, listing)
    listed = meta.get("files")
    if listed is not None:
        missing = [f for f in listed if f not in listing]
        if missing:
            raise DataError(f"data.path = {loc.name!r} is missing shard {missing[0]!r} listed in {SIDECAR}; "
                            + _FIX_COPY)
        extra = [f for f in files if f not in listed]
        if extra:
            raise DataError(f"data.path = {loc.name!r} holds shard {extra[0]!r} that {SIDECAR} does not list; "
                            f"move it elsewhere or {_FIX_COPY}")
    if not files:
        raise DataError(f"data.path = {loc.name!r} contains no *.parquet files; {_FIX_PATH}")
    shards = meta.get("shards") or {}
    for f in files:
        want = (shards.get(f) or {}).get("bytes")
        if want is not None and int(want) != listing[f]:
            raise DataError(f"data.path shard {loc.uri(f)!r} has {listing[f]} bytes but {SIDECAR} says "
                            f"{want} (a partial copy?); " + _FIX_COPY)

    need_footer = [f for f in files if check_files or "row_group_tokens" not in (shards.get(f) or {})]
    footers = _map(lambda f: _footer_counts(loc, f), need_footer, remote=not loc.is_local)
    per_file: list[list[int]] = []
    tops: list[int | None] = []
    for f in files:
        if f in footers and "row_group_tokens" not in (shards.get(f) or {}):
            counts, top = footers[f]
        else:
            counts, top = [int(c) for c in shards[f]["row_group_tokens"]], None
            if f in footers and footers[f][0] != counts:
                raise DataError(f"data.path shard {loc.uri(f)!r} does not match {SIDECAR} (row-group token "
                                f"counts differ); " + _FIX_COPY)
        per_file.append(counts)
        tops.append(top)
    rg_file = np.concatenate([np.full(len(c), i, np.int32) for i, c in enumerate(per_file)])
    rg_index = np.concatenate([np.arange(len(c), dtype=np.int32) for c in per_file])
    rg_tokens = np.concatenate([np.asarray(c, np.int64) for c in per_file])
    expected = meta.get("num_tokens")
    if expected is not None and int(expected) != int(rg_tokens.sum()):
        raise DataError(f"data.path = {loc.name!r}: {SIDECAR} says {expected} tokens but the shards hold "
                        f"{int(rg_tokens.sum())}; " + _FIX_COPY)
    max_id = None if meta or any(t is None for t in tops) else max(tops, default=None)
    identity = _identity(meta, files, listing, per_file)
    return DataIndex(loc.name, tuple(files), rg_file, rg_index, rg_tokens, meta, max_id, identity)


def _map(fn, items: list[str], *, remote: bool) -> dict:
    if not items:
        return {}
    if not remote or len(items) == 1:
        return {f: fn(f) for f in items}
    with ThreadPoolExecutor(max_workers=min(16, len(items))) as pool:  # footers are latency-bound
        return dict(zip(items, pool.map(fn, items)))


def _identity(meta: dict, files: list[str], listing: dict[str, int], counts: list[list[int]]) -> str:
    """The sidecar's hash when there is one (format 2 names every shard's sha256); "" otherwise
    (computed on demand by :func:`content_identity`: only the driver needs it)."""
    if not meta:
        return ""
    view = {"sidecar": meta, "sizes": [listing[f] for f in files] if meta.get("format") == 1 else None}
    return _sha(view)


def content_identity(loc: Location, index: DataIndex) -> str:
    """Identity of third-party shards: names, sizes, row-group counts and each file's first and last
    MiB (which hold its footer: page offsets and statistics). Hashing every byte of a corpus on each
    run would cost more than the run's start; ``data prepare`` records real sha256s instead."""
    if index.identity:
        return index.identity
    edge = 2**20

    def digest(name: str) -> str:
        h = hashlib.sha256()
        if loc.is_local:
            with open(loc.join(name), "rb") as f:
                h.update(f.read(edge))
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(edge, size - edge))
                h.update(f.read(edge))
        else:
            size = loc.fs.size(loc.join(name))
            h.update(loc.fs.cat_file(loc.join(name), 0, min(edge, size)))
            if size > edge:
                h.update(loc.fs.cat_file(loc.join(name), max(edge, size - edge), size))
        return h.hexdigest()

    digests = _map(digest, list(index.files), remote=not loc.is_local)
    return _sha({"files": index.files, "row_group_tokens": index.rg_tokens.tolist(),
                 "file_of_row_group": index.rg_file.tolist(), "digests": [digests[f] for f in index.files]})


def _sha(view) -> str:
    return hashlib.sha256(json.dumps(view, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def tokens_leaf(schema, where: str) -> int:
    """Column index of the ``tokens`` list's leaf in a Parquet schema; DataError when it is not list<int>."""
    import pyarrow as pa

    arrow = schema.to_arrow_schema()
    if "tokens" not in arrow.names:
        raise DataError(f"{where} has no 'tokens' column (columns: {arrow.names}); shards need one "
                        "column `tokens: list<int32>`, e.g. from `elastimesh data prepare`")
    t = arrow.field("tokens").type
    if not ((pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)):
        raise DataError(f"{where}: column 'tokens' has type {t}, expected list<int32>; rewrite the "
                        "shard with `elastimesh data prepare`")
    for i in range(len(schema)):
        if schema.column(i).path.split(".")[0] == "tokens":
            return i
    raise AssertionError("tokens leaf not found")  # pragma: no cover - arrow found the field above


def _footer_counts(loc: Location, name: str) -> tuple[list[int], int | None]:
    """Row-group token counts and the largest id (None if unknown) of one shard, from its footer."""
    import pyarrow as pa

    where = f"data.path shard {loc.uri(name)!r}"
    try:
        pf = loc.open_parquet(name)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{where} is not a readable Parquet file ({one_line(e)}); delete or "
                        "regenerate it with `elastimesh data prepare`") from None
    leaf = tokens_leaf(pf.schema, where)
    md = pf.metadata
    counts: list[int] = []
    top: int | None = -1
    for rg in range(md.num_row_groups):
        col = md.row_group(rg).column(leaf)
        stats = col.statistics
        if stats is not None and stats.has_null_count:
            counts.append(int(col.num_values - stats.null_count))
            if stats.has_min_max and top is not None:
                top = max(top, int(stats.max))
            elif col.num_values - stats.null_count > 0:
                top = None
            continue
        # No statistics: count (and take the max of) this row group's tokens, one row group in memory.
        values = read_row_group(pf, rg, where)
        counts.append(len(values))
        if top is not None and len(values):
            top = max(top, int(values.max()))
    return counts, (None if top is None else max(top, -1))


def read_row_group(pf, rg: int, where: str) -> np.ndarray:
    """One row group's tokens, flattened in row order, as int32. Null rows are empty; null ids an error."""
    import pyarrow as pa

    try:
        col = pf.read_row_group(rg, columns=["tokens"]).column("tokens")
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{where} is corrupt ({one_line(e)}); delete or regenerate it") from None
    # flatten() honours list offsets and skips null rows; null *values* inside a row are an error.
    values = [c.flatten() for c in col.chunks]
    if any(v.null_count for v in values):
        raise DataError(f"{where} has null token ids; rewrite it without nulls")
    if not values:
        return np.zeros(0, np.int32)
    # One chunk (the usual case): a zero-copy view of Arrow's buffer, no second copy of the tokens.
    parts = [v.to_numpy(zero_copy_only=False) for v in values]
    arr = parts[0] if len(parts) == 1 else np.concatenate(parts)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise DataError(f"{where} has token ids outside [0, 2^31); fix the tokenizer output")
    return arr.astype(np.int32, copy=False)
