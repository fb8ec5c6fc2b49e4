"""The run lease on a checkpoint directory (checkpoints/lease.py), on a temp dir with real threads.

A second driver watching a live lease sees it renewed and stops (LeaseHeldError naming the holder); a
lease whose holder died (its renewals stop, nothing released) is taken over once it expires, and the
old holder's fence (``check_held``) then refuses to write; a released lease is free at once. Short
leases (a fraction of a second) keep it quick; nothing asserts on elapsed time.
"""

from __future__ import annotations

import json

import pytest

from checkpoints.lease import LEASE_FILE, LeaseHeldError, LeaseLostError, RunLease
from checkpoints.storage import LocalStorage

LEASE_S = 0.6  # renewed every 0.1 s


def _kill(lease: RunLease) -> None:
    """What SIGKILL does to a holder: its renewals stop and nothing is released."""
    lease._stop.set()
    lease._thread.join()


def test_a_second_driver_on_a_live_lease_stops_naming_the_holder(tmp_path):
    first = RunLease(str(tmp_path), LEASE_S)
    first.acquire()
    try:
        second = RunLease(str(tmp_path), LEASE_S)
        with pytest.raises(LeaseHeldError) as info:
            second.acquire()
        assert first.holder in info.value.message and "another checkpoint.dir" in info.value.message
        assert json.loads((tmp_path / LEASE_FILE).read_text())["holder"] == first.holder
        first.check_held()  # untouched by the refused driver
    finally:
        first.release()
    assert not (tmp_path / LEASE_FILE).exists()


def test_a_dead_holders_lease_is_taken_over_after_it_expires_and_fences_the_old_holder(tmp_path):
    dead = RunLease(str(tmp_path), LEASE_S)
    dead.acquire()
    _kill(dead)
    heir = RunLease(str(tmp_path), LEASE_S)
    heir.acquire()  # waits out the lease, then takes it over
    try:
        assert json.loads((tmp_path / LEASE_FILE).read_text())["holder"] == heir.holder
        with pytest.raises(LeaseLostError, match=heir.holder):
            dead.check_held()  # had it come back (a partition healed), it must not write
        heir.check_held()
    finally:
        heir.release()


def test_a_renewing_holder_that_finds_another_holder_stops_renewing(tmp_path):
    holder = RunLease(str(tmp_path), LEASE_S)
    holder.acquire()
    other = RunLease(str(tmp_path), LEASE_S)
    LocalStorage().write_text_atomic(str(tmp_path / LEASE_FILE), other._record().to_json())  # taken over
    holder._thread.join(LEASE_S * 5)  # the next renewal sees it and stops
    assert not holder._thread.is_alive() and holder.lost_to == other.holder
    with pytest.raises(LeaseLostError):
        holder.check_held()
    holder.release()
    assert json.loads((tmp_path / LEASE_FILE).read_text())["holder"] == other.holder  # not removed: not ours


def test_a_released_lease_is_free_at_once_and_only_one_of_two_creates_wins(tmp_path):
    first = RunLease(str(tmp_path), 3600.0)  # a long lease: taking it must not wait for expiry
    first.acquire()
    first.release()
    again = RunLease(str(tmp_path), 3600.0)
    again.acquire()
    again.release()
    storage = LocalStorage()
    path = str(tmp_path / "x.json")
    assert storage.create_text_exclusive(path, "a") is True
    assert storage.create_text_exclusive(path, "b") is False
    assert (tmp_path / "x.json").read_text() == "a"


def test_an_unreadable_lease_file_is_waited_out_then_replaced(tmp_path):
    (tmp_path / LEASE_FILE).write_text("not json")
    lease = RunLease(str(tmp_path), LEASE_S)
    lease.acquire()
    try:
        assert json.loads((tmp_path / LEASE_FILE).read_text())["holder"] == lease.holder
    finally:
        lease.release()
