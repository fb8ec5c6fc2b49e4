"""How many graphs ``torch.compile`` compiled again on this rank (``train.compile``): the ``recompiles``
field of a step record.

Dynamo counts every graph it compiles, per process (``torch._dynamo.utils.counters["stats"]
["unique_graphs"]``); its caches live as long as the process, and a rank's process outlives
generations. A rank's first compiled step compiles its blocks; a graph compiled in any later step —
in the same generation, or after a rebuild, where the new generation's meshes and process groups
may fail the old graphs' guards — is a recompile. Each one costs time inside the step, and past
dynamo's ``recompile_limit`` a block silently runs eager: the metric makes both visible.

Compile time is not step time: the seconds dynamo spends compiling inside the current step (finished
compiles and the one running now, from dynamo's compile start/end callbacks) are answered by the
rank's ``status`` (``WorkerStatus.step_compile_s``), and the driver adds them to
``elastic.step_timeout_s`` for that step (orchestrator/recovery/hang_watch.py): a first compiled
step, or the recompiles after a rebuild, on a large model never reads as a stuck step (issue 36).
"""

from __future__ import annotations

import threading
import time


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompileClock:
    """Seconds dynamo spent compiling in this process, the compile running now included; read from the
    rank's status thread while the training thread compiles (the lock keeps the pair consistent)."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._done_s = 0.0
        self._since: float | None = None  # when the compile running now began

    def install(self) -> None:
        """Register with dynamo's compile callbacks (process-wide), again after ``torch._dynamo.reset()``,
        which clears them."""
        from torch._dynamo.callback import callback_handler

        if self._on_start in callback_handler.start_callbacks:
            return
        callback_handler.register_start_callback(self._on_start)
        callback_handler.register_end_callback(self._on_end)

    def _on_start(self, _args) -> None:
        self.started()

    def _on_end(self, _args) -> None:
        self.ended()

    def started(self) -> None:
        with self._lock:
            self._since = self.clock()

    def ended(self) -> None:
        with self._lock:
            if self._since is not None:
                self._done_s += self.clock() - self._since
            self._since = None

    def total_s(self) -> float:
        with self._lock:
            running = self.clock() - self._since if self._since is not None else 0.0
            return self._done_s + running


class RecompileCounter:
    """Wraps the train steps of one process (dynamo's counters and caches are per process)."""

    def __init__(self, compile_clock: CompileClock | None = None) -> None:
        self.compiled_once = False
        self._before = 0
        self.compile_clock = compile_clock or CompileClock()
        self._step_start_s: float | None = None  # compile seconds when the current step began

    def start(self) -> None:
        self.compile_clock.install()
        self._before = compiled_graphs()
        self._step_start_s = self.compile_clock.total_s()

    def step_compile_s(self) -> float:
        """Seconds compiled inside the current compiled step so far (0.0 outside one)."""
        if self._step_start_s is None:
            return 0.0
        return self.compile_clock.total_s() - self._step_start_s

    def stop(self) -> int:
        """Graphs compiled since ``start``, unless this is the process's first compiled step (0)."""
        self._step_start_s = None
        new = compiled_graphs() - self._before
        recompiles = new if self.compiled_once else 0
        self.compiled_once = self.compiled_once or new > 0
        return recompiles


PROCESS = RecompileCounter()  # one per process, as dynamo's caches

# What a rank's training collectives wait in a generation's first compiled step: its peers may compile
# for minutes before their first collective (a large model; a loaded host). A floor, raised by what this
# process compiled so far (a later generation recompiles about as much).
COMPILE_WAIT_FLOOR_S = 1800.0


def warm_up_timeout_s(collective_timeout_s: float) -> float:
    """The training groups' timeout for a generation's first compiled step (``RankGroups.collective_timeout``)."""
    return max(collective_timeout_s, COMPILE_WAIT_FLOOR_S + 2 * PROCESS.compile_clock.total_s())
