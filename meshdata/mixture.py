"""Mixtures (``data.mix``, ``eval.mix``): several token sources with weights, read as one sample space.

A :class:`Mixture` numbers its samples source after source: source ``j``'s sample ``i`` is id
``offsets[j] + i``. ``step_ids`` gives a training step's ids in the order ``meshdata.order`` lays
them out (each step holds every source in proportion to its weight, each source visited once per
pass in its own seeded order), ``eval_ids`` an eval batch's (each source read in file order), and
``windows`` reads them from their sources. A plain ``data.path`` is a mixture of one source whose
ids and order are exactly ``global_sample_ids``'s, so the rest of the code has one kind of data.

Whatever is read per sample goes through :meth:`Mixture.gather`: a function of (source, its local
ids) -> rows becomes a function of mixture ids (windows today; a per-token loss mask can go the same
way). Pure numpy, like the rest of ``meshdata``: the driver uses it for validation and counters.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence

import numpy as np

from meshdata.errors import DataError
from meshdata.order import chain_ids, global_sample_ids, mix_parts, mix_schedule, mixture_slots
from meshdata.source import TokenSource, microbatch_tokens, open_source, sample_windows, validate_source

# A mixture as the config and the ranks carry it: ((path or URI, weight), ...).
MixSpec = tuple[tuple[str, float], ...]


class Mixture:
    """Sources and weights over windows of ``seq_len``; built by :func:`open_mixture`."""

    def __init__(self, sources: Sequence[TokenSource], weights: Sequence[float], seq_len: int) -> None:
        self.sources = tuple(sources)
        self.weights = tuple(float(w) for w in weights)
        self.seq_len = int(seq_len)
        self.parts = mix_parts(self.weights)
        self.sizes = np.asarray([s.num_samples(self.seq_len) for s in self.sources], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)

    # -- what a source says about itself ---------------------------------------------------------
    @property
    def name(self) -> str:
        if len(self.sources) == 1:
            return self.sources[0].name
        return "mix(" + ", ".join(f"{s.name}: {w:g}" for s, w in zip(self.sources, self.weights)) + ")"

    @property
    def vocab_size(self) -> int:
        return max(s.vocab_size for s in self.sources)

    @property
    def eos_id(self) -> int | None:
        """The sources' common EOS id (None when any records none or they differ: see
        :func:`validate_mixture`, which refuses the latter when masks are on)."""
        ids = {s.eos_id for s in self.sources}
        return ids.pop() if len(ids) == 1 else None

    @property
    def identity(self) -> str:
        """What a checkpoint remembers: the one source's identity, or every source's and the weights."""
        if len(self.sources) == 1:
            return self.sources[0].identity
        view = [[s.identity for s in self.sources], list(self.parts)]
        return hashlib.sha256(json.dumps(view).encode()).hexdigest()

    def num_samples(self, seq_len: int | None = None) -> int:
        return int(self.sizes.sum())

    # -- which samples ------------------------------------------------------------------------------
    def seen(self, steps: int, global_batch_size: int) -> np.ndarray:
        """int64 per source: how many of its samples steps 1..``steps`` hold."""
        return mix_schedule(self.parts, global_batch_size).seen(steps)

    def step_ids(self, step: int, global_batch_size: int, seed: int) -> np.ndarray:
        """Ids of training step ``step`` (from 1), in the step's order; a function of (weights,
        sizes, G, seed, step) only, never of the mesh."""
        if len(self.sources) == 1:
            return global_sample_ids(step, global_batch_size, seed, int(self.sizes[0]))
        schedule = mix_schedule(self.parts, global_batch_size)
        before, counts = schedule.seen(step - 1), schedule.counts(step)
        return self._lay_out(counts, lambda j: chain_ids(int(before[j]), int(before[j] + counts[j]), seed,
                                                         int(self.sizes[j]), stream=j + 1))

    def eval_ids(self, batch: int, global_batch_size: int) -> np.ndarray:
        """Ids of held-out batch ``batch`` (from 0): the same slot layout, each source in file order."""
        if len(self.sources) == 1:
            return np.arange(batch * global_batch_size, (batch + 1) * global_batch_size, dtype=np.int64)
        schedule = mix_schedule(self.parts, global_batch_size)
        before, counts = schedule.seen(batch), schedule.counts(batch + 1)
        return self._lay_out(counts, lambda j: np.arange(before[j], before[j] + counts[j], dtype=np.int64))

    def _lay_out(self, counts: np.ndarray, local_ids: Callable[[int], np.ndarray]) -> np.ndarray:
        source, rank = mixture_slots(counts)
        ids = np.empty(len(source), np.int64)
        for j in range(len(self.sources)):
            here = source == j
            ids[here] = self.offsets[j] + local_ids(j)[rank[here]]
        return ids

    # -- reading them ------------------------------------------------------------------------------
    def source_of(self, ids: np.ndarray) -> np.ndarray:
        """The source index of each mixture id."""
        return np.searchsorted(self.offsets, np.asarray(ids, np.int64), side="right") - 1

    def gather(self, ids: np.ndarray, read: Callable[[TokenSource, np.ndarray], np.ndarray]) -> np.ndarray:
        """``read(source, local ids)`` for each source's share of ``ids``, rows back in ``ids``' order."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_samples()):
            raise IndexError(f"sample ids must lie in [0, {self.num_samples()}), got [{ids.min()}, {ids.max()}]")
        if not ids.size:
            return read(self.sources[0], ids)
        which = self.source_of(ids)
        parts = {j: read(self.sources[j], ids[which == j] - self.offsets[j]) for j in np.unique(which)}
        first = next(iter(parts.values()))
        out = np.empty((ids.size, *first.shape[1:]), first.dtype)
        for j, rows in parts.items():
            out[which == j] = rows
        return out

    @property
    def reader(self):
        """What reads this mixture's ids: its one source itself (ids are that source's own), else the
        mixture. Every per-source behaviour (chat shards' masked targets...) then applies unchanged."""
        return self.sources[0] if len(self.sources) == 1 else self

    @property
    def has_loss_mask(self) -> bool:
        """True when a source's targets come masked (chat shards): the step then counts its targets."""
        return any(getattr(s, "has_loss_mask", False) for s in self.sources)

    def microbatch(self, ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) as ``meshdata.source.microbatch_tokens`` reads each source (masked
        targets where the source masks them), rows in ``ids``' order."""
        pairs = self.gather(ids, lambda source, local: np.stack(microbatch_tokens(source, local, seq_len), axis=1))
        return np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])

    def windows(self, ids: np.ndarray, seq_len: int) -> np.ndarray:
        """int32 ``[len(ids), seq_len + 1]``: each id's window (``meshdata.source.sample_windows``)."""
        return self.gather(ids, lambda source, local: sample_windows(source, local, seq_len))


