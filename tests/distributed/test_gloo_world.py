"""The one rank spawner's contract (testbed/gloo_world.py on testbed/rank_pool.py): results by rank, a
fresh world per run in the same processes, every failing rank's traceback, and no hang."""

from __future__ import annotations

import os

import pytest

from testbed.gloo_world import MeshRunError, run_ranks, run_world
from testbed.rank_pool import shutdown_pool


@pytest.fixture(scope="module", autouse=True)
def _worker_pool():
    yield
    shutdown_pool()


def sum_of_ranks(rank: int, world: int, scale: int) -> tuple[int, int, float, int]:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank * scale)])
    dist.all_reduce(value)  # over the default group run_world formed
    return rank, dist.get_world_size(), float(value), os.getpid()


def raise_on_rank_one(rank: int, world: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("injected failure on rank 1")
    dist.barrier()  # rank 0 waits for a peer that never comes


def store_round_trip(rank: int, port: int, key: str) -> str:
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    store.set(f"{key}/{rank}", str(rank))
    return store.get(f"{key}/{1 - rank}").decode()


@pytest.mark.timeout(240)
def test_run_world_returns_results_by_rank_in_the_same_processes() -> None:
    first = run_world(3, sum_of_ranks, 1)
    assert [r[:3] for r in first] == [(0, 3, 3.0), (1, 3, 3.0), (2, 3, 3.0)]
    second = run_world(2, sum_of_ranks, 10)  # a new default group (fresh store prefix) in the same ranks
    assert [r[:3] for r in second] == [(0, 2, 10.0), (1, 2, 10.0)]
    assert [r[3] for r in second] == [r[3] for r in first[:2]]


@pytest.mark.timeout(240)
def test_run_world_reports_the_failing_rank_and_does_not_hang() -> None:
    with pytest.raises(MeshRunError, match="injected failure on rank 1") as info:
        run_world(2, raise_on_rank_one, timeout=120)
    # Rank 1's group went down with it, so rank 0's barrier fails too (or it is killed in the grace time).
    assert "Traceback" in str(info.value) and 1 in info.value.raised
    assert run_world(2, sum_of_ranks, 1)[1][:3] == (1, 2, 1.0)  # the next run gets fresh processes


@pytest.mark.timeout(240)
def test_run_ranks_hands_every_rank_the_port_of_a_store_of_its_own() -> None:
    assert run_ranks(2, store_round_trip, "k", timeout=120) == ["1", "0"]
