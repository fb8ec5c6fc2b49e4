"""The driver's view of a checkpoint root: list, validate, pick the newest valid, commit, purge.

Driver side: no torch at import time (the driver never imports ``torch.distributed``). Validation
uses the manifest's ``files`` map (sizes the writing ranks reported) to spot missing or truncated
shards with a few ``stat`` calls. Only for training, and only without that map, does it read DCP's
``.metadata`` (lazy torch import): that file is a pickle, so the CLI (``read_dcp_metadata=False``)
never opens it — a crafted directory must not run code in ``elastimesh ckpt list``.

Ownership: each step directory names the run that made it (``.owner``, then the manifest's
``run_id``). Given a ``run_id``, resuming after a failure, purging and replacing a step consider only
that run's directories, and no function here ever deletes a committed checkpoint of another run.

Commit protocol: ranks write ``step-N/`` (DCP shards + ``.metadata``), each acks; then
:func:`commit` checks the acks and the files and writes ``manifest.json`` last and atomically.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Container
from dataclasses import dataclass

from checkpoints.errors import CheckpointError, ManifestError
from checkpoints.layout import DCP_METADATA, MANIFEST, OWNER, expected_file_sizes, parse_step, step_dir_name
from checkpoints.manifest import CheckpointManifest
from checkpoints.safe_pickle import UnsafeCheckpointError, check_metadata_file
from checkpoints.storage import CheckpointStorage, storage_for
from meshspeak.locations import local_path

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
    owner: str = ""
    """The run that made it: the manifest's ``run_id``, else the ``.owner`` marker; "" when unknown."""

    @property
    def committed(self) -> bool:  # a manifest was written, even if the files were damaged since
        return self.manifest is not None

    @property
    def dcp_path(self) -> str:
        """Where the committed attempt's DCP files are (the step directory for format-1 checkpoints)."""
        return dcp_path(self.path, self.manifest)


def dcp_path(step_path: str, manifest: CheckpointManifest | None) -> str:
    """The DCP directory of a committed step directory: its manifest's ``dcp_dir`` beneath it, if any."""
    if manifest is None or not manifest.dcp_dir:
        return step_path
    return f"{step_path.rstrip('/')}/{manifest.dcp_dir}"


def check_checkpoint(path: str, storage: CheckpointStorage | None = None, *, read_dcp_metadata: bool = True,
                     ) -> tuple[bool, str, CheckpointManifest | None]:
    """Validate one step directory. Returns ``(valid, reason, manifest_or_None)``; never raises for damage.

    ``read_dcp_metadata=False`` (the CLI) judges from the JSON manifest and file sizes only: a manifest
    without a ``files`` map is then valid with a note that the shard sizes were not checked.
    """
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
    dir_step = parse_step(dir_basename(path))
    if dir_step is not None and dir_step != manifest.step:
        return False, f"manifest.json says step {manifest.step} but the directory is step {dir_step}", manifest
    if not manifest.files and not read_dcp_metadata:
        problem = _check_acks(manifest)
        if problem is None and not storage.exists(storage.join(dcp_path(path, manifest), DCP_METADATA)):
            problem = f"missing DCP {DCP_METADATA} (the shard write did not finish)"
        note = "shard sizes not checked: manifest.json has no file map (DCP's pickled .metadata is not read here)"
        return (problem is None), (problem or note), manifest
    problem = _check_files(dcp_path(path, manifest), storage, manifest.files) or _check_acks(manifest)
    return (problem is None), (problem or ""), manifest


def list_checkpoints(root: str, storage: CheckpointStorage | None = None, *,
                     read_dcp_metadata: bool = True) -> list[CheckpointInfo]:
    """Every ``step-N`` directory under ``root``, oldest first, each validated. [] if root is absent.

    ``read_dcp_metadata``: see :func:`check_checkpoint` (False for the CLI).
    """
    storage = storage or storage_for(root)
    infos = []
    for name in storage.listdir(root):
        step = parse_step(name)
        if step is None:
            continue
        path = storage.join(root, name)
        valid, reason, manifest = check_checkpoint(path, storage, read_dcp_metadata=read_dcp_metadata)
        try:
            size = storage.size_of_tree(path)
        except OSError:  # vanished under us (purged concurrently)
            size = 0
        owner = manifest.run_id if manifest is not None and manifest.run_id else _read_owner(path, storage)
        infos.append(CheckpointInfo(step, path, valid, reason, manifest, size,
                                    manifest.created_at if manifest else None, owner))
    return sorted(infos, key=lambda i: i.step)


