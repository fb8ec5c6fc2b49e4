"""A new actor process's start with the cyclic garbage collector paused (the one place that says so).

Starting a rank imports torch, DTensor, dynamo and the project's modules: some 330k long-lived objects
(``RankActor.warm`` freezes them afterwards). With the collector on, every allocation threshold passed
during those imports runs a collection that walks the objects made so far, again and again, and none
of them is garbage: importing torch, ``torch.distributed.tensor`` and ``torch._dynamo`` took 3.5-3.8 s
of CPU with it and 3.0-3.4 s without (3 runs each, this 2-core machine), and ``make_group(4)`` (four
RankActors started and answering) 11.75 s -> 9.62 s (medians of 9, interleaved). So a start pauses it
while it imports, and collects once at the end (``RankActor.warm``, before its freeze).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off while the block runs, then as it was (reference counting still frees
    what the block drops; cycles made meanwhile wait for the next collection)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
