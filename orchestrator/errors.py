"""The driver's error hierarchy: picklable, each message naming what to change.

``UserInputError`` subclasses mean bad input (exit 2, one line); ``TrainingFailed`` means training
could not go on within the elastic limits (exit 1).
"""

from __future__ import annotations


class OrchestratorError(Exception):
    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self):
        return (type(self), (self.message,))

    def __str__(self) -> str:
        return self.message


class UserInputError(OrchestratorError):
    """Bad input that the user fixes by changing a key, a path or the cluster (exit 2)."""

    exit_code = 2


class WorkerGroupStartupError(UserInputError):
    """The cluster cannot place (or start) the actors the mesh needs."""


class ClusterConnectError(UserInputError):
    """RAY_ADDRESS points at no reachable cluster."""


class TrainingFailed(OrchestratorError):
    """Training stopped: too many restarts, or too few live replicas for elastic.min_dp (exit 1)."""


class RebuildTimeoutError(TrainingFailed):
    """A generation could not be formed within elastic.rebuild_timeout_s."""


class ClusterNetworkError(TrainingFailed, UserInputError):
    """The ranks cannot reach the rendezvous store or each other: the cluster's network configuration
    (a firewall, a host name on a loopback address), named with the address and what to open. The run
    stops as a failed run does (the controller's ERRORED state), with exit 2: the fix is the input."""
