"""The mesh plan as pure data: rank <-> (dp, pp, tp) coordinates, group member lists, stage split.

Nothing here starts a process or imports torch/ray, so every rule is unit-tested directly.

Rank order puts TP innermost, then PP, then DP (rank = (dp * pp_size + pp) * tp_size + tp), the same
order as ``init_device_mesh(("dp", "pp", "tp"))``, so the ranks of one TP group are adjacent;
``orchestrator.plan.placement`` gives each TP group actors of one node, where TP's per-layer collectives
are cheapest.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class MeshAxis(StrEnum):
    """A DeviceMesh axis. We say *axis* for a mesh axis and *dim* for a tensor dimension."""

    DP = "dp"
    PP = "pp"
    TP = "tp"


@dataclass(frozen=True, slots=True)
class RankCoords:
    dp: int
    pp: int
    tp: int

    def __str__(self) -> str:
        return f"dp={self.dp} pp={self.pp} tp={self.tp}"


@dataclass(frozen=True, slots=True)
class MeshShape:
    dp: int
    pp: int
    tp: int

    def __post_init__(self) -> None:
        for axis in MeshAxis:
            if getattr(self, axis) < 1:
                raise ValueError(f"mesh.{axis} must be >= 1, got {getattr(self, axis)}")

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    def coords(self, world_rank: int) -> RankCoords:
        if not 0 <= world_rank < self.world:
            raise ValueError(f"rank {world_rank} outside a world of {self.world}")
        tp = world_rank % self.tp
        pp = (world_rank // self.tp) % self.pp
        dp = world_rank // (self.tp * self.pp)
        return RankCoords(dp=dp, pp=pp, tp=tp)

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    def group_ranks(self, axis: MeshAxis) -> list[list[int]]:
        """Member lists of every group along ``axis`` (each list ordered by that axis' index)."""
        groups: dict[tuple[int, int], list[int]] = {}
        for rank in range(self.world):
            c = self.coords(rank)
            key = {
                MeshAxis.DP: (c.pp, c.tp),
                MeshAxis.PP: (c.dp, c.tp),
                MeshAxis.TP: (c.dp, c.pp),
            }[MeshAxis(axis)]
            groups.setdefault(key, []).append(rank)
        return [groups[k] for k in sorted(groups)]

    def replica_ranks(self, dp: int) -> list[int]:
        """All pp*tp ranks of one data-parallel replica: the unit that elastic resizing adds or drops."""
        return [self.rank_of(dp, p, t) for p in range(self.pp) for t in range(self.tp)]

    def as_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp}

    def __str__(self) -> str:
        return f"dp={self.dp} pp={self.pp} tp={self.tp}"


def stage_param_counts(
    n_layers: int, layer_params: int, embed_params: int, head_params: int
) -> list[int]:
    """Per-layer cost list used for balancing: the embedding rides on layer 0, the head on the last."""
    costs = [layer_params] * n_layers
    costs[0] += embed_params
    costs[-1] += head_params
    return costs


def balanced_split(costs: list[int], num_stages: int) -> list[int]:
    """Split consecutive layers into ``num_stages`` non-empty groups minimising the largest group cost.

    Returns the number of layers per stage. Exact (binary search on the bottleneck + greedy), which is
    cheap for any realistic layer count, so `elastimesh plan` shows the same split the actors build.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} non-empty stages")

    def fits(limit: int) -> list[int] | None:
        # Greedy left to right, but leave at least one layer for each remaining stage.
        sizes: list[int] = []
        i = 0
        for stage in range(num_stages):
            remaining_stages = num_stages - stage - 1
            total, count = 0, 0
            while i < n - remaining_stages and (count == 0 or total + costs[i] <= limit):
                if costs[i] > limit:
                    return None
                total += costs[i]
                count += 1
                i += 1
            sizes.append(count)
        return sizes if i == n else None

    lo, hi = max(costs), sum(costs)
    best = fits(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        found = fits(mid)
        if found is None:
            lo = mid + 1
        else:
            hi, best = mid, found
    result = fits(lo) or best
    assert result is not None and sum(result) == n
    return result


def layer_ranges(layers_per_stage: list[int]) -> list[tuple[int, int]]:
    """[(first_layer, end_layer_exclusive)] per stage."""
    out, start = [], 0
    for count in layers_per_stage:
        out.append((start, start + count))
        start += count
    return out


def fsdp_units(block_bytes: list[int], min_unit_bytes: int) -> list[list[int]]:
    """Group a stage's blocks (by position) into FSDP units of at least ``min_unit_bytes`` each.

    Every unit is one all-gather (forward, and again in backward under ZeRO-3) and one reduce-scatter
    per step, and on gloo each costs far more in fixed latency than in bytes for small blocks
    (bench/ray_train_compare.py: 4 one-MB blocks sharded separately ran 1.5-1.8x slower than as one
    unit). So consecutive blocks share a unit until it reaches the size, the way FSDP1's size-based
    auto-wrap policy and DDP's ``bucket_cap_mb`` group small tensors. A trailing remainder below the
    size joins the previous unit; if all blocks together are below it, the result is empty and the
    blocks stay in the stage's root unit (with the embedding and head). ``min_unit_bytes == 0`` gives
    one unit per block (TorchTitan's wrapping): every block alone already reaches the size.
    """
    if min_unit_bytes < 0:
        raise ValueError(f"min_unit_bytes must be >= 0, got {min_unit_bytes}")
    units: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, nbytes in enumerate(block_bytes):
        current.append(i)
        size += nbytes
        if size >= min_unit_bytes:
            units.append(current)
            current, size = [], 0
    if current and units:
        units[-1].extend(current)
    return units


def same_shard_ranks(shape: MeshShape, replicate: int) -> list[int]:
    """For each world rank, the lowest rank that holds the same training state: with ``replicate`` R
    replica groups of the dp axis (HSDP; R = dp under ZeRO-0), dp index d = r * S + s holds shard s
    of its (pp, tp) position, as every other replica's rank of that shard does (``hsdp_group_ranks``);
    with R = 1 every rank holds its own. A lost rank's state can be read from any rank of its class.
    """
    if replicate < 1 or shape.dp % replicate:
        raise ValueError(f"dp={shape.dp} is not divisible into {replicate} replicas")
    shard = shape.dp // replicate
    out = []
    for rank in range(shape.world):
        c = shape.coords(rank)
        out.append(shape.rank_of(c.dp % shard, c.pp, c.tp))
    return out


def hsdp_group_ranks(shape: MeshShape, replicate: int) -> tuple[list[list[int]], list[list[int]]]:
    """(replicate groups, shard groups) of the dp axis split as (replicate, dp / replicate).

    dp index d = r * S + s (S = dp / replicate): a shard group is S consecutive dp indices (one
    replica), a replicate group takes the same shard index s from every replica. Each list is
    ordered by its axis index, the order ``DeviceMesh`` expects for the (replicate, shard, pp, tp)
    layout ``arange(world).view(replicate, S, pp, tp)``.
    """
    if replicate < 1 or shape.dp % replicate:
        raise ValueError(f"dp={shape.dp} is not divisible into {replicate} replicas")
    shard = shape.dp // replicate
    rep_groups, shard_groups = [], []
    for p in range(shape.pp):
        for t in range(shape.tp):
            for s in range(shard):
                rep_groups.append([shape.rank_of(r * shard + s, p, t) for r in range(replicate)])
            for r in range(replicate):
                shard_groups.append([shape.rank_of(r * shard + s, p, t) for s in range(shard)])
    return sorted(rep_groups), sorted(shard_groups)
