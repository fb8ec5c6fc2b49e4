"""A generation's first compiled step: the peers of a rank that compiles for longer than the training
groups' timeout wait for it instead of failing (#36 item 10, ``RankGroups.collective_timeout``).

Two ranks at dp=2 whose groups time out after 2 s, plus a further group made with ``new_group`` (as the
pipeline-tied embedding's are). Rank 0 "compiles" 5 s before each collective. Inside
``collective_timeout(30)`` rank 1 waits in the dp all-reduce and in the further group's, and both
return; after it the groups' own 2 s are back, and the same skew fails rank 1 with gloo's timeout."""

from __future__ import annotations

import pytest

from testbed.gloo_world import run_ranks

TIMEOUT_S = 2.0
COMPILE_S = 5.0


def skewed_rank(rank: int, store_port: int) -> dict:
    import time

    import torch
    import torch.distributed as dist

    from meshspeak.mesh import MeshShape
    from workers.groups import build_process_groups

    groups = build_process_groups(store_addr="127.0.0.1", store_port=store_port, generation=1,
                                  shape=MeshShape(2, 1, 1), world_rank=rank, timeout_s=TIMEOUT_S,
                                  device=torch.device("cpu"), bind_ip="127.0.0.1")
    further = groups.new_group([0, 1], "gloo", TIMEOUT_S)
    out: dict = {}

    def reduce_after_compile(name: str) -> None:
        t = torch.ones(2)
        if rank == 0:
            time.sleep(COMPILE_S)
        try:
            dist.all_reduce(t, group=groups.dp_group)
            dist.all_reduce(t, group=further)
            out[name] = float(t[0])
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]

    for name, group in (("dp", groups.dp_group), ("further", further)):
        dist.all_reduce(torch.ones(1), group=group)  # connected before any wait
    with groups.collective_timeout(30.0):
        reduce_after_compile("inside")
    reduce_after_compile("after")
    groups.destroy()
    return out


@pytest.mark.timeout(120)
def test_peers_wait_for_a_compiling_rank_inside_the_raised_timeout_and_not_after():
    rank0, rank1 = run_ranks(2, skewed_rank, timeout=100)
    assert rank1["inside"] == 4.0 and rank0["inside"] == 4.0  # 1 + 1, twice
    assert isinstance(rank1["after"], str) and "timed out" in rank1["after"].lower(), rank1["after"]
