"""The CLI's view of a checkpoint root (``elastimesh ckpt list`` / ``ckpt inspect``).

Read from the JSON manifests and file sizes only: DCP's ``.metadata`` is a pickle, and a crafted
directory must not run code in the CLI (``read_dcp_metadata=False``, see ``checkpoints.catalog``).
No torch, no Ray.
"""

from __future__ import annotations

import os
import time
from typing import Any

from checkpoints.catalog import CheckpointInfo, dir_basename, check_checkpoint
from checkpoints.errors import CheckpointError
from checkpoints.layout import parse_step
from checkpoints.storage import CheckpointStorage, storage_for
from meshspeak.locations import local_path


def require_root(root: str, storage: CheckpointStorage | None = None) -> None:
    """For ``elastimesh ckpt list``: ``root`` must be an existing directory.

    (``list_checkpoints`` treats an absent root as empty, which is right for a first run's resume but
    would make a mistyped path look like a directory without checkpoints.)

    Raises:
        CheckpointError: ``root`` does not exist, or is a local file.
    """
    storage = storage or storage_for(root)
    exists, local = storage.exists(root), local_path(root)
    if exists and (local is None or os.path.isdir(local)):
        return
    what = "not a directory" if exists else "no such checkpoint directory"
    raise CheckpointError(f"{what}: give the directory a run's checkpoint.dir points at (its "
                          "checkpoints are the step-NNNNNNNN directories in it)", root)


def describe(path: str, storage: CheckpointStorage | None = None) -> dict[str, Any]:
    """Facts about one step directory for ``elastimesh ckpt inspect``; JSON-serialisable.

    From the JSON manifest and file sizes only (never DCP's pickled ``.metadata``).

    Raises:
        CheckpointError: ``path`` does not exist.
    """
    storage, path = storage or storage_for(path), path.rstrip("/") or path
    if not storage.exists(path):
        raise CheckpointError("no such checkpoint directory: give one of the step directories that "
                              "`elastimesh ckpt list DIR` shows", path)
    valid, reason, manifest = check_checkpoint(path, storage, read_dcp_metadata=False)
    out: dict[str, Any] = {"path": path, "step": parse_step(dir_basename(path)), "valid": valid,
                           "reason": reason, "size_bytes": storage.size_of_tree(path)}
    if manifest is not None:
        out.update(manifest.to_dict(), created=_when(manifest.created_at))
    return out


def format_table(infos: list[CheckpointInfo]) -> str:
    """A plain-text table of checkpoints for ``elastimesh ckpt list`` (one line per step dir)."""
    rows = [("STEP", "VALID", "RUN", "MESH", "SIZE", "CREATED", "PATH / REASON")]
    for i in infos:
        mesh = i.manifest.mesh_str if i.manifest else "-"
        created = _when(i.created_at) if i.created_at is not None else "-"
        note = f"{i.path}  ({i.reason})" if i.reason else i.path
        rows.append((str(i.step), "yes" if i.valid else "NO", i.owner or "-", mesh, _human(i.size_bytes),
                     created, note))
    cols = len(rows[0]) - 1
    widths = [max(len(r[c]) for r in rows) for c in range(cols)]
    return "\n".join("  ".join(r[c].ljust(widths[c]) for c in range(cols)) + "  " + r[cols] for r in rows)


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
