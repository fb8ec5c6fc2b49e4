"""Scaling decisions as data: which mesh to form from the actors that are alive (pure).

The elastic rule: pp x tp is fixed (a replica's shape); dp is the largest number of whole replicas the
live actors allow, capped by ``elastic.max_dp``, that also divides the global batch into whole
microbatches (the global batch never changes, so the loss curve does not either). Actors left over
stay as spares for a later grow.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.config import ConfigError, JobConfig, check_mesh, dp_bounds


@dataclass(frozen=True, slots=True)
class ResizeDecision:
    dp: int
    reason: str


@dataclass(frozen=True, slots=True)
class TooFewWorkers:
    best_dp: int
    message: str


def feasible_dp(cfg: JobConfig, dp: int) -> bool:
    try:
        check_mesh(cfg, dp, cfg.mesh.pp, cfg.mesh.tp)
    except ConfigError:
        return False
    return True


def choose_dp(cfg: JobConfig, live_actors: int, reason: str) -> ResizeDecision | TooFewWorkers:
    min_dp, max_dp = dp_bounds(cfg)
    replica = cfg.mesh.pp * cfg.mesh.tp
    best = min(live_actors // replica, max_dp)
    while best >= 1 and not feasible_dp(cfg, best):
        best -= 1
    if best < min_dp:
        return TooFewWorkers(
            best_dp=best,
            message=(
                f"{live_actors} live workers allow only dp={best} (pp*tp={replica} per replica), "
                f"below elastic.min_dp={min_dp}: add nodes or lower elastic.min_dp"
            ),
        )
    return ResizeDecision(dp=best, reason=reason)


def grow_target(cfg: JobConfig, current_dp: int, live_actors: int) -> int | None:
    """A larger dp the live actors allow, or None when growing is not possible/useful."""
    decision = choose_dp(cfg, live_actors, "grow")
    if isinstance(decision, ResizeDecision) and decision.dp > current_dp:
        return decision.dp
    return None



def fit_dp(cfg: JobConfig, wanted: int, live_actors: int) -> int:
    """The largest feasible dp <= ``wanted`` that ``live_actors`` can hold (a requested resize);
    0 when not even one replica fits. Unlike ``choose_dp`` it ignores ``elastic.max_dp``: an explicit
    request is the operator's call."""
    best = min(wanted, live_actors // (cfg.mesh.pp * cfg.mesh.tp))
    while best >= 1 and not feasible_dp(cfg, best):
        best -= 1
    return max(best, 0)
