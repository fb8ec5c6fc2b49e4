"""The run lease: one driver at a time writes to a ``checkpoint.dir`` (no Ray, no torch).

Without it, two drivers on one directory (a retried ``ray job submit`` while the first driver still
lives) both adopt the newest manifest's run id and purge each other's saves. A lease is the file
``<root>/LEASE.json``: ``{"holder", "renewals", "renewed_at", "lease_s"}``. Its holder rewrites it
every ``lease_s / RENEWALS_PER_LEASE`` seconds (a background thread), and releases it on a clean exit.

Taking it (``RunLease.acquire``):
* no lease file: created with a conditional create (``O_EXCL`` locally, S3's ``If-None-Match: *``
  through fsspec's ``mode="create"``), so of two drivers starting together exactly one wins;
* a lease another driver renewed within ``lease_s`` by this machine's clock: watched for two renewal
  intervals; a renewal seen means its holder lives, and this driver stops (``LeaseHeldError``: bad
  input, exit 2, naming the holder). Watched without a renewal, the holder is taken for dead and the
  lease for stale: this driver waits out the rest of ``lease_s`` since the last change *it saw* (its own
  clock only: a skewed clock on the holder's machine cannot make a live lease look expired), then
  takes it over.
* a lease not renewed for ``lease_s``: watched for two renewal intervals too, then taken over.

A take-over is a plain overwrite (no store offers compare-and-swap on a changed object here), so the
fence is at the commit: ``check_held()`` re-reads the lease before each manifest is written and
before each purge, and a driver that finds another holder stops instead of writing (its lease was taken
while it was partitioned or stalled). Hand-written because neither fsspec nor torch offers a lease.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from checkpoints.errors import CheckpointError
from checkpoints.storage import CheckpointStorage, storage_for

logger = logging.getLogger(__name__)

LEASE_FILE = "LEASE.json"
RENEWALS_PER_LEASE = 6  # renew every lease_s / 6: a live holder is seen renewing within a third of lease_s


class LeaseHeldError(CheckpointError):
    """Another live driver holds the run lease on this checkpoint directory."""


class LeaseLostError(CheckpointError):
    """This driver's lease was taken over by another driver: it must not write any more."""


@dataclass(frozen=True)
class LeaseRecord:
    holder: str  # "<host>:<pid>:<random>": unique per driver process and lease
    renewals: int  # goes up at every renewal: what a watcher compares (never the clocks of two machines)
    renewed_at: float  # the holder's wall clock at the last renewal (shown to people, judged only as a hint)
    lease_s: float

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @staticmethod
    def from_json(text: str) -> LeaseRecord:
        data = json.loads(text)
        return LeaseRecord(str(data["holder"]), int(data["renewals"]), float(data["renewed_at"]),
                           float(data["lease_s"]))


