"""The driver's view of a checkpoint root: list, validate, pick the newest valid, commit, purge.

Driver side: no torch at import time (the driver never imports ``torch.distributed``). Validation
uses the manifest's ``files`` map (sizes the writing ranks reported) to spot missing or truncated
shards with a few ``stat`` calls; only without it does it read DCP's ``.metadata`` (lazy torch import).

Commit protocol: ranks write ``step-N/`` (DCP shards + ``.metadata``), each acks; then
:func:`commit` checks the acks and the files and writes ``manifest.json`` last and atomically.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from checkpoints.errors import CheckpointError, ManifestError
from checkpoints.layout import DCP_METADATA, MANIFEST, expected_file_sizes, parse_step, step_dir_name
from checkpoints.manifest import CheckpointManifest
from checkpoints.storage import CheckpointStorage, local_path, storage_for

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """One ``step-N`` directory under a root, valid (a usable checkpoint) or not, and why."""

    step: int
    path: str
    valid: bool
    reason: str
    """Empty when valid; otherwise what is wrong, e.g. ``partial: no manifest.json``."""
    manifest: CheckpointManifest | None
    size_bytes: int
    created_at: float | None

    @property
    def committed(self) -> bool:  # a manifest was written, even if the files were damaged since
        return self.manifest is not None


def check_checkpoint(path: str, storage: CheckpointStorage | None = None
                     ) -> tuple[bool, str, CheckpointManifest | None]:
    """Validate one step directory. Returns ``(valid, reason, manifest_or_None)``; never raises for damage."""
    storage = storage or storage_for(path)
    manifest_path = storage.join(path, MANIFEST)
    if not storage.exists(manifest_path):
        return False, "partial: no manifest.json (never committed; a save was interrupted or is running)", None
    try:
        manifest = CheckpointManifest.from_json(storage.read_text(manifest_path), manifest_path)
    except ManifestError as e:
        return False, f"bad manifest.json: {e.message}", None
    except (OSError, UnicodeDecodeError) as e:
        return False, f"unreadable manifest.json: {e}", None
    dir_step = parse_step(_basename(path))
    if dir_step is not None and dir_step != manifest.step:
        return False, f"manifest.json says step {manifest.step} but the directory is step {dir_step}", manifest
    problem = _check_files(path, storage, manifest.files) or _check_acks(manifest)
    return (problem is None), (problem or ""), manifest


def list_checkpoints(root: str, storage: CheckpointStorage | None = None) -> list[CheckpointInfo]:
    """Every ``step-N`` directory under ``root``, oldest first, each validated. [] if root is absent."""
    storage = storage or storage_for(root)
    infos = []
    for name in storage.listdir(root):
        step = parse_step(name)
        if step is None:
            continue
        path = storage.join(root, name)
        valid, reason, manifest = check_checkpoint(path, storage)
        try:
            size = storage.size_of_tree(path)
        except OSError:  # vanished under us (purged concurrently)
            size = 0
        infos.append(CheckpointInfo(step, path, valid, reason, manifest, size,
                                    manifest.created_at if manifest else None))
    return sorted(infos, key=lambda i: i.step)


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


def latest_valid(root: str, storage: CheckpointStorage | None = None) -> CheckpointInfo | None:
    """The newest valid checkpoint under ``root``, or None. Logs a warning for each newer invalid one."""
    for info in reversed(list_checkpoints(root, storage)):
        if info.valid:
            return info
        logger.warning("skipping checkpoint %s: %s; trying the previous one", info.path, info.reason)
    return None


def ensure_writable(root: str, storage: CheckpointStorage | None = None) -> None:
    """Create ``root`` and prove it writable before training starts (a probe file, then removed).

    Raises:
        CheckpointError: the root cannot be created or written, naming the path and the fix.
    """
    storage = storage or storage_for(root)
    probe = storage.join(root, f".write-probe-{time.time_ns()}")
    try:
        storage.makedirs(root)
        storage.write_text_atomic(probe, "ok\n")
        storage.remove_tree(probe)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint directory is not writable ({type(e).__name__}: {e}); set checkpoint.dir "
            "to a writable path or fix its permissions", root) from e


def commit(root: str, manifest: CheckpointManifest, storage: CheckpointStorage | None = None) -> str:
    """Commit ``step-N``: check that every rank acked and the files are whole, then write the manifest.

    The manifest goes last and atomically, so a crash at any point leaves either no checkpoint or a
    complete one; older checkpoints are never touched.

    Returns:
        The committed step directory.

    Raises:
        CheckpointError: ranks missing from ``ranks_acked``, shard files missing or truncated, or the
            manifest could not be written.
    """
    storage = storage or storage_for(root)
    path = storage.join(root, step_dir_name(manifest.step))
    problem = _check_acks(manifest) or _check_files(path, storage, manifest.files)
    if problem:
        raise CheckpointError(f"refusing to commit step {manifest.step}: {problem}", path)
    try:
        storage.write_text_atomic(storage.join(path, MANIFEST), manifest.to_json())
    except Exception as e:
        raise CheckpointError(
            f"could not write {MANIFEST} ({type(e).__name__}: {e}); the step stays uncommitted. "
            "Check that checkpoint.dir is writable and has space", path) from e
    logger.info("committed checkpoint %s (%s, data_cursor=%d)", path, manifest.mesh_str, manifest.data_cursor)
    return path


def prepare_step(root: str, step: int, storage: CheckpointStorage | None = None) -> str:
    """Driver, before the ranks save step N: remove a leftover ``step-N`` (an earlier, interrupted
    try), which would otherwise mix stale shards or a stale manifest with the new ones. Returns the path.
    """
    storage = storage or storage_for(root)
    path = storage.join(root, step_dir_name(step))
    try:
        if storage.exists(path):
            logger.warning("removing leftover %s before saving step %d again", path, step)
            storage.remove_tree(path)
        storage.makedirs(path)
    except Exception as e:
        raise CheckpointError(f"cannot prepare the step directory ({type(e).__name__}: {e}); check that "
                              "checkpoint.dir is writable", path) from e
    return path


def purge(root: str, keep: int, storage: CheckpointStorage | None = None) -> list[str]:
    """Delete all but the newest ``keep`` valid checkpoints, and leftovers older than the newest valid.

    Directories newer than the newest valid checkpoint are never touched: one may be a save in
    flight. ``keep <= 0`` keeps everything. A failed delete is logged and skipped (retried next time).

    Returns:
        The directories removed.
    """
    if keep <= 0:
        return []
    storage = storage or storage_for(root)
    infos = list_checkpoints(root, storage)
    valid_steps = [i.step for i in infos if i.valid]
    if not valid_steps:
        return []
    kept = set(valid_steps[-keep:])
    newest_valid = valid_steps[-1]
    removed = []
    for info in infos:
        if info.step in kept or info.step > newest_valid:
            continue
        try:
            storage.remove_tree(info.path)
            removed.append(info.path)
            logger.info("purged checkpoint dir %s (%s)", info.path, "old" if info.valid else info.reason)
        except Exception as e:  # keep going: one stuck directory must not stop the others or training
            logger.warning("could not delete %s (%s: %s); will retry at the next purge", info.path, type(e).__name__, e)
    return removed


class BackgroundPurger:
    """Runs :func:`purge` on a daemon thread so that deleting old checkpoints never stalls a step.

    Requests are queued; a failed purge is logged and the thread carries on with the next one.
    """

    def __init__(self, storage: CheckpointStorage | None = None) -> None:
        self._storage = storage
        self._queue: queue.Queue[tuple[str, int] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ckpt-purge", daemon=True)
        self._thread.start()

    def request(self, root: str, keep: int) -> None:
        """Queue a purge of ``root`` keeping the newest ``keep`` checkpoints; returns at once."""
        self._queue.put((root, keep))

    def wait_idle(self) -> None:  # block until every queued purge has run
        self._queue.join()

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued purges and stop the thread (waits at most ``timeout`` seconds)."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                root, keep = item
                purge(root, keep, self._storage)
            except Exception as e:
                logger.warning("checkpoint purge of %s failed (%s: %s); continuing", item, type(e).__name__, e)
            finally:
                self._queue.task_done()


def describe(path: str, storage: CheckpointStorage | None = None) -> dict[str, Any]:
    """Facts about one step directory for ``elastimesh ckpt inspect``; JSON-serialisable.

    Raises:
        CheckpointError: ``path`` does not exist.
    """
    storage, path = storage or storage_for(path), path.rstrip("/") or path
    if not storage.exists(path):
        raise CheckpointError("no such checkpoint directory: give one of the step directories that "
                              "`elastimesh ckpt list DIR` shows", path)
    valid, reason, manifest = check_checkpoint(path, storage)
    out: dict[str, Any] = {"path": path, "step": parse_step(_basename(path)), "valid": valid,
                           "reason": reason, "size_bytes": storage.size_of_tree(path)}
    if manifest is not None:
        out.update(manifest.to_dict(), created=_when(manifest.created_at))
    return out


def format_table(infos: list[CheckpointInfo]) -> str:
    """A plain-text table of checkpoints for ``elastimesh ckpt list`` (one line per step dir)."""
    rows = [("STEP", "VALID", "MESH", "SIZE", "CREATED", "PATH / REASON")]
    for i in infos:
        mesh = i.manifest.mesh_str if i.manifest else "-"
        created = _when(i.created_at) if i.created_at is not None else "-"
        note = i.path if i.valid else f"{i.path}  ({i.reason})"
        rows.append((str(i.step), "yes" if i.valid else "NO", mesh, _human(i.size_bytes), created, note))
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    return "\n".join("  ".join(r[c].ljust(widths[c]) for c in range(5)) + "  " + r[5] for r in rows)


def _check_acks(manifest: CheckpointManifest) -> str | None:
    missing = sorted(set(range(manifest.world_size)) - set(manifest.ranks_acked))
    return f"ranks {missing} of {manifest.world_size} never acked their shard" if missing else None


def _check_files(path: str, storage: CheckpointStorage, files: dict[str, int]) -> str | None:
    if not storage.exists(storage.join(path, DCP_METADATA)):
        return f"missing DCP {DCP_METADATA} (the shard write did not finish)"
    if not files:
        try:
            files = _sizes_from_dcp_metadata(path)
        except Exception as e:
            return f"unreadable DCP {DCP_METADATA} ({type(e).__name__}: {e})"
    for name, expected in sorted(files.items()):
        file_path = storage.join(path, name)
        try:
            actual = storage.file_size(file_path)
        except OSError:
            return f"shard file {name} is missing"
        if actual < expected:
            return f"shard file {name} is truncated ({actual} of {expected} bytes)"
    return None


def _sizes_from_dcp_metadata(path: str) -> dict[str, int]:
    # Only for manifests without a `files` map: imports torch.distributed.checkpoint (slow, and
    # something the driver otherwise avoids), so it is the fallback, not the normal path.
    from checkpoints.reader import read_metadata

    return expected_file_sizes(read_metadata(local_path(path) or path))


def _basename(path: str) -> str:
    return path.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1]


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
