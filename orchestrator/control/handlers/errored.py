"""The Errored state: the run stops with its error (driver side; no Ray, no torch).

No handler raises for a failure: each returns ``Errored(error)`` where it meets one it cannot recover
from — the failure policy's ``Raise`` (the restart budget spent, a join broken with nobody lost, the
network keeping ranks apart: handlers/recovering.py), too few actors left to form a mesh
(handlers/forming.py), checkpoint storage failing with every rank alive or ranks disagreeing about a
bad step (control/step_loop.py, control/formation.py, handlers/finished.py). Errored is terminal:
entering it, the controller gives the run lease back (nothing more is saved), and ``outcome`` hands
the error to the controller's caller, ``Controller.run``'s. ``elastimesh train`` then prints its one
line and exits with its code (``TrainingFailed``: 1; ``ClusterNetworkError``: 2, the fix is the
cluster's configuration), after launch.py shut the actors and the store down.
"""

from __future__ import annotations

from typing import NoReturn

from orchestrator.control.context import DriverContext
from orchestrator.control.states import Errored


def outcome(state: Errored, ctx: DriverContext) -> NoReturn:
    raise state.error
