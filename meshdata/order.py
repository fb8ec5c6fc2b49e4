"""The global sample order and how one step's samples are cut over DP replicas and microbatches.

Epoch ``e`` visits samples in ``default_rng([seed, e]).permutation(n)``; the epochs are chained into
one infinite sequence and optimizer step ``k`` (from 1) takes positions ``[(k-1)*G, k*G)``. The step's
ids are cut into DP replicas by contiguous slices (even, or as ``elastic.rebalance`` splits the step's
microbatches) and each slice into microbatches, so the union over any mesh and split is the same set
of samples: a resize mid-run changes who computes what, never what
(docs/design.md, "Global batch semantics"). Depends on ``n`` only, never on the tokens, so the lazy
reader changes nothing here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np


def sample_order(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """The visiting order of epoch ``epoch``: a function of (seed, epoch) only, never of the mesh."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


@functools.lru_cache(maxsize=4)
def _order_cached(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    # Every step of an epoch needs the same permutation; recomputing it costs O(n) per step.
    order = sample_order(seed, epoch, num_samples)
    order.flags.writeable = False
    return order


def global_sample_ids(step: int, global_batch_size: int, seed: int, num_samples: int) -> np.ndarray:
    """Sample ids of optimizer step ``step`` (from 1): positions [(step-1)*G, step*G) of the epoch chain."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if global_batch_size < 1 or num_samples < 1:
        raise ValueError(f"need global_batch_size >= 1 and num_samples >= 1, got "
                         f"{global_batch_size}, {num_samples}")
    start, end = (step - 1) * global_batch_size, step * global_batch_size
    pieces = []
    pos = start
    while pos < end:  # a batch may straddle one (or, if G > n, several) epoch boundaries
        epoch, off = divmod(pos, num_samples)
        take = min(end - pos, num_samples - off)
        pieces.append(_order_cached(seed, epoch, num_samples)[off : off + take])
        pos += take
    return np.concatenate(pieces)


def replica_microbatches(step: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp: int,
                         seed: int, num_samples: int, counts: Sequence[int] | None = None) -> list[np.ndarray]:
    """Replica ``dp_rank``'s microbatches of step ``step``, in order.

    Without ``counts``: a contiguous G/dp slice. With ``counts`` (``elastic.rebalance``: microbatches
    per replica in dp order, summing to G / micro_batch_size; meshspeak/rebalance.py): the contiguous
    run of microbatches ``[sum(counts[:dp_rank]), sum(counts[:dp_rank + 1]))``. Either way the
    replicas' microbatches concatenated in dp order are the step's global batch, in its order.
    """
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
    ids = global_sample_ids(step, global_batch_size, seed, num_samples)[first:end]
    return [ids[i : i + micro_batch_size].copy() for i in range(0, end - first, micro_batch_size)]
