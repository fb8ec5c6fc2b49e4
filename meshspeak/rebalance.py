"""Load balancing across data-parallel replicas (``elastic.rebalance``): how many microbatches each
replica runs in a step, decided by the driver from measured speeds (pure; no torch, no Ray).

The data contract is unchanged (docs/design.md, "Global batch semantics"): step ``k`` trains the
``M = G / micro_batch_size`` microbatches at positions ``[(k-1)*G, k*G)`` of the sample order, and a
*split* ``c`` (one count per dp replica, in dp order, summing to ``M``) only says who computes which:
replica ``r`` takes the contiguous run of microbatches ``[sum(c[:r]), sum(c[:r+1]))``
(``replica_span``; ``meshdata.order.replica_microbatches`` cuts the sample ids the same way). The
even split is the one every mesh used before. The loss is the token sum over the global token count
(workers/batching.py) and the data-parallel reduction averages over dp replicas whatever each one
summed, so any split computes the same gradient as one process.

The driver decides a split per step and hands every rank the split and its replica's schedule for its
own count (``orchestrator/control/rebalance.py``); the ranks only apply them (workers/runtime.py).

Speed: the seconds per microbatch of a replica are the slowest of its ranks' own compute time in
the step (``StepResult.forward_s``, the straggler score's clock: workers/compute_clock.py) divided
by the replica's count. ``split_by_speed`` then gives microbatches one quantum at a time to the
replica that would finish earliest with it — for equal-size jobs on machines of different speeds
this greedy order reaches the smallest possible makespan (the max over replicas of
``(count + fill) * seconds``; ``fill`` counts a pipeline's fill and drain in microbatch times).

Hysteresis (``SplitPolicy``): per-microbatch times are kept per key (the driver uses (actor, pp
position), so history follows an actor across resizes) as the median of the last ``window``
steps; a new split is adopted only when every replica has ``min_samples`` of them, ``settle`` steps
passed since the last change, and the predicted step time drops by at least ``min_gain`` *and* by
``noise_z`` times the medians' relative standard error (1.4826 MAD / median / sqrt(n), the largest
over the replicas): on a host whose step times jitter by tens of percent the policy asks for a
larger gain before it moves anything (tests/unit/test_rebalance_split.py: 200 steps of +-15%
jitter around equal speeds move nothing; +-15% around a 2x slow replica move microbatches once).
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

Split = tuple[int, ...]

# Chosen on simulated jitter (uniform +-15/30%, log-normal 0.3/0.5 around a replica slowed 2x for 70
# of 200 steps): window 8 / 4 samples / z 2 kept within 6-11% of the ideal split's time at +-30%
# with 5-8 changes, against 11-13% and 7-13 changes for window 5 / 3 samples, reacting in 4-6 steps.
WINDOW = 8  # steps whose per-microbatch times make the median a decision uses
MIN_SAMPLES = 4  # one noisy step (a host hiccup) never moves microbatches on its own
MIN_GAIN = 0.05  # a predicted step time at least 5% shorter than the current split's ...
NOISE_Z = 2.0  # ... and shorter by twice the medians' relative standard error
SETTLE = 3  # steps after a change before the next one


def even_split(total: int, dp: int) -> Split:
    """``total`` microbatches over ``dp`` replicas as every mesh without rebalancing cuts them."""
    if dp < 1 or total < dp or total % dp:
        raise ValueError(f"{total} microbatches do not split evenly over dp={dp}")
    return (total // dp,) * dp


def replica_span(split: Sequence[int], dp_rank: int) -> tuple[int, int]:
    """(first microbatch, count) of replica ``dp_rank`` in the step's ``M = sum(split)`` microbatches."""
    if not 0 <= dp_rank < len(split):
        raise ValueError(f"dp rank {dp_rank} out of range for a split over {len(split)} replicas")
    if any(c < 1 for c in split):
        raise ValueError(f"every replica needs at least one microbatch, got the split {tuple(split)}")
    return sum(split[:dp_rank]), split[dp_rank]


@dataclass(frozen=True, slots=True)
class SplitRules:
    """What a split must respect for a pipeline layout.

    ``quantum``: every count is a multiple of it (interleaved 1F1B walks microbatches in groups of
    pp: meshspeak/schedule.py), and at least one quantum (a replica without a microbatch would skip
    the step's data-parallel collectives and leave its peers waiting). ``fill``: the pipeline's fill
    and drain in microbatch times, added to each replica's count when predicting its step time.
    """

    quantum: int = 1
    fill: float = 0.0


def split_rules(pp: int, virtual_stages: int, schedule: str) -> SplitRules:
    """The rules of a generation's pipeline: its fill and drain in microbatch times — ``(pp - 1) / v``
    for 1F1B, GPipe and interleaved (meshspeak.schedule.theoretical_bubble's model), a third of 1F1B's
    for ZB-H1 and a sixth for ZB-V (their bubbles with equal F, I and W costs:
    meshspeak/zero_bubble.py) — and quanta of pp for interleaved 1F1B; the zero-bubble schedules
    take any count."""
    quantum = pp if schedule == "interleaved_1f1b" and virtual_stages > 1 else 1
    fill = (pp - 1) / virtual_stages
    if schedule == "zb-h1":
        fill = (pp - 1) / 3
    elif schedule == "zbv":
        fill = (pp - 1) / 6
    return SplitRules(quantum=quantum, fill=fill)


