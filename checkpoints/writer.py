"""Background checkpoint writes for one rank (worker side; torch).

``save`` returns as soon as the rank's shard is staged into CPU memory (the only part the training
step pays for); ``dcp.save`` then writes it on the writer's own thread (one per writer, started once).
With ``stage_in_background=True`` it returns even sooner, once the state dict is built: the copy into
the staging buffers runs on that thread too, overlapping the next step's forward and backward, which
only read the parameters. The caller must then call :meth:`AsyncCheckpointWriter.wait_staged` before
anything writes the saved tensors (the optimizer step, a load), as torchtitan calls
``maybe_wait_for_staging()`` before ``optimizer.step()``. The state dict itself is always built on the
caller's thread, at the step boundary: during a forward FSDP2 swaps the modules' parameters for
unsharded ones, so a state dict taken then would be wrong.

Why not ``dcp.async_save``: it makes a new thread per save and, with background staging, starts its
staging thread before returning; on a 2-core machine the GIL hand-offs between those threads and the
caller cost 5-10 ms per save (measured; bench/checkpoint_stall.py), more than building the state dict.
Submitting to an idle thread that already exists costs microseconds. Rules this module enforces:

* at most one save in flight: the next ``save`` first waits for the previous one, which is also
  what makes reusing the staging buffers safe;
* a background failure is never lost and reported once: it is logged when it happens and set on the
  returned future; if nobody read it from there, the next ``save``/``wait_for_previous`` raises it
  as :class:`CheckpointError`. ``last_error`` keeps the latest failure either way;
* the asynchronous collectives (DCP's plan exchange) run on a process group of their own. On the
  training group they interleave with training collectives and gloo aborts the process
  (docs/design.md, "Async saves need their own group, in thread mode"), so that case is refused.

A thread, not a process: DCP's process mode keeps a daemon bound to the world it started with, which
breaks after an elastic resize (the same fact). The staging copies and their buffers are
``checkpoints.staging``'s (on GPU: a copy stream of their own; abandoned saves' buffers released).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from checkpoints.errors import CheckpointError, summarize_failure
from checkpoints.layout import DCP_METADATA, expected_file_sizes
from checkpoints.staging import Stager
from checkpoints.storage import storage_for
from meshspeak.locations import local_path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveTiming:
    """How one save went, delivered by its future once the shard is durably written."""

    stall_s: float
    """Seconds ``save`` blocked the caller: waiting for the previous save plus staging to CPU."""
    write_s: float
    """Seconds from the end of staging until the checkpoint was written (the background part)."""
    path: str = ""
    files: dict[str, int] = field(default_factory=dict)
    """Minimum size of each file of the checkpoint (all ranks' shards and ``.metadata``), for the
    manifest's ``files`` so the driver can validate it without torch."""
    waited_s: float = 0.0
    """Part of ``stall_s`` spent waiting for the previous save to finish."""
    staging_s: float = 0.0
    """Seconds the copy into the staging buffers took on the staging thread (background staging
    only; 0 when ``save`` staged before returning, and then part of ``stall_s``)."""


class SaveFuture(Future):
    """A ``Future[SaveTiming]`` that remembers whether its outcome was read (to report failures once)."""

    observed = False

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(timeout)
        finally:
            self.observed = self.observed or self.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return super().exception(timeout)
        finally:
            self.observed = self.observed or self.done()


# The slowest storage a checkpoint waits for (a throttled bucket, a busy NFS server), and the least time
# any checkpoint collective is given: DCP's save and load wait in them for the slowest rank's storage.
SLOWEST_STORAGE_BYTES_PER_S = 1e6
CHECKPOINT_COLLECTIVE_FLOOR_S = 600.0


def checkpoint_group_timeout_s(state_bytes: int, collective_timeout_s: float) -> float:
    """The checkpoint group's timeout for a rank holding ``state_bytes``: its write or read at
    ``SLOWEST_STORAGE_BYTES_PER_S`` on top of ``CHECKPOINT_COLLECTIVE_FLOOR_S``, never below
    ``collective_timeout_s``."""
    return max(collective_timeout_s, CHECKPOINT_COLLECTIVE_FLOOR_S + state_bytes / SLOWEST_STORAGE_BYTES_PER_S)


def dcp_writer(path: str) -> dcp.StorageWriter:
    """DCP writer for a local/shared path (``FileSystemWriter``) or any fsspec URI (``FsspecWriter``)."""
    lp = local_path(path)
    if lp is not None:
        return dcp.FileSystemWriter(lp, single_file_per_rank=True, sync_files=True, overwrite=True)
    # Not exported from torch.distributed.checkpoint in torch 2.13; this module path is stable since 2.3.
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    # sync_files would call os.sync() for streams without a fileno (every object store): useless there.
    return FsspecWriter(path, sync_files=False, overwrite=True)


class AsyncCheckpointWriter:
    """Saves one rank's shard of a checkpoint, asynchronously by default.

    Args:
        process_group: the group DCP coordinates on. For async saves it must be a group dedicated to
            checkpointing (``dist.new_group(backend="gloo")`` made with the generation's groups),
            never the training group. None when torch.distributed is not initialised (one process).
        use_async: False writes synchronously with ``dcp.save``.
        pin_memory: pin the staging buffers (default: when CUDA is available).
        stage_in_background: copy into the staging buffers on the staging thread as well; the
            caller then owes a :meth:`wait_staged` before modifying the saved state.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, use_async: bool = True,
                 *, pin_memory: bool | None = None, stage_in_background: bool = False) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        if use_async and distributed and (process_group is None or process_group is dist.group.WORLD):
            raise ValueError(
                "async checkpoint saves need a dedicated process group (dist.new_group(backend='gloo')); "
                "on the default/training group gloo aborts the process with a collective mismatch")
        self.process_group = process_group
        self.use_async = use_async
        self._no_dist = not distributed
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._background = use_async and stage_in_background
        # One stager and one thread for the writer's lifetime (made at the first save): the stager
        # caches a CPU buffer per source storage and copies into it again on the next save.
        self._stager: Stager | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._pending: SaveFuture | None = None
        self._staging: Future | None = None  # the in-flight save's staging completion
        self.fence_wait_s = 0.0
        """Seconds :meth:`wait_staged` blocked for the latest save (its share of the step's stall)."""
        self.last_error: BaseException | None = None
        """The most recent failure of any save (kept after it was raised, for status reports)."""

    def _ensure_resources(self) -> tuple[Stager, ThreadPoolExecutor]:
        if self._stager is None:
            self._stager = Stager(self._pin)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-write")
        return self._stager, self._thread

    def wait_staged(self) -> float:
        """Block until the latest save's state is copied into the staging buffers; returns seconds.

        Call before anything modifies the saved tensors in place (optimizer step, load). Free when
        staging already finished or nothing is staging. A staging failure is not raised here: it
        fails the save's future, which reports it.
        """
        staging, self._staging = self._staging, None
        if staging is None or staging.done():
            return 0.0
        t0 = time.monotonic()
        try:
            staging.result()
        except BaseException:  # reported by the save's future
            pass
        waited = time.monotonic() - t0
        self.fence_wait_s += waited
        return waited

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def wait_for_previous(self, timeout: float | None = None) -> SaveTiming | None:
        """Block until the previous save finished. Returns its timing, or None if there was none.

        Raises:
            CheckpointError: the previous save failed and its future's outcome was never read, or it
                did not finish within ``timeout`` seconds (it stays pending).
        """
        pending = self._pending
        if pending is None:
            return None
        already_reported = pending.observed
        try:
            timing = pending.result(timeout=timeout)
        except TimeoutError:
            raise CheckpointError(f"previous checkpoint save still running after {timeout}s") from None
        except BaseException as e:
            self._pending = None
            if already_reported:  # the caller got it from the future already
                return None
            if isinstance(e, CheckpointError):
                raise CheckpointError(f"previous checkpoint save failed: {e.message}", e.path) from e
            raise CheckpointError(f"previous checkpoint save failed: {summarize_failure(e)}") from e
        self._pending = None
        return timing

    def save(self, state: dict[str, Any], path: str) -> SaveFuture:
        """Save ``state`` (e.g. :func:`checkpoints.state.training_state`) as this rank's shard of ``path``.

        All ranks of the process group must call it with the same path. Returns once the state is
        copied to CPU memory (async) or written (sync); training may then modify the parameters.
        With ``stage_in_background`` it returns once the state dict is built: call
        :meth:`wait_staged` before modifying the parameters or optimizer state.

        Raises:
            CheckpointError: the previous save failed, or staging / the synchronous write failed.
        """
        t0 = time.monotonic()
        self.wait_for_previous()
        self._staging, self.fence_wait_s = None, 0.0
        waited = time.monotonic() - t0
        writer = dcp_writer(path)
        kwargs: dict[str, Any] = dict(storage_writer=writer, process_group=self.process_group, no_dist=self._no_dist)
        try:
            if not self.use_async:
                metadata = dcp.save(state, **kwargs)
                elapsed = time.monotonic() - t0
                done = SaveFuture()
                done.set_result(SaveTiming(elapsed, elapsed - waited, path, self._files(metadata, path), waited))
                return done
            stager, thread = self._ensure_resources()
            # At the step boundary, on this thread: Stateful objects -> plain dicts of tensors.
            plain = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}
            ready = stager.mark()
            if not self._background:
                plain = stager.stage(plain, ready)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            self.last_error = e
            raise CheckpointError(f"checkpoint save failed: {summarize_failure(e)}", path) from e
        staged = time.monotonic()
        out, staging = SaveFuture(), Future()
        if not self._background:
            staging.set_result(0.0)
        self._staging = staging

        def write() -> None:  # on the writer thread
            try:
                snapshot = plain
                if not staging.done():
                    snapshot = stager.stage(plain, ready)
                    staging.set_result(time.monotonic() - staged)
                metadata = dcp.save(snapshot, **kwargs)
                out.set_result(SaveTiming(staged - t0, time.monotonic() - staged, path,
                                          self._files(metadata, path), waited, staging.result()))
            except BaseException as e:
                if not staging.done():
                    staging.set_exception(e)
                self.last_error = e
                logger.error("background checkpoint write to %s failed: %s", path, summarize_failure(e))
                out.set_exception(CheckpointError(f"background checkpoint write failed: {summarize_failure(e)}", path))

        thread.submit(write)
        self._pending = out
        return out

    def abandon(self, release: bool = False) -> None:
        """Forget an in-flight save without waiting (its group is being torn down in a rebuild).

        The abandoned write may still be reading the staging buffers and may stay blocked in a
        collective of the dead group until its timeout: its stager and thread are then handed over
        to it, closed when it ends, and the next save makes new ones. With nothing in flight they
        are kept for the next save, unless ``release`` (the writer is being dropped): closed now.
        """
        pending, self._pending, self._staging = self._pending, None, None
        stager, thread = self._stager, self._thread
        if pending is not None and not pending.done():
            logger.warning("abandoning an unfinished checkpoint save; it will not be committed")
            self._stager = self._thread = None
            if thread is not None:
                thread.shutdown(wait=False)
            if stager is not None:
                pending.add_done_callback(lambda _: stager.close())
        elif release:
            self._stager = self._thread = None
            if thread is not None:
                thread.shutdown(wait=False)
            if stager is not None:
                stager.close()

    def close(self, timeout: float | None = None) -> None:
        """Wait for the last save (raising its failure) and free the staging buffers."""
        try:
            self.wait_for_previous(timeout)
        finally:
            if self._thread is not None:
                self._thread.shutdown(wait=False)
            if self._stager is not None:
                self._stager.close()
            self._stager = self._thread = None

    @staticmethod
    def _files(metadata: Any, path: str) -> dict[str, int]:
        files = expected_file_sizes(metadata)
        storage = storage_for(path)
        files[DCP_METADATA] = storage.file_size(storage.join(path, DCP_METADATA))
        return files
