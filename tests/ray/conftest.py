"""Local-Ray fixtures: one embedded Ray and one pool of RankActors per test module.

Reusing the same actor processes across tests is deliberate: every test then also proves that
re-forming groups in long-lived processes works (and the pids let tests assert "no restart").
"""

from __future__ import annotations

import os
import pytest

ray = pytest.importorskip("ray")

from testbed.ray_cluster import make_group  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


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
