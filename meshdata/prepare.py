"""``elastimesh data prepare INPUT... [--tokenizer TOK] --out DIR``: text -> Parquet token shards.

Each document becomes one row ``tokens: list<int32>`` (``meshdata.tokenizer`` says what a row
holds; the byte tokenizer splits a document into rows of at most ``MAX_ROW_TOKENS``, which changes
nothing in the concatenated stream). The input is cut into units (``meshdata.inputs``); each unit
is tokenized by one task — a Ray task when the caller hands a fan-out (the CLI does:
``orchestrator.cluster.prepare_tasks``; the local Ray by default, the cluster at ``RAY_ADDRESS`` when
set), else in this process — which returns finished Parquet files as bytes, so
``--out`` only needs to be writable here, not on the cluster's nodes. Shards are written in input
order as ``shard-00000.parquet``, ... of at most ``shard_tokens`` tokens (a longer single document
gets a shard of its own), in row groups of about ``ROW_GROUP_TOKENS`` (the unit a trainer reads).

``--out`` must be empty or absent, so nothing good is overwritten. The sidecar (``elastimesh-data.json``,
format 2: tokenizer hash/vocab/BOS/EOS, documents, tokens, each shard's row-group token counts, bytes
and sha256) is written last, atomically: its presence marks a finished directory. The tokenizer files
are copied beside the shards, so an export can ship them with the model. On failure the files written
so far are removed again.

``--chat`` (``chat=True``) reads conversations instead of text and writes a ``loss_mask`` column
beside ``tokens``, one conversation per row (``meshdata.conversations``, ``meshdata.chat``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Protocol
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshdata.errors import DataError
from meshdata.index import FORMAT_VERSION, SIDECAR
from meshdata.conversations import chat_sidecar, check_conversations, tokenize_conversations
from meshdata.inputs import KEY, UNIT_BYTES, Unit, check_chat_inputs, expand_inputs, plan_units, read_documents
from meshdata.tokenizer import TokenizerSpec, encode_rows, load_spec

MAX_ROW_TOKENS = 65536  # byte tokenizer only: keeps a row (and a Parquet page) small for huge files
ROW_GROUP_TOKENS = 65536  # what a trainer fetches to read one window: small keeps random reads cheap
SHARD_TOKENS = 8_000_000
BATCH_CHARS = 1 << 20  # texts handed to the tokenizer per batch call


class FanOut(Protocol):
    """Runs ``tokenize_unit`` over units somewhere else (e.g. as Ray tasks) and yields
    (unit index, result) as they finish; ``workers()`` is how many run at once."""

    def workers(self) -> int: ...
    def __call__(self, units: list[Unit], job: Job) -> Iterator[tuple[int, UnitResult]]: ...


@dataclass(frozen=True)
class Job:
    tokenizer: TokenizerSpec  # with ``chat`` set: conversations (meshdata.chat), else text documents
    text_key: str = "text"
    text_column: str = "text"
    encoding: str = "utf-8"
    shard_tokens: int = SHARD_TOKENS
    seq_len: int | None = None  # --chat: a conversation of more than seq_len + 1 tokens is refused


@dataclass
class UnitResult:
    shards: list[tuple[bytes, dict]] = field(default_factory=list)  # (Parquet file, its sidecar entry)
    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    counted: int = 0  # --chat: tokens with loss mask 1
    longest: int = 0  # --chat: the longest conversation's tokens
    too_long: int = 0  # --chat: conversations refused for --seq-len
    too_long_at: list[str] = field(default_factory=list)  # "where (n tokens)" of the first few


def tokenize_unit(unit: Unit, job: Job) -> UnitResult:
    """One unit -> finished shard files (bytes). Runs in a Ray task or in this process."""
    result = UnitResult(text_bytes=unit.size)
    builder = _ShardBuilder(job.shard_tokens, result)
    if job.tokenizer.chat is not None:
        tokenize_conversations(unit, job, builder)
        builder.finish()
        return result
    for texts in _batches(read_documents(unit, job.text_key, job.text_column, job.encoding)):
        values, lengths = encode_rows(job.tokenizer, texts)
        if job.tokenizer.kind == "bytes" and len(lengths) and lengths.max() > MAX_ROW_TOKENS:
            lengths = np.asarray([piece for n in lengths.tolist() for piece in _pieces(n)], np.int64)
        result.documents += len(texts)
        builder.add(values, lengths)
    builder.finish()
    return result


def _pieces(n: int) -> list[int]:
    return [MAX_ROW_TOKENS] * (n // MAX_ROW_TOKENS) + ([n % MAX_ROW_TOKENS] if n % MAX_ROW_TOKENS else [])


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for text in docs:
        if not text:
            continue  # an empty document has no tokens and gets no row
        batch.append(text)
        chars += len(text)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


class _ShardBuilder:
    """Rows -> row groups of <= ROW_GROUP_TOKENS -> in-memory Parquet files of <= shard_tokens tokens
    (a single longer row gets a row group, or a shard, of its own). Rows added with a mask get a
    ``loss_mask: list<int8>`` column beside ``tokens`` (``--chat``)."""

    def __init__(self, shard_tokens: int, result: UnitResult) -> None:
        self.shard_tokens = shard_tokens
        self.result = result
        self.values: list[np.ndarray] = []  # pending rows of the open row group (flat) and their lengths
        self.lengths: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []  # their loss masks (flat), when rows come with one
        self.row_tokens = 0
        self.groups: list = []  # finished row groups of the open shard (pyarrow tables)
        self.group_tokens: list[int] = []
        self.group_rows: list[int] = []
        self.open_tokens = 0  # tokens in the open shard (closed row groups + pending rows)

    def add(self, values: np.ndarray, lengths: np.ndarray, masks: np.ndarray | None = None) -> None:
        """Append rows given flat (``values``, ``lengths``; ``masks`` beside ``values``), closing row
        groups and shards as they fill."""
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        i, n = 0, len(lengths)
        while i < n:
            room = min(ROW_GROUP_TOKENS - self.row_tokens, self.shard_tokens - self.open_tokens)
            j = int(np.searchsorted(offsets, offsets[i] + room, side="right")) - 1  # rows i..j-1 fit
            if j <= i:
                if self.open_tokens and self.open_tokens + lengths[i] > self.shard_tokens:
                    self._close_group()
                    self._close_shard()
                    continue
                if self.row_tokens and self.row_tokens + lengths[i] > ROW_GROUP_TOKENS:
                    self._close_group()
                    continue
                j = i + 1  # one row larger than a row group (or a shard): it goes alone
            taken = int(offsets[j] - offsets[i])
            self.values.append(values[offsets[i] : offsets[j]])
            if masks is not None:
                self.masks.append(masks[offsets[i] : offsets[j]])
            self.lengths.append(lengths[i:j])
            self.row_tokens += taken
            self.open_tokens += taken
            self.result.tokens += taken
            i = j

    def finish(self) -> None:
        self._close_group()
        self._close_shard()

    def _close_group(self) -> None:
        import pyarrow as pa

        if not self.lengths:
            return
        lengths = np.concatenate(self.lengths)
        values = np.concatenate(self.values).astype(np.int32, copy=False)
        offsets = np.zeros(len(lengths) + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        columns = {"tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.int32()))}
        if self.masks:
            masks = np.concatenate(self.masks).astype(np.int8, copy=False)
            columns["loss_mask"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(masks, type=pa.int8()))
        self.groups.append(pa.table(columns))
        self.group_tokens.append(int(offsets[-1]))
        self.group_rows.append(len(lengths))
        self.values, self.lengths, self.masks, self.row_tokens = [], [], [], 0

    def _close_shard(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self.groups:
            return
        sink = pa.BufferOutputStream()
        # No dictionary: token ids are high-cardinality; the encoder would build and drop one per page.
        with pq.ParquetWriter(sink, self.groups[0].schema, use_dictionary=False, compression="snappy") as w:
            for t in self.groups:
                w.write_table(t, row_group_size=max(1, t.num_rows))
        data = sink.getvalue().to_pybytes()
        info = {"bytes": len(data), "rows": sum(t.num_rows for t in self.groups),
                "row_group_tokens": list(self.group_tokens), "sha256": hashlib.sha256(data).hexdigest()}
        if "loss_mask" in self.groups[0].column_names:  # a conversation is a sample: find its row group
            info["row_group_rows"] = list(self.group_rows)
        self.result.shards.append((data, info))
        self.groups, self.group_tokens, self.group_rows, self.open_tokens = [], [], [], 0


# -- the driver side ------------------------------------------------------------------------------


def prepare(inputs: list[str], out_dir: str, *, tokenizer: str | None = None, text_key: str = "text",
            text_column: str = "text", encoding: str = "utf-8", shard_tokens: int = SHARD_TOKENS,
            parallel: bool | None = None, progress: bool = False, unit_bytes: int | None = None,
            fan_out: FanOut | None = None, chat: bool = False, seq_len: int | None = None) -> dict:
    """Tokenize ``inputs`` into shards under ``out_dir``; returns the sidecar dict.

    ``chat``: the inputs are conversations, rendered with the tokenizer's chat template, one per row
    with its loss mask (``meshdata.conversations``); ``seq_len``: refuse conversations that do not fit.

    ``fan_out`` runs units as tasks elsewhere (the CLI passes ``orchestrator.cluster.prepare_tasks.
    RayFanOut``: this package never imports Ray). ``parallel``: True = through ``fan_out``, False =
    this process, None = through ``fan_out`` when there is more than one unit.
    """
    out = _checked_out(out_dir, shard_tokens, seq_len)
    files = expand_inputs(list(inputs))
    if chat:
        check_chat_inputs(files)
    spec = load_spec(tokenizer, chat=chat)
    job = Job(spec, text_key, text_column, encoding, shard_tokens, seq_len if chat else None)
    if unit_bytes is None:  # ~4 units per worker for balance, each within [1 MB, UNIT_BYTES]
        total = sum(os.path.getsize(f) for f in files)
        workers = fan_out.workers() if fan_out is not None else (os.cpu_count() or 1)
        unit_bytes = int(min(UNIT_BYTES, max(2**20, total / (4 * workers))))
    units = plan_units(files, text_column, unit_bytes)
    if not units or all(u.size == 0 for u in units):
        raise DataError("data prepare: every input file is empty; pass files with text", key=KEY)
    use_fan_out = len(units) > 1 if parallel is None else parallel
    if use_fan_out and fan_out is None:
        if parallel:
            raise ValueError("prepare(parallel=True) needs a fan_out to run the units on")
        use_fan_out = False

    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        meta = _run(units, job, out, written, fan_out if use_fan_out else None, progress)
        if chat:
            check_conversations(meta, seq_len)
        if meta["num_tokens"] == 0:
            raise DataError("data prepare: the inputs hold no text (every document is empty); pass files "
                            "with text", key=KEY)
        for f in spec.files:
            target = out / os.path.basename(f)
            shutil.copyfile(f, target)
            written.append(target)
        tmp = out / (SIDECAR + ".tmp")
        written.append(tmp)
        tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, out / SIDECAR)
    except BaseException:
        for p in written:
            p.unlink(missing_ok=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    from meshdata.source import clear_cache

    clear_cache()  # a cached open of this directory (e.g. a failed one) must not hide the new shards
    return meta


def _checked_out(out_dir: str, shard_tokens: int, seq_len: int | None) -> Path:
    """``--out`` as a path, after the checks that need no input read: it is absent or an empty
    directory (nothing good is overwritten), and the sizes are positive."""
    if shard_tokens < 1:
        raise DataError(f"data prepare: --shard-tokens {shard_tokens} must be >= 1", key=KEY)
    if seq_len is not None and seq_len < 1:
        raise DataError(f"data prepare: --seq-len {seq_len} must be >= 1", key=KEY)
    out = Path(os.path.expanduser(out_dir))
    if out.exists() and not out.is_dir():
        raise DataError(f"data prepare: --out {str(out)!r} is a file; choose an empty --out directory", key=KEY)
    if out.is_dir() and any(out.iterdir()):
        raise DataError(f"data prepare: --out {str(out)!r} is not empty (it already contains shards or other "
                        "files); choose an empty --out directory (or delete its contents)", key=KEY)
    return out


def _run(units: list[Unit], job: Job, out: Path, written: list[Path], fan_out: FanOut | None,
         progress: bool) -> dict:
    files: list[str] = []
    shards: dict[str, dict] = {}
    totals = {"documents": 0, "tokens": 0, "counted": 0, "longest": 0, "too_long": 0, "too_long_at": []}
    bar = _Progress(sum(u.size for u in units), progress)
    try:
        results = fan_out(units, job) if fan_out is not None else ((i, tokenize_unit(u, job)) for i, u in enumerate(units))
        pending: dict[int, UnitResult] = {}
        next_unit = 0
        for i, res in results:
            pending[i] = res
            bar.advance(res)
            while next_unit in pending:  # write in input order: the stream order is the file order
                done = pending.pop(next_unit)
                next_unit += 1
                totals["documents"] += done.documents
                totals["tokens"] += done.tokens
                totals["counted"] += done.counted
                totals["longest"] = max(totals["longest"], done.longest)
                totals["too_long"] += done.too_long
                totals["too_long_at"] += done.too_long_at
                for data, info in done.shards:
                    name = f"shard-{len(files):05d}.parquet"
                    path = out / name
                    written.append(path)
                    path.write_bytes(data)
                    files.append(name)
                    shards[name] = info
    finally:
        bar.close()
    spec = job.tokenizer
    meta = {"format": FORMAT_VERSION, "tokenizer": spec.sidecar(), "vocab_size": spec.vocab_size,
            "documents": totals["documents"], "num_tokens": totals["tokens"], "files": files, "shards": shards}
    if spec.chat is not None:
        meta.update(chat_sidecar(spec.chat, totals))
    return meta


class _Progress:
    """A rich progress bar over input bytes: documents, tokens/s and ETA (nothing when off)."""

    def __init__(self, total_bytes: int, on: bool) -> None:
        self.t0 = time.perf_counter()
        self.docs = self.tokens = 0
        self.bar: Callable | None = None
        if not on:
            return
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("[bold]prepare"), BarColumn(), TextColumn("{task.fields[info]}"),
                                 TimeRemainingColumn(), transient=False)
        self.task = self.progress.add_task("prepare", total=max(1, total_bytes), info="")
        self.progress.start()
        self.bar = self.progress.update

    def advance(self, res: UnitResult) -> None:
        self.docs += res.documents
        self.tokens += res.tokens
        if self.bar is not None:
            rate = self.tokens / max(1e-9, time.perf_counter() - self.t0)
            self.bar(self.task, advance=res.text_bytes,
                     info=f"{self.docs:,} documents  {self.tokens:,} tokens  {rate:,.0f} tokens/s")

    def close(self) -> None:
        if self.bar is not None:
            self.progress.stop()
