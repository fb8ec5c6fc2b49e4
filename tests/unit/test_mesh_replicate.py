"""HSDP / ZeRO-0 replica groups as pure data: meshspeak.dp_plan.replicate_degree and hsdp_group_ranks."""

from __future__ import annotations

import pytest

from meshspeak.mesh import MeshShape, hsdp_group_ranks
from meshspeak.dp_plan import replicate_degree


@pytest.mark.parametrize(
    ("zero", "dp", "cfg_dp", "cfg_r", "expected"),
    [
        (3, 4, 4, 1, 1),  # plain FSDP at any dp
        (3, 3, 4, 1, 1),
        (0, 4, 4, 1, 4),  # ZeRO-0: every rank a replica
        (0, 3, 4, 1, 3),
        (3, 4, 4, 2, 2),  # HSDP: shard groups of 2
        (3, 2, 4, 2, 1),  # a shrink dropped one whole replica
        (1, 6, 4, 2, 3),  # a grow added one
        (2, 3, 4, 2, 1),  # a partial replica: plain FSDP over all 3
        (3, 1, 4, 2, 1),  # fewer ranks than one replica
        (3, 8, 8, 8, 8),  # shard groups of one rank: every rank a replica
    ],
)
def test_replicate_degree_keeps_the_shard_group_size(zero, dp, cfg_dp, cfg_r, expected) -> None:
    assert replicate_degree(zero, dp, cfg_dp, cfg_r) == expected


def test_hsdp_groups_split_dp_into_replicas_of_consecutive_indices() -> None:
    shape = MeshShape(4, 1, 2)  # ranks: dp index d holds (2d, 2d+1) for tp 0, 1
    rep, shard = hsdp_group_ranks(shape, 2)
    # shard groups: dp indices {0,1} and {2,3}, per tp coordinate
    assert shard == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # replicate groups: the same shard index across replicas
    assert rep == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # the replicas of one dp group are exactly that group
    for members in shape.group_ranks("dp"):
        assert sorted(r for g in shard if g[0] in members for r in g) == members


def test_hsdp_groups_at_the_extremes_and_bad_input() -> None:
    shape = MeshShape(2, 2, 1)
    rep, shard = hsdp_group_ranks(shape, 2)  # ZeRO-0 at dp=2: shard groups of one rank
    assert shard == [[0], [1], [2], [3]] and rep == [[0, 2], [1, 3]]
    rep, shard = hsdp_group_ranks(shape, 1)
    assert shard == shape.group_ranks("dp") and rep == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="not divisible"):
        hsdp_group_ranks(MeshShape(3, 1, 1), 2)