def open_mixture(spec: str | MixSpec, seq_len: int) -> Mixture:
    """``spec``: one path or URI (``data.path``), or ((path, weight), ...) (``data.mix``)."""
    if isinstance(spec, str):
        return Mixture((open_source(spec),), (1.0,), seq_len)
    return Mixture(tuple(open_source(path) for path, _ in spec), tuple(w for _, w in spec), seq_len)


def resolved(spec: MixSpec) -> MixSpec:
    """``spec`` with each path as its source names it (absolute, or the URI): valid on every node."""
    return tuple((open_source(path).name, weight) for path, weight in spec)


def validate_mixture(spec: MixSpec, seq_len: int, vocab_size: int, global_batch_size: int, *, key: str,
                     masks: bool | str, eval_batches: int = 0) -> Mixture:
    """Open every source of ``spec`` (checked as ``data.path`` is) and check it can feed this job.

    Each source needs as many samples as its share of one global batch (``eval_batches`` > 0: of
    that many held-out batches, read once each); with document masks on, the sources must agree on
    their EOS id. Raises :class:`DataError` naming ``key[i].path``.
    """
    for i, (path, _) in enumerate(spec):
        try:
            validate_source(path, seq_len, vocab_size, 1)
        except DataError as exc:
            # The source checks name data.path; here the one at fault is this entry of the mixture.
            at_fault = key if exc.key == "data.path" else exc.key
            raise DataError(str(exc).replace("data.path", f"{key}[{i}].path"), key=at_fault) from None
    mixture = open_mixture(spec, seq_len)
    schedule = mix_schedule(mixture.parts, global_batch_size)
    need = schedule.seen(eval_batches) if eval_batches else np.asarray(
        [-(-p * global_batch_size // sum(mixture.parts)) for p in mixture.parts])
    for i, (source, size) in enumerate(zip(mixture.sources, mixture.sizes)):
        if size < need[i]:
            what = f"{eval_batches} eval batches" if eval_batches else "one global batch"
            raise DataError(f"{key}[{i}].path = {source.name!r} has {size} samples of model.seq_len {seq_len}, fewer "
                            f"than its share of {what} ({need[i]}); add data, or lower its weight or "
                            "train.global_batch_size", key=key)
    eos = {s.eos_id for s in mixture.sources}
    if masks is not False and masks != "false" and len(eos) > 1:
        raise DataError(f"{key}: the sources record different EOS ids ({sorted(eos, key=str)}), so document masks "
                        "cannot apply to all; prepare them with one tokenizer, or set "
                        "data.mask_document_boundaries = false", key=key)
    return mixture


def source_counters(mixture: Mixture, steps: int, global_batch_size: int) -> list[dict]:
    """Per source after ``steps`` steps: samples and tokens seen, and the pass (epoch, from 0) its
    latest sample came from: what step records carry (README, "Metrics")."""
    seen = mixture.seen(steps, global_batch_size)
    return [{"path": s.name, "weight": w, "samples": int(n), "tokens": int(n) * mixture.seq_len,
             "epoch": int(max(n - 1, 0) // size)}
            for s, w, n, size in zip(mixture.sources, mixture.weights, seen, mixture.sizes)]
