"""The real ``Controller`` driven one transition at a time, for the benchmarks that act between
transitions (arm a fault on a member once generation 1 formed, kill one after a step was read) or time
each transition (bench/scale.py: a formation's seconds, the driver's CPU per step).

``Controller.run()`` is what launch and most benchmarks call; what they read afterwards is its
``RunSummary`` and the metrics file (README, "Metrics"). The rest of what a benchmark needs of a
running controller is here, so that bench/ never names the controller's internals and a change of its
shape is followed in this one file (as tests/ follow it in ``testbed/controller_run.py``). No pytest,
no Ray: a benchmark imports it as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.control.controller import Controller, State

TERMINAL = (State.FINISHED, State.ERRORED)


@dataclass(frozen=True)
class Transition:
    """One ``advance()``: the state it left and the one it reached, its wall and thread CPU seconds, and
    the next training step to run once it returned."""

    before: State
    after: State
    wall_s: float
    cpu_s: float
    next_step: int


def form_first_generation(controller: Controller) -> dict[int, int]:
    """Form generation 1 (FORMING -> RUNNING) and return its members: world rank -> actor id.

    Raises:
        RuntimeError: the formation did not reach RUNNING (the run's error in the message).
    """
    reached = controller.advance()
    if reached != State.RUNNING:
        raise RuntimeError(f"generation 1 did not form ({reached}): {controller.error}")
    return members(controller)


def members(controller: Controller) -> dict[int, int]:
    """The current generation's world rank -> actor id ({} before the first formation)."""
    return dict(controller.generation.members) if controller.generation is not None else {}


def run_to_end(controller: Controller, on_transition: Callable[[Transition], Any] | None = None) -> list[Transition]:
    """Advance until FINISHED or ERRORED, calling ``on_transition`` after each transition; returns them
    all. The checkpoint coordinator is closed at the end, as ``Controller.run`` closes it.

    Raises:
        TrainingFailed: the run ended ERRORED (its error).
    """
    transitions: list[Transition] = []
    try:
        while controller.state.kind not in TERMINAL:
            before, wall0, cpu0 = controller.state.kind, time.perf_counter(), time.thread_time()
            after = controller.advance()
            transitions.append(Transition(before, after, time.perf_counter() - wall0, time.thread_time() - cpu0,
                                          controller.next_step))
            if on_transition is not None:
                on_transition(transitions[-1])
    finally:
        controller.ckpt.close()
    if controller.state.kind == State.ERRORED:
        raise controller.error
    return transitions


def last_restore(controller: Controller) -> dict[str, Any] | None:
    """What the newest formation or rollback resumed from: ``source`` (snapshot or storage), the bytes a
    rank fetched and its shard's bytes; None when nothing was restored."""
    restored = controller.last_restore
    if restored is None:
        return None
    return {"source": restored.source, "fetched_bytes": restored.fetched_bytes, "shard_bytes": restored.shard_bytes}
