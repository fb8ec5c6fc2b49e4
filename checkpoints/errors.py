"""Exceptions raised by the checkpoints package.

They cross process boundaries (a rank's save failure travels to the driver inside a Ray error), so
every class pickles through ``__reduce__`` with its constructor arguments, and every message names
the checkpoint path involved.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint could not be written, committed, listed or loaded.

    Args:
        message: what went wrong and, where there is one, what to do about it.
        path: the checkpoint directory or root the error is about, if any.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        self.message = message
        self.path = path
        super().__init__(f"{message} [path: {path}]" if path else message)

    def __reduce__(self):  # keep the fields when the error is pickled (Ray, multiprocessing)
        return (type(self), (self.message, self.path))


class ManifestError(CheckpointError):
    """A ``manifest.json`` is missing fields, has wrong types, or is not JSON at all."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model being loaded: keys missing or shapes that differ.

    Args:
        keys: the offending state-dict keys (flattened DCP names such as ``model.fc1.weight``).
        path: the checkpoint directory.
        detail: optional extra text, e.g. the shapes that differ.
    """

    def __init__(self, keys: list[str], path: str | None = None, detail: str = "") -> None:
        self.keys = list(keys)
        self.detail = detail
        shown = ", ".join(self.keys[:8]) + (f" (+{len(self.keys) - 8} more)" if len(self.keys) > 8 else "")
        message = (
            f"checkpoint does not match the model: {len(self.keys)} key(s) missing or of another "
            f"shape: {shown}{'; ' + detail if detail else ''}. Was it saved from a different "
            "model config? Check model.* in the job config against the checkpoint's manifest."
        )
        super().__init__(message, path)

    def __reduce__(self):
        return (type(self), (self.keys, self.path, self.detail))


def summarize_failure(error: BaseException) -> str:
    """One line for an exception; DCP's ``CheckpointException`` becomes ``rank R: Type: message``
    per failing rank instead of its multi-page traceback text."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, pair in sorted(failures.items()):
            exc = pair[0] if isinstance(pair, tuple) else pair
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return "; ".join(parts)
    return f"{type(error).__name__}: {error}"
