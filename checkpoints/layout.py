"""Names inside a checkpoint root (pure string helpers; no torch, no I/O).

A root holds one directory per saved step, ``step-00000120/``, containing the DCP shard files
(``__<rank>_<n>.distcp``), the DCP ``.metadata`` (written last by DCP's coordinator) and, written by
the driver only after every rank acknowledged its shard, ``manifest.json``. Only a directory with a
valid manifest is a checkpoint. Every step directory also names the run that made it (``.owner``,
and ``run_id`` in the manifest): a run purges, replaces or resumes only its own.
"""

from __future__ import annotations

import re
from typing import Any

MANIFEST = "manifest.json"
"""The commit marker and description of one checkpoint, written last by the driver."""

OWNER = ".owner"
"""The run id of the run that made this step directory, written by ``catalog.prepare_step`` before any
shard: a save in progress (no manifest yet) still says whose it is, so another run never deletes it."""

DCP_METADATA = ".metadata"
"""DCP's global metadata file (tensor layout and shard offsets), written last by DCP's coordinator."""

STEP_PREFIX = "step-"
_STEP_RE = re.compile(r"^step-(\d{8,})$")


def step_dir_name(step: int) -> str:
    """Directory name for ``step``: ``step_dir_name(120) == "step-00000120"``.

    Zero-padded to 8 digits so that names sort in step order; larger steps simply get more digits.

    Raises:
        ValueError: ``step`` is negative or not an int.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
    return f"{STEP_PREFIX}{step:08d}"


def parse_step(name: str) -> int | None:
    """Step number of a directory name made by :func:`step_dir_name`, or None for anything else.

    Accepts a trailing slash (object stores list "directories" that way) but no other path parts.
    """
    match = _STEP_RE.match(name.rstrip("/"))
    return int(match.group(1)) if match else None


def expected_file_sizes(metadata: Any) -> dict[str, int]:
    """Minimum size of each DCP file: the furthest ``offset + length`` of any item stored in it.

    Args:
        metadata: a DCP ``Metadata`` (duck-typed: ``storage_data`` values with ``relative_path``,
            ``offset``, ``length``).
    """
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), end)
    return sizes
