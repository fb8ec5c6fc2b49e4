"""DataError: the one exception every data problem surfaces as (the CLI prints it and exits 2)."""

from __future__ import annotations


class DataError(ValueError):
    """A bad data source, input file or data-related config value; ``key`` names the config key at fault.

    The message is one actionable line (what is wrong, and the fix) so the CLI can print it as-is and
    exit 2. It crosses process boundaries (Ray actor or task -> driver), hence the explicit
    ``__reduce__``: the default would drop ``key``.
    """

    key = "data.path"

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        if key is not None:
            self.key = key

    def __reduce__(self):
        return (type(self), (str(self), self.key))


def one_line(e: BaseException) -> str:
    """An exception's text squeezed onto one short line (for embedding in a DataError)."""
    return " ".join(str(e).split())[:200] or type(e).__name__
