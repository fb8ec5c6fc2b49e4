"""The run lease on ``s3://`` (checkpoints/lease.py), against moto's real S3 server: the same lease
as on a local directory, taken with S3's conditional create (``If-None-Match: *``) and read back
through s3fs, whose listing and file caches must not hide another driver's renewals.

A second driver on a live lease stops naming the holder and leaves the lease as it was; a dead
holder's lease (renewals stopped, nothing released) is taken over after it expires and fences the old
holder; of two conditional creates exactly one wins; a released lease is free at once.
"""

from __future__ import annotations

import json

import pytest

from checkpoints.lease import LEASE_FILE, LeaseHeldError, LeaseLostError, RunLease
from checkpoints.storage import storage_for

LEASE_S = 1.2  # renewed every 0.2 s: short, yet many HTTP round trips to moto per renewal interval


@pytest.fixture(scope="module")
def bucket():
    from testbed.s3 import MotoS3

    moto = MotoS3()
    moto.use()
    try:
        moto.filesystem().mkdir("leases")
        yield moto
    finally:
        moto.close()


def _kill(lease: RunLease) -> None:
    """What SIGKILL does to a holder: its renewals stop and nothing is released."""
    lease._stop.set()
    lease._thread.join()


def _holder_on_s3(moto, root: str) -> str:
    return json.loads(moto.filesystem().cat_file(f"{root[len('s3://'):]}/{LEASE_FILE}"))["holder"]


@pytest.mark.timeout(120)
def test_a_second_driver_on_a_live_s3_lease_stops_and_a_dead_holders_lease_is_taken_over(bucket):
    root = "s3://leases/run-a"
    first = RunLease(root, LEASE_S)
    first.acquire()
    second = RunLease(root, LEASE_S)
    with pytest.raises(LeaseHeldError) as info:
        second.acquire()
    assert first.holder in info.value.message
    assert _holder_on_s3(bucket, root) == first.holder
    first.check_held()  # untouched by the refused driver
    _kill(first)
    heir = RunLease(root, LEASE_S)
    heir.acquire()  # watches, sees no renewal, waits out the lease, takes it over
    try:
        assert _holder_on_s3(bucket, root) == heir.holder
        with pytest.raises(LeaseLostError, match=heir.holder):
            first.check_held()
        heir.check_held()
    finally:
        heir.release()
    assert not bucket.filesystem().exists(f"leases/run-a/{LEASE_FILE}")


@pytest.mark.timeout(60)
def test_on_s3_only_one_of_two_conditional_creates_wins_and_a_released_lease_is_free_at_once(bucket):
    storage = storage_for("s3://leases/run-b")
    path = "s3://leases/run-b/x.json"
    assert storage.create_text_exclusive(path, "a") is True
    assert storage.create_text_exclusive(path, "b") is False
    assert bucket.filesystem().cat_file("leases/run-b/x.json") == b"a"
    first = RunLease("s3://leases/run-b", 3600.0)  # a long lease: taking it must not wait for expiry
    first.acquire()
    first.release()
    again = RunLease("s3://leases/run-b", 3600.0)
    again.acquire()
    again.release()
