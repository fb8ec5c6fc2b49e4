"""Local-Ray fixtures: an embedded Ray (shared with the next module that asks, when this one left it
clean: testbed/shared_ray.py) and one pool of RankActors per test module.

Reusing the same actor processes across tests is deliberate: every test then also proves that
re-forming groups in long-lived processes works (and the pids let tests assert "no restart").
"""

from __future__ import annotations

import os
import pytest

ray = pytest.importorskip("ray")

from testbed import shared_ray  # noqa: E402
from testbed.ray_cluster import make_group  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    """The embedded Ray shared by the modules that ask for it (testbed/shared_ray.py): kept for the
    next one only if this module left nothing behind (``shared_ray.keep_if_clean``)."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    shared_ray.up()
    yield
    shared_ray.keep_if_clean()


@pytest.fixture(scope="module")
def store_address(ray_local):
    from workers.store import StoreHost

    host = StoreHost.remote()
    yield ray.get(host.address.remote(), timeout=60)
    ray.kill(host)


@pytest.fixture(scope="module")
def pool4(ray_local):
    group = make_group(4)
    yield group
    group.shutdown()