def latest_valid(
    root: str,
    storage: CheckpointStorage | None = None,
    *,
    run_id: str | None = None,
    among: Container[int] | None = None,
    on_skip: Callable[[CheckpointInfo], None] | None = None,
) -> CheckpointInfo | None:
    """The newest valid checkpoint under ``root``, or None: the one place that decides what to resume.

    Args:
        run_id: consider only that run's checkpoints; None: every run's.
        among: consider only these steps (e.g. the ones this run committed); None: every step.
        on_skip: called with each newer invalid checkpoint (of those considered) that was passed
            over; by default each is logged as a warning.
    """
    for info in reversed(list_checkpoints(root, storage)):
        if run_id is not None and info.owner != run_id:
            continue
        if among is not None and info.step not in among:
            continue
        if info.valid:
            return info
        if on_skip is None:
            logger.warning("skipping checkpoint %s: %s; trying the previous one", info.path, info.reason)
        else:
            on_skip(info)
    return None


def ensure_writable(root: str, storage: CheckpointStorage | None = None) -> None:
    """Create ``root`` and prove it writable before training starts (a probe file, then removed).

    Raises:
        CheckpointError: the root cannot be created or written, naming the path and the fix.
    """
    storage = storage or storage_for(root)
    probe = storage.join(root, f".write-probe-{time.time_ns()}")

    def write_probe() -> None:
        storage.makedirs(root)
        storage.write_text_atomic(probe, "ok\n")
        storage.remove_tree(probe)

    try:
        if storage.is_local:
            write_probe()
        else:
            _bounded(write_probe, REMOTE_PROBE_TIMEOUT_S)
    except TimeoutError:
        raise CheckpointError(
            f"checkpoint directory did not answer within {REMOTE_PROBE_TIMEOUT_S:g} s; check the bucket "
            "name, the endpoint (AWS_ENDPOINT_URL for S3-compatible stores) and the credentials", root) from None
    except Exception as e:
        raise CheckpointError(
            f"checkpoint directory is not writable ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
            "set checkpoint.dir to a writable path or bucket, or fix its permissions", root) from e


REMOTE_PROBE_TIMEOUT_S = 25.0  # an SDK retrying an unreachable endpoint would take minutes


def _bounded(fn, timeout_s: float) -> None:
    """Run ``fn`` in a daemon thread; TimeoutError if it neither returns nor raises in time."""
    import threading

    box: list = []

    def run() -> None:
        try:
            fn()
            box.append(None)
        except BaseException as exc:
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not box:
        raise TimeoutError
    if box[0] is not None:
        raise box[0]


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
    problem = _check_acks(manifest) or _check_files(dcp_path(path, manifest), storage, manifest.files)
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


def prepare_step(root: str, step: int, storage: CheckpointStorage | None = None, *, run_id: str = "") -> str:
    """Driver, before the ranks save step N: make ``step-N`` and mark it as run ``run_id``'s.

    A leftover ``step-N`` of this run (an interrupted try) or of no known run is removed first, since
    it would mix stale shards or a stale manifest with the new ones. A committed checkpoint, or a
    directory of another run (its save may be in progress), is never removed: that means two runs
    write to one ``checkpoint.dir``, which is refused.

    Returns:
        The step directory.

    Raises:
        CheckpointError: the directory is another run's or a committed checkpoint, or cannot be made.
    """
    storage = storage or storage_for(root)
    path = storage.join(root, step_dir_name(step))
    if storage.exists(path):
        valid, _, manifest = check_checkpoint(path, storage)
        owner = manifest.run_id if manifest is not None and manifest.run_id else _read_owner(path, storage)
        if valid or (owner and owner != run_id):
            whose = f"run {owner}" if owner else "an earlier run"
            raise CheckpointError(
                f"step {step} already holds {'a committed checkpoint' if valid else 'a save'} of {whose}: "
                "two runs are writing to this checkpoint.dir; give each run its own directory", path)
    try:
        if storage.exists(path):
            logger.warning("removing leftover %s before saving step %d again", path, step)
            storage.remove_tree(path)
        storage.makedirs(path)
        if run_id:
            storage.write_text_atomic(storage.join(path, OWNER), run_id + "\n")
    except Exception as e:
        raise CheckpointError(f"cannot prepare the step directory ({type(e).__name__}: {e}); check that "
                              "checkpoint.dir is writable", path) from e
    return path


