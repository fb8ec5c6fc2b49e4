"""The global sample order and how one step's samples are cut over DP replicas and microbatches.

Epoch ``e`` visits samples in ``default_rng([seed, e]).permutation(n)``; the epochs are chained into
one infinite sequence and optimizer step ``k`` (from 1) takes positions ``[(k-1)*G, k*G)``. The step's
ids are cut into DP replicas by contiguous slices (even, or as ``elastic.rebalance`` splits the step's
microbatches) and each slice into microbatches, so the union over any mesh and split is the same set
of samples: a resize mid-run changes who computes what, never what
(docs/design.md, "Global batch semantics"). Depends on ``n`` only, never on the tokens, so the lazy
reader changes nothing here.

A mixture (``data.mix``: sources with weights) cuts each step's ``G`` slots into per-source counts
(:class:`MixSchedule`: every step gives source ``j`` either floor or ceil of ``w_j * G`` and the running
total stays within about one sample of ``w_j * k * G``) and lays them out interleaved
(:func:`mixture_slots`); source ``j``'s ``q``-th sample overall is position ``q`` of its own epoch
chain, ``default_rng([seed, epoch, j + 1])``. Both depend on (weights, G, seed, step) only, so every
source's samples are visited once per pass on any mesh, across resizes and resumes
(meshdata/mixture.py reads the windows).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from fractions import Fraction

import numpy as np


def sample_order(seed: int, epoch: int, num_samples: int, stream: int = 0) -> np.ndarray:
    """The visiting order of epoch ``epoch``: a function of (seed, epoch) only, never of the mesh.

    ``stream`` > 0 names a mixture's source (its index + 1): each source gets its own permutations.
    (0 is left out of the seed rather than appended: numpy seeds [s, e] and [s, e, 0] alike.)
    """
    key = [seed, epoch] if stream == 0 else [seed, epoch, stream]
    return np.random.default_rng(key).permutation(num_samples)


@functools.lru_cache(maxsize=16)
def _order_cached(seed: int, epoch: int, num_samples: int, stream: int = 0) -> np.ndarray:
    # Every step of an epoch needs the same permutation; recomputing it costs O(n) per step.
    order = sample_order(seed, epoch, num_samples, stream)
    order.flags.writeable = False
    return order


def chain_ids(start: int, end: int, seed: int, num_samples: int, stream: int = 0) -> np.ndarray:
    """Positions [start, end) of the epoch chain of one stream (epoch e = ``sample_order(seed, e)``)."""
    pieces = [np.zeros(0, np.int64)]
    pos = start
    while pos < end:  # a range may straddle one (or, if it is longer than n, several) epoch boundaries
        epoch, off = divmod(pos, num_samples)
        take = min(end - pos, num_samples - off)
        pieces.append(_order_cached(seed, epoch, num_samples, stream)[off : off + take])
        pos += take
    return np.concatenate(pieces)


def global_sample_ids(step: int, global_batch_size: int, seed: int, num_samples: int) -> np.ndarray:
    """Sample ids of optimizer step ``step`` (from 1): positions [(step-1)*G, step*G) of the epoch chain."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if global_batch_size < 1 or num_samples < 1:
        raise ValueError(f"need global_batch_size >= 1 and num_samples >= 1, got "
                         f"{global_batch_size}, {num_samples}")
    return chain_ids((step - 1) * global_batch_size, step * global_batch_size, seed, num_samples)


def replica_microbatches(step: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp: int,
                         seed: int, num_samples: int, counts: Sequence[int] | None = None) -> list[np.ndarray]:
    """Replica ``dp_rank``'s microbatches of step ``step`` of one source, in order (:func:`replica_slice`)."""
    ids = global_sample_ids(step, global_batch_size, seed, num_samples)
    return replica_slice(ids, micro_batch_size, dp_rank, dp, counts)


def replica_slice(step_ids: np.ndarray, micro_batch_size: int, dp_rank: int, dp: int,
                  counts: Sequence[int] | None = None) -> list[np.ndarray]:
    """Replica ``dp_rank``'s microbatches of a step whose global batch is ``step_ids``, in order.

    Without ``counts``: a contiguous G/dp slice. With ``counts`` (``elastic.rebalance``: microbatches
    per replica in dp order, summing to G / micro_batch_size; meshspeak/rebalance.py): the contiguous
    run of microbatches ``[sum(counts[:dp_rank]), sum(counts[:dp_rank + 1]))``. Either way the
    replicas' microbatches concatenated in dp order are the step's global batch, in its order.
    """
    global_batch_size = len(step_ids)
    if dp < 1 or micro_batch_size < 1 or global_batch_size % (dp * micro_batch_size):
        raise ValueError(f"train.global_batch_size ({global_batch_size}) must be a multiple of "
                         f"mesh.dp ({dp}) x train.micro_batch_size ({micro_batch_size})")
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank {dp_rank} out of range [0, {dp})")
    if counts is None:
        per = global_batch_size // dp
        first, end = dp_rank * per, (dp_rank + 1) * per
    else:
        if len(counts) != dp or min(counts) < 1 or sum(counts) * micro_batch_size != global_batch_size:
            raise ValueError(f"microbatch split {tuple(counts)} does not cut {global_batch_size // micro_batch_size} "
                             f"microbatches over dp={dp} replicas (at least one each)")
        first = sum(counts[:dp_rank]) * micro_batch_size
        end = first + counts[dp_rank] * micro_batch_size
    ids = step_ids[first:end]
    return [ids[i : i + micro_batch_size].copy() for i in range(0, end - first, micro_batch_size)]


# --- mixtures -----------------------------------------------------------------------------------


