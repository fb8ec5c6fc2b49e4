"""RankError: how an error raised inside a rank reaches the driver — as plain text, never as the object.

Ray hands the driver an actor method's exception pickled: unpickling it imports the module that
defines its class, so a ``torch.distributed.DistNetworkError`` (or any torch-defined error, or an
error whose attributes hold a tensor) would import torch in the driver, which otherwise never
imports it. That is not only weight: a job driver whose working directory was replaced under it
(a second node of the same machine unpacking the job's ``working_dir`` into the shared session
directory) dies importing torch, with MKL's ``Intel oneMKL FATAL ERROR: Cannot load
libtorch_cpu.so`` and exit status 2 (issue 35). So every rank call raises a ``RankError`` instead:
this module is pure Python and the driver has it already.

``kind`` keeps the original exception's class name: the driver's one-line reports read
``f"{kind}: {message}"`` as they read ``f"{type(exc).__name__}: {exc}"`` before.
"""

from __future__ import annotations


class RankError(RuntimeError):
    """An error raised in a rank, as text: ``kind`` (its class name) and ``message`` (its text)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(kind, message)
        self.kind = kind
        self.message = message

    def __str__(self) -> str:
        return self.message

    @classmethod
    def of(cls, exc: BaseException) -> RankError:
        """``exc`` as a RankError (itself when it is one already)."""
        if isinstance(exc, RankError):
            return exc
        try:
            message = str(exc)
        except Exception:  # a broken __str__ must not hide the error it describes
            message = repr(exc)
        return cls(type(exc).__name__, message)


def kind_of(exc: BaseException) -> str:
    """The class name a report shows for ``exc``: a RankError's original one, else its own."""
    return exc.kind if isinstance(exc, RankError) else type(exc).__name__


# Kinds a joining rank raises when the network keeps it from the store or its peers (workers/reach.py):
# the cluster's configuration, so the driver stops the run with the line instead of shrinking the mesh.
STORE_UNREACHABLE = "StoreUnreachable"
PEER_UNREACHABLE = "PeerUnreachable"
UNREACHABLE = frozenset({STORE_UNREACHABLE, PEER_UNREACHABLE})


def unreachable(line: str) -> bool:
    """Whether a driver-side error line (``f"{kind}: {message}"``, ``ray_calls.error_line``) is one of them."""
    return line.split(":", 1)[0].strip() in UNREACHABLE