def new_holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class RunLease:
    """The lease of one driver on one checkpoint root.

    Args:
        root: the checkpoint directory (local path or URI).
        lease_s: how long a silent holder keeps the lease (``checkpoint.lease_s``).
        storage: the root's storage (default: ``storage_for(root)``).
        clock, sleep: injectable for tests (monotonic seconds; never compared across machines).
    """

    def __init__(self, root: str, lease_s: float, storage: CheckpointStorage | None = None, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.root = root
        self.lease_s = float(lease_s)
        self.storage = storage or storage_for(root)
        self.path = self.storage.join(root, LEASE_FILE)
        self.holder = new_holder_id()
        self.clock, self.sleep = clock, sleep
        self._renewals = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost_to: str | None = None  # set when a renewal found another holder

    @property
    def renew_every_s(self) -> float:
        return self.lease_s / RENEWALS_PER_LEASE

    # -- taking and giving back ---------------------------------------------------------------------
    def acquire(self) -> None:
        """Take the lease (waiting out a stale one), then keep renewing it in the background.

        Raises:
            LeaseHeldError: another driver renewed it while this one watched.
        """
        if not self.storage.create_text_exclusive(self.path, self._record().to_json()):
            self._take_over(self._watch_current())
        self._renewals += 1
        self._thread = threading.Thread(target=self._renew_loop, name="run-lease", daemon=True)
        self._thread.start()

    def _watch_current(self) -> LeaseRecord | None:
        """Watch the lease until it proves stale (returns what was last read; None if it went away)
        or live (raises). The holder renews every ``lease_s / RENEWALS_PER_LEASE`` of *its* setting."""
        seen = self._read()
        if seen is None:
            return None
        renew_every = seen.lease_s / RENEWALS_PER_LEASE
        # The holder's wall clock only shortens the wait for a lease that looks long dead; a live holder
        # is still caught, since it renews within the two intervals watched whatever its clock says.
        looks_expired = time.time() - seen.renewed_at > seen.lease_s
        expires_at = self.clock() + (2 * renew_every if looks_expired else seen.lease_s)
        logger.warning("checkpoint.dir %s: run lease held by %s; waiting up to %.0f s for it to be renewed "
                       "(a live driver: exit) or to expire (a dead one: take it over)", self.root, seen.holder,
                       expires_at - self.clock())
        while self.clock() < expires_at:
            self.sleep(max(0.01, min(renew_every / 4, expires_at - self.clock())))
            current = self._read()
            if current is None:
                return None  # released meanwhile
            if current != seen:
                raise LeaseHeldError(_held_message(self.root, current), self.root)
        return seen

    def _take_over(self, stale: LeaseRecord | None) -> None:
        if stale is not None:
            logger.warning("checkpoint.dir %s: taking over the expired run lease of %s", self.root, stale.holder)
        self.storage.write_text_atomic(self.path, self._record().to_json())

    def release(self) -> None:
        """Stop renewing; remove the lease file if this driver still holds it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.lease_s)
            self._thread = None
            current = self._read()
            if current is not None and current.holder == self.holder:
                try:
                    self.storage.remove_tree(self.path)
                except OSError as exc:  # it expires on its own: a new driver waits lease_s at most
                    logger.warning("could not remove the run lease %s (%s)", self.path, exc)

    # -- holding --------------------------------------------------------------------------------------
    def check_held(self) -> None:
        """The fence before a manifest write or a purge.

        Raises:
            LeaseLostError: another driver holds the lease now.
        """
        current = self._read()
        if self.lost_to or (current is not None and current.holder != self.holder):
            holder = self.lost_to or current.holder
            raise LeaseLostError(f"the run lease on checkpoint.dir was taken over by {holder} (this driver "
                                 "was silent for longer than checkpoint.lease_s): stopping without writing",
                                 self.root)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_every_s):
            try:
                current = self._read()
                if current is not None and current.holder != self.holder:
                    self.lost_to = current.holder
                    logger.error("run lease on %s taken over by %s", self.root, current.holder)
                    return
                self._renewals += 1
                self.storage.write_text_atomic(self.path, self._record().to_json())
            except Exception as exc:  # a storage hiccup: the next renewal tries again
                logger.warning("run lease renewal on %s failed (%s: %s)", self.root, type(exc).__name__, exc)

    def _record(self) -> LeaseRecord:
        return LeaseRecord(self.holder, self._renewals, time.time(), self.lease_s)

    def _read(self) -> LeaseRecord | None:
        try:
            return LeaseRecord.from_json(self.storage.read_text(self.path))
        except (FileNotFoundError, OSError):
            return None
        except (ValueError, KeyError, TypeError):  # torn or foreign content: treat as a lease nobody renews
            return LeaseRecord("an unreadable lease file", -1, 0.0, self.lease_s)


def _held_message(root: str, record: LeaseRecord) -> str:
    return (f"checkpoint.dir {root} is in use by another driver, {record.holder} (it renewed its run lease "
            f"while this one waited): stop that run first, or give this run another checkpoint.dir (a driver "
            f"that died leaves its lease to expire {record.lease_s:.0f} s after its last renewal, "
            "checkpoint.lease_s)")
