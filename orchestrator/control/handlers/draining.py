"""The Draining state's handler: a decision taken at a boundary with steps still in flight waits for
them (driver side; no Ray, no torch; control/window.py).

While steps are in flight, the oldest is read and none is sent: the state stays Draining (or the
failure path takes over, handing the decision on). Once none is left, the decision is carried out at
that boundary — taken again first when a failure or rollback came between (``stale``): it may have
lapsed, and then the boundary goes on as Running's would.
"""

from __future__ import annotations

from orchestrator.control.context import DriverContext
from orchestrator.control.states import ControllerState, Draining
from orchestrator.control.step_loop import cross_boundary, read_oldest, top_up


def handle(state: Draining, ctx: DriverContext) -> ControllerState:
    if ctx.window.flights:
        return read_oldest(ctx, draining=state)
    decided = cross_boundary(ctx, draining=state)
    if decided is not None:
        return decided
    return read_oldest(ctx, draining=top_up(ctx))  # the decision lapsed and the step was sent: running again