def mix_parts(weights: Sequence[float]) -> tuple[int, ...]:
    """The weights as integers in exactly the same ratio, so that every process computes the schedule
    below in integer arithmetic: no rounding can differ. Each weight is read as the shortest decimal
    that gives its float (``repr``), so 0.7 : 0.3 is exactly 7 : 3, as written."""
    fracs = [Fraction(repr(float(w))) for w in weights]
    if not fracs or any(f <= 0 for f in fracs):
        raise ValueError(f"mixture weights must all be > 0, got {list(weights)}")
    denominator = math.lcm(*(f.denominator for f in fracs))
    parts = [int(f * denominator) for f in fracs]
    common = math.gcd(*parts)
    return tuple(p // common for p in parts)


class MixSchedule:
    """How many of each step's ``G`` slots each source of a mixture fills.

    With weights ``w_j`` (``parts`` / their sum), step ``k`` gives source ``j`` ``floor(w_j * G)`` slots
    plus one extra for the ``R = G - sum_j floor(w_j * G)`` sources that are owed most after ``k``
    steps (``w_j * k * G`` minus what they got; ties to the lower index): every step's count is
    within one sample of ``w_j * G``, and the running total stays near ``w_j * k * G`` (within half a
    sample for two sources; measured below 1.02 for up to 7). With two sources this greedy rule is
    plain rounding, ``round_half_up(w_0 * k * G)`` for source 0 (:meth:`_extras_of_two`), computed
    directly; with more, the extras depend on the steps before, so they are replayed once per process
    (~20-35 us per step on this machine), with marks every ``MARK_EVERY`` steps so that a step back
    costs at most that many.
    """

    MARK_EVERY = 1024

    def __init__(self, parts: Sequence[int], global_batch_size: int) -> None:
        self.parts, self.global_batch_size = tuple(parts), int(global_batch_size)
        total = sum(self.parts)
        self._total = total
        self._base = [p * self.global_batch_size // total for p in self.parts]
        self._owed_per_step = [p * self.global_batch_size - total * b for p, b in zip(self.parts, self._base)]
        self._chairs = self.global_batch_size - sum(self._base)
        self._marks: list[tuple[int, ...]] = [(0,) * len(self.parts)]  # extras after 0, M, 2M, ... steps
        self._last: tuple[int, tuple[int, ...]] = (0, self._marks[0])
        self._lock = threading.Lock()  # a rank's step thread and its eval thread may ask at once

    def _advance(self, extras: tuple[int, ...], step: int) -> tuple[int, ...]:
        """The extras after step ``step`` (from 1), given those after ``step - 1``."""
        owed = [r * step - self._total * e for r, e in zip(self._owed_per_step, extras)]
        chosen = sorted(range(len(extras)), key=lambda j: (-owed[j], j))[: self._chairs]
        return tuple(e + (j in chosen) for j, e in enumerate(extras))

    def _extras_of_two(self, steps: int) -> tuple[int, ...]:
        """Two sources: the greedy rule in closed form. The two owe ``total`` between them after
        accruing step k (one extra to give), so source 0 gets it iff it owes >= half; by induction its
        extras are then ``floor(r_0 * k / total + 1/2)``."""
        if self._chairs == 0:
            return (0, 0)
        first = (2 * self._owed_per_step[0] * steps + self._total) // (2 * self._total)
        return (first, steps - first)

    def _extras(self, steps: int) -> tuple[int, ...]:
        if len(self.parts) == 2:
            return self._extras_of_two(steps)
        with self._lock:
            done, extras = self._last  # usually the step before: one step to replay
            mark = min(steps // self.MARK_EVERY, len(self._marks) - 1)
            if not mark * self.MARK_EVERY <= done <= steps:  # a step back, or a jump: from a mark
                done, extras = mark * self.MARK_EVERY, self._marks[mark]
            for k in range(done + 1, steps + 1):
                extras = self._advance(extras, k)
                if k % self.MARK_EVERY == 0 and k // self.MARK_EVERY == len(self._marks):
                    self._marks.append(extras)
            self._last = (steps, extras)
            return extras

    def seen(self, steps: int) -> np.ndarray:
        """int64 per source: its slots in steps 1..``steps`` (0 steps: none)."""
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        extras = self._extras(steps)
        return np.asarray([b * steps + e for b, e in zip(self._base, extras)], np.int64)

    def counts(self, step: int) -> np.ndarray:
        """int64 per source: its slots in step ``step`` (from 1); they sum to G."""
        if step < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        before = self.seen(step - 1)  # first: the replay then advances one step, not back from a mark
        return self.seen(step) - before


@functools.lru_cache(maxsize=8)
def mix_schedule(parts: tuple[int, ...], global_batch_size: int) -> MixSchedule:
    """One schedule per (weights, G) per process: its marks are kept between steps."""
    return MixSchedule(parts, global_batch_size)


def mixture_slots(counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """A step's layout: (source of each slot, its rank among that source's slots in the step).

    The sources are interleaved evenly (source ``j``'s ``t``-th slot sits at ``(t + 1/2) / counts[j]``
    of the step, ties to the lower index), so each replica's contiguous slice holds a mix too.
    """
    source = np.concatenate([np.full(int(c), j, np.int64) for j, c in enumerate(counts)] + [np.zeros(0, np.int64)])
    rank = np.concatenate([np.arange(int(c), dtype=np.int64) for c in counts] + [np.zeros(0, np.int64)])
    where = (2 * rank + 1) / (2 * np.maximum(np.asarray(counts, np.float64)[source], 1))
    layout = np.lexsort((source, where))
    return source[layout], rank[layout]
