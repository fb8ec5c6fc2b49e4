"""`elastimesh plan --memory-gib N`: the cheapest data-parallel strategy whose memory fits (pure).

"Cheapest" is in communication per step and FSDP unit (docs/design.md, Data-parallel strategies):
ZeRO-0 (one all-reduce) < ZeRO-2 < ZeRO-3 (one all-gather more), and at one level HSDP with more
replica groups (smaller shard groups: fewer ranks in each all-gather/reduce-scatter) before fewer.
ZeRO-1 is not offered: it runs as ZeRO-2. The memory is ``orchestrator.plan.mesh_plan.rank_memory``'s
estimate at the configured mesh, the largest over pipeline positions.
"""

from __future__ import annotations

import dataclasses

from meshspeak.sections import JobConfig
from orchestrator.plan.mesh_plan import make_plan, rank_memory


def candidates(dp: int) -> list[tuple[int, int]]:
    """(zero, dp_replicate) choices for ``dp`` ranks, cheapest first."""
    out = [(0, 1)]
    for zero in (2, 3):
        # R = dp would be shard groups of one rank: ZeRO-0's memory with more work; skip it.
        out += [(zero, r) for r in range(dp - 1, 0, -1) if dp % r == 0]
    return out


def peak_bytes(cfg: JobConfig) -> int:
    """The largest per-rank memory estimate over pipeline positions of ``cfg``'s mesh."""
    plan = make_plan(cfg)
    return max(sum(v for k, v in rank_memory(cfg, plan, p).items() if k != "peak_microbatches_in_flight")
               for p in range(plan.shape.pp))


def recommend(cfg: JobConfig, device_bytes: int) -> dict:
    """The first candidate that fits ``device_bytes``, with every candidate's estimate.

    Returns ``{"zero", "dp_replicate", "bytes", "fits", "options": [...]}``; when nothing fits,
    ``fits`` is False and the smallest-memory option is returned (``mesh.cpu_offload`` or a larger
    tp/pp is then the way out).
    """
    options = []
    for zero, r in candidates(cfg.mesh.dp):
        trial = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, zero=zero, dp_replicate=r))
        options.append({"zero": zero, "dp_replicate": r, "bytes": peak_bytes(trial)})
    fitting = [o for o in options if o["bytes"] <= device_bytes]
    best = fitting[0] if fitting else min(options, key=lambda o: o["bytes"])
    return {**best, "fits": bool(fitting), "device_bytes": device_bytes, "options": options}
