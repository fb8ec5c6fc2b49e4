"""The Running state's handler: cross the step boundary when nothing is in flight, keep the window of
steps full, read the oldest step (driver side; no Ray, no torch).

Returns Running while steps train, ``Draining`` when a boundary's decision must wait for the steps in
flight, ``Forming`` or ``Finishing`` when the boundary decided, ``Recovering`` when a step broke,
``Errored`` when checkpoint storage failed with every rank alive.
"""

from __future__ import annotations

from orchestrator.control.context import DriverContext
from orchestrator.control.states import ControllerState, Running
from orchestrator.control.step_loop import cross_boundary, read_oldest, top_up


def handle(state: Running, ctx: DriverContext) -> ControllerState:
    """Read the oldest step in flight (sending the next ones first, as far as the window and the
    boundaries allow); with nothing in flight, the full step boundary comes first."""
    if not ctx.window.flights:
        decided = cross_boundary(ctx, draining=None)
        if decided is not None:
            return decided
    return read_oldest(ctx, draining=top_up(ctx))