def prepare_attempt(step_path: str, attempt: str, storage: CheckpointStorage | None = None) -> str:
    """Make the directory one save attempt of a step writes its DCP files to (``manifest.dcp_dir``).

    Raises:
        CheckpointError: it cannot be made.
    """
    storage = storage or storage_for(step_path)
    path = storage.join(step_path, attempt)
    try:
        storage.makedirs(path)
    except Exception as e:
        raise CheckpointError(f"cannot prepare the attempt directory ({type(e).__name__}: {e}); check that "
                              "checkpoint.dir is writable", path) from e
    return path


def purge(root: str, keep: int, storage: CheckpointStorage | None = None, *,
          run_id: str | None = None) -> list[str]:
    """Delete all but the newest ``keep`` valid checkpoints, and leftovers older than the newest valid.

    Directories newer than the newest valid checkpoint are never touched: one may be a save in
    flight. ``keep <= 0`` keeps everything. A failed delete is logged and skipped (retried next time).
    With ``run_id``, only that run's directories are counted and deleted: another run's never are.

    Returns:
        The directories removed.
    """
    if keep <= 0:
        return []
    storage = storage or storage_for(root)
    infos = list_checkpoints(root, storage)
    if run_id is not None:
        infos = [i for i in infos if i.owner == run_id]
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
        self._queue: queue.Queue[tuple[str, int, str | None] | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ckpt-purge", daemon=True)
        self._thread.start()

    def request(self, root: str, keep: int, run_id: str | None = None) -> None:
        """Queue a purge of ``root`` keeping the newest ``keep`` checkpoints (of ``run_id``); returns at once."""
        self._queue.put((root, keep, run_id))

    def wait_idle(self) -> None:  # block until every queued purge has run
        self._queue.join()

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued purges and stop the thread (waits at most ``timeout`` seconds). Idempotent: a
        second stop request would never be taken, and ``wait_idle`` would then wait for it forever."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                root, keep, run_id = item
                purge(root, keep, self._storage, run_id=run_id)
            except Exception as e:
                logger.warning("checkpoint purge of %s failed (%s: %s); continuing", item, type(e).__name__, e)
            finally:
                self._queue.task_done()


def _check_acks(manifest: CheckpointManifest) -> str | None:
    missing = sorted(set(range(manifest.world_size)) - set(manifest.ranks_acked))
    return f"ranks {missing} of {manifest.world_size} never acked their shard" if missing else None


def _check_files(path: str, storage: CheckpointStorage, files: dict[str, int]) -> str | None:
    if not storage.exists(storage.join(path, DCP_METADATA)):
        return f"missing DCP {DCP_METADATA} (the shard write did not finish)"
    if not files:
        try:
            files = _sizes_from_dcp_metadata(path)
        except UnsafeCheckpointError:
            raise  # not damage to skip over: a crafted checkpoint is refused (README, Trust boundary)
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
    # something the driver otherwise avoids), so it is the fallback, not the normal path. The pickle
    # is checked statically first, before torch is imported (checkpoints/safe_pickle.py).
    check_metadata_file(path)
    from checkpoints.reader import read_metadata

    return expected_file_sizes(read_metadata(local_path(path) or path))


def _read_owner(path: str, storage: CheckpointStorage) -> str:
    try:
        return storage.read_text(storage.join(path, OWNER)).strip()
    except (OSError, UnicodeDecodeError):
        return ""


def dir_basename(path: str) -> str:
    return path.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1]
