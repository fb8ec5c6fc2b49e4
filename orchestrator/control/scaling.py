"""Scaling decisions as data: which mesh to form from the actors that are alive (pure).

The elastic rule: pp x tp is fixed (a replica's shape); dp is the largest number of whole replicas the
live actors allow, capped by ``elastic.max_dp``, that also divides the global batch into whole
microbatches (the global batch never changes, so the loss curve does not either). Actors left over
stay as spares for a later grow. ``elastic.spares`` of them are hot spares: kept out of a grow, taken
in after a failure (so a lost rank costs no dp while one is left), and counted in what to start.

``ScalingPolicy`` answers the controller's scaling questions with decisions — ``ResizeDecision``
(form a mesh of this dp), ``NoResize`` (keep the mesh), ``TooFewWorkers`` (stop) — and the numbers of
actors to start; the controller gathers the counts (live actors, free slots) and carries the
decisions out. Failures are decided in ``orchestrator.recovery.failure_policy``.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshspeak.schema import ConfigError
from meshspeak.sections import JobConfig, dp_bounds
from orchestrator.config.validate import check_mesh


@dataclass(frozen=True, slots=True)
class ResizeDecision:
    dp: int
    reason: str


@dataclass(frozen=True, slots=True)
class NoResize:
    """Keep the current mesh."""


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
    """The mesh after a failure, preemption or eviction: the largest feasible dp up to
    ``elastic.max_dp`` (``fit_dp``), unless that is below ``elastic.min_dp``."""
    min_dp, max_dp = dp_bounds(cfg)
    replica = cfg.mesh.pp * cfg.mesh.tp
    best = fit_dp(cfg, max_dp, live_actors)
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
    """The largest feasible dp <= ``wanted`` that ``live_actors`` can hold; 0 when not even one
    replica fits. A requested resize asks it with the dp requested (beyond ``elastic.max_dp``: an
    explicit request is the operator's call), ``choose_dp`` with ``elastic.max_dp``."""
    best = min(wanted, live_actors // (cfg.mesh.pp * cfg.mesh.tp))
    while best >= 1 and not feasible_dp(cfg, best):
        best -= 1
    return max(best, 0)


class ScalingPolicy:
    """The controller's scaling decisions for one job (see the module docstring)."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.replica = cfg.mesh.pp * cfg.mesh.tp
        self.spares = cfg.elastic.spares

    def start(self) -> ResizeDecision:
        return ResizeDecision(dp=self.cfg.mesh.dp, reason="start")

    def after_failure(self, live_actors: int) -> ResizeDecision | TooFewWorkers:
        """The mesh to rebuild after a failure from the actors still alive."""
        return choose_dp(self.cfg, live_actors, "failure")

    def after_preemption(self, live_actors: int) -> ResizeDecision | TooFewWorkers:
        """The mesh to re-form from the actors left once a draining node's actors are dropped."""
        return choose_dp(self.cfg, live_actors, "preemption")

    def missing_for(self, dp: int, live_actors: int) -> int:
        """Actors to start before a requested resize to ``dp`` (<= 0: none)."""
        return dp * self.replica - live_actors

    def requested(self, dp: int, live_actors: int) -> ResizeDecision | TooFewWorkers:
        """A requested resize (tests, operators), once the missing actors were started if they could
        be: the largest feasible dp <= ``dp`` the live actors hold (``fit_dp``)."""
        fitted = fit_dp(self.cfg, dp, live_actors)
        if fitted < 1:
            return TooFewWorkers(best_dp=0, message=(
                f"resize to dp={dp}: {live_actors} live workers hold no whole replica that divides "
                "train.global_batch_size: add nodes"))
        return ResizeDecision(dp=fitted, reason="requested")

    def actors_to_adopt(self, live_actors: int, free_slots) -> int:
        """How many actors to start on capacity that appeared (autoscaler, replacement node): whole
        replicas, up to ``elastic.max_dp`` of them. ``free_slots`` (a callable: the probe asks Ray)
        is called only when more actors are wanted at all."""
        _, max_dp = dp_bounds(self.cfg)
        wanted = max_dp * self.replica + self.spares - live_actors
        if wanted <= 0:
            return 0
        count = min(wanted, free_slots())
        return count - count % self.replica if count >= self.replica else 0

    def grow(self, current_dp: int, live_actors: int) -> ResizeDecision | NoResize:
        """Grow to a larger dp when the live actors allow one, else keep the mesh."""
        target = grow_target(self.cfg, current_dp, live_actors - self.spares)
        return NoResize() if target is None else ResizeDecision(dp=target, reason="grow")
