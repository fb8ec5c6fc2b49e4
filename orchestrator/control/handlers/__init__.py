"""One module per controller state: each handler takes (state, driver context) and returns the next
state, and none imports the controller (orchestrator/control/controller.py hands them the state).
Finished and Errored are terminal: what the run then answers its caller is their ``outcome``."""

from __future__ import annotations

from orchestrator.control.handlers import draining, errored, finished, forming, recovering, running
from orchestrator.control.states import Draining, Errored, Finished, Finishing, Forming, Rebuilding, Recovering, Running

HANDLERS = {
    Running: running.handle,
    Draining: draining.handle,
    Recovering: recovering.handle,
    Forming: forming.handle,
    Rebuilding: forming.handle_rebuilding,
    Finishing: finished.handle,
}

OUTCOMES = {
    Finished: finished.outcome,
    Errored: errored.outcome,
}
