"""How a ``RankActor`` method is exposed to the driver: on which of the actor's threads it runs, and
that its errors leave the rank as text only (``RankError``: the driver never unpickles a torch object,
meshspeak/rank_errors.py; issue 35).
"""

from __future__ import annotations

import inspect
import threading

import ray

from meshspeak.rank_calls import TRAIN_GROUP
from meshspeak.rank_errors import RankError

# Why one thread: DTensor's sharding-propagation caches (and torch's other per-thread state) are per
# thread, so on Ray's rotating pool every new thread paid the warm-up again: steps 1-4 of the default
# job took 1.6-2.8 s, then 0.3-0.5 s. On one thread step 2 is already at full speed.
# (The names live in meshspeak.rank_calls: the driver declares the groups when it creates the actor.)


def plain(method, *, group: str | None = None):
    """``method``, raising any error as a ``RankError`` (text only: the driver never unpickles a torch
    object, meshspeak/rank_errors.py), run in ``group``'s thread when one is named (noting the
    training thread, for ``train_threads``)."""

    def call(self, *args, **kwargs):
        if group == TRAIN_GROUP:
            self._train_threads.add(threading.get_ident())
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:  # "from exc": the rank's log and Ray's traceback text keep the original
            raise RankError.of(exc) from exc

    # Not functools.wraps: with __wrapped__ set, Ray 2.60 ignored the concurrency group and ran
    # the method on the default pool (measured: 3 threads over 10 calls instead of 1). The
    # signature is set instead (what Ray and tests/unit/test_rank_calls.py read).
    call.__name__, call.__qualname__ = method.__name__, method.__qualname__
    call.__doc__ = method.__doc__
    call.__signature__ = inspect.signature(method)
    return call if group is None else ray.method(concurrency_group=group)(call)


def on(group: str):
    def wrap(method):
        """Run ``method`` in ``group``'s thread (see ``plain``)."""
        return plain(method, group=group)

    return wrap


training = on(TRAIN_GROUP)  # the training thread: one, long-lived (the comment above)
