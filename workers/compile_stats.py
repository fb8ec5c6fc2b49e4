"""How many graphs ``torch.compile`` compiled again on this rank (``train.compile``): the ``recompiles``
field of a step record.

Dynamo counts every graph it compiles, per process (``torch._dynamo.utils.counters["stats"]
["unique_graphs"]``); its caches live as long as the process, and a rank's process outlives
generations. A rank's first compiled step compiles its blocks; a graph compiled in any later step —
in the same generation, or after a rebuild, where the new generation's meshes and process groups
may fail the old graphs' guards — is a recompile. Each one costs time inside the step (counted
against ``elastic.step_timeout_s``), and past dynamo's ``recompile_limit`` a block silently runs
eager: the metric makes both visible.
"""

from __future__ import annotations


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class RecompileCounter:
    """Wraps the train steps of one process (dynamo's counters and caches are per process)."""

    def __init__(self) -> None:
        self.compiled_once = False
        self._before = 0

    def start(self) -> None:
        self._before = compiled_graphs()

    def stop(self) -> int:
        """Graphs compiled since ``start``, unless this is the process's first compiled step (0)."""
        new = compiled_graphs() - self._before
        recompiles = new if self.compiled_once else 0
        self.compiled_once = self.compiled_once or new > 0
        return recompiles


PROCESS = RecompileCounter()  # one per process, as dynamo's caches
