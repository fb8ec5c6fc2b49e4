"""One handler per controller state: each takes (state, driver context) and returns the next state,
and none imports the controller (orchestrator/control/controller.py hands them the state). Finished
and Errored are terminal: they have none."""

from __future__ import annotations

from orchestrator.control.handlers import draining, forming, recovering, running
from orchestrator.control.states import Draining, Forming, Rebuilding, Recovering, Running

HANDLERS = {
    Running: running.handle,
    Draining: draining.handle,
    Recovering: recovering.handle,
    Forming: forming.handle,
    Rebuilding: forming.handle_rebuilding,
}