def split_by_speed(total: int, seconds_per_mb: Sequence[float], rules: SplitRules = SplitRules()) -> Split:
    """The split of ``total`` microbatches with the smallest predicted step time.

    ``seconds_per_mb[r]``: replica r's seconds per microbatch (> 0; a replica measured at 0 is
    treated as the fastest measured one). Ties go to the lower dp rank, so equal speeds give the
    even split.
    """
    q, dp = rules.quantum, len(seconds_per_mb)
    if dp < 1 or total % q or total < dp * q:
        raise ValueError(f"{total} microbatches cannot give {dp} replicas at least {q} each in quanta of {q}")
    positive = [s for s in seconds_per_mb if s > 0]
    if not positive:
        return _round_robin(total, dp, q)
    seconds = [s if s > 0 else min(positive) for s in seconds_per_mb]
    counts = [q] * dp
    heap = [((counts[r] + q + rules.fill) * seconds[r], r) for r in range(dp)]
    heapq.heapify(heap)
    for _ in range((total - dp * q) // q):
        _, r = heapq.heappop(heap)
        counts[r] += q
        heapq.heappush(heap, ((counts[r] + q + rules.fill) * seconds[r], r))
    return tuple(counts)


def _round_robin(total: int, dp: int, q: int) -> Split:
    # Nothing measured yet: as even as the quanta allow (the even split when it exists).
    counts = [q] * dp
    for i in range((total - dp * q) // q):
        counts[i % dp] += q
    return tuple(counts)


def predicted_step_s(split: Sequence[int], seconds_per_mb: Sequence[float], rules: SplitRules = SplitRules()) -> float:
    """The slowest replica's predicted compute time for ``split``: max of ``(count + fill) * seconds``."""
    return max((c + rules.fill) * s for c, s in zip(split, seconds_per_mb, strict=True))


class SplitPolicy:
    """The split of each step, re-decided at step boundaries with hysteresis (module docstring).

    Use: ``begin`` at every generation (its replicas' keys, the step's microbatch total, the
    pipeline's rules), ``observe`` each trained step's per-key seconds per microbatch, ``decide``
    before sending a step (a new split, or None to keep ``split``).
    """

    def __init__(self, *, window: int = WINDOW, min_samples: int = MIN_SAMPLES, min_gain: float = MIN_GAIN,
                 noise_z: float = NOISE_Z, settle: int = SETTLE) -> None:
        if not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples <= window, got {min_samples}, {window}")
        self.window, self.min_samples, self.min_gain, self.settle = window, min_samples, min_gain, settle
        self.noise_z = noise_z
        self.history: dict[Hashable, deque[float]] = {}
        self.replicas: tuple[tuple[Hashable, ...], ...] = ()
        self.total = 0
        self.rules = SplitRules()
        self.split: Split = ()
        self._hold = 0

    def begin(self, replicas: Sequence[Sequence[Hashable]], total: int, rules: SplitRules) -> None:
        """A generation formed: ``replicas[r]`` are the keys of replica r's ranks. The split restarts
        even; history of keys still present is kept (an actor stays as slow as it was), the rest
        dropped, so the next ``decide`` may rebalance at once."""
        self.replicas = tuple(tuple(keys) for keys in replicas)
        self.total, self.rules = total, rules
        self.split = even_split(total, len(self.replicas))
        present = {k for keys in self.replicas for k in keys}
        self.history = {k: v for k, v in self.history.items() if k in present}
        self._hold = 0

    def observe(self, seconds_per_mb: Mapping[Hashable, float]) -> None:
        """One trained step: each key's seconds per microbatch."""
        for key, seconds in seconds_per_mb.items():
            self.history.setdefault(key, deque(maxlen=self.window)).append(seconds)
        self._hold = max(0, self._hold - 1)

    def replica_seconds(self) -> list[float] | None:
        """Each replica's seconds per microbatch (its slowest rank's median), or None while a rank has
        fewer than ``min_samples`` measurements."""
        measured = self._measured()
        return None if measured is None else [seconds for seconds, _ in measured]

    def _measured(self) -> list[tuple[float, float]] | None:
        """Per replica: (its slowest rank's median, that median's relative standard error)."""
        out = []
        for keys in self.replicas:
            runs = [self.history.get(k, ()) for k in keys]
            if not keys or any(len(r) < self.min_samples for r in runs):
                return None
            slowest = max(runs, key=statistics.median)
            median = statistics.median(slowest)
            mad = statistics.median(abs(x - median) for x in slowest)
            out.append((median, 1.4826 * mad / median / len(slowest) ** 0.5 if median > 0 else 0.0))
        return out

    def decide(self) -> Split | None:
        """The split to adopt from now on, or None to keep the current one."""
        if self._hold or len(self.replicas) < 2:
            return None
        measured = self._measured()
        if measured is None or not any(s > 0 for s, _ in measured):
            return None
        seconds = [s for s, _ in measured]
        candidate = split_by_speed(self.total, seconds, self.rules)
        if candidate == self.split:
            return None
        gain = max(self.min_gain, self.noise_z * max(error for _, error in measured))
        if predicted_step_s(candidate, seconds, self.rules) > (1 - gain) * predicted_step_s(
                self.split, seconds, self.rules):
            return None
        self.split, self._hold = candidate, self.settle
        return candidate
