"""Scaling decisions as data: which mesh to form from the actors that are alive (pure).

The elastic rule: pp x tp is fixed (a replica's shape); dp is the largest number of whole replicas the
live actors allow, capped by ``elastic.max_dp``, that also divides the global batch into whole
microbatches (the global batch never changes, so the loss curve does not either). Actors left over
stay as spares for a later grow. ``elastic.spares`` of them are hot spares: kept out of a grow, taken
in after a failure (so a lost rank costs no dp while one is left), and counted in what to start.

``ScalingPolicy`` answers the controller's scaling questions with decisions — ``ResizeDecision``
(form a mesh of this dp), ``NoResize`` (keep the mesh), ``TooFewWorkers`` (stop) — and the numbers of
actors to start; the controller gathers the counts (live actors, free slots) and carries the
decisions out. It holds the job's ``mesh`` and ``elastic`` sections and a check of whether the job
fits a dp (``fits``): the mesh rules span the model, pipeline and train sections
(``check_mesh`` in orchestrator/config/validate.py), so ``policy_for(cfg)`` hands it ``feasible_dp`` bound to
the job. Failures are decided in ``orchestrator.recovery.failure_policy``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from meshspeak.schema import ConfigError
from meshspeak.sections import ElasticConfig, JobConfig, MeshConfig, dp_bounds
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
    """Whether the job fits a (dp, mesh.pp, mesh.tp) mesh (validate.check_mesh)."""
    try:
        check_mesh(cfg, dp, cfg.mesh.pp, cfg.mesh.tp)
    except ConfigError:
        return False
    return True


def policy_for(cfg: JobConfig) -> ScalingPolicy:
    """The job's scaling policy: its mesh and elastic sections, and the job's mesh rules."""
    return ScalingPolicy(cfg.mesh, cfg.elastic, fits=partial(feasible_dp, cfg))


class ScalingPolicy:
    """The controller's scaling decisions for one job (see the module docstring)."""

    def __init__(self, mesh: MeshConfig, elastic: ElasticConfig, fits: Callable[[int], bool]) -> None:
        self.start_dp = mesh.dp
        self.min_dp, self.max_dp = dp_bounds(mesh, elastic)
        self.replica = mesh.pp * mesh.tp
        self.spares = elastic.spares
        self.fits = fits  # fits(dp): whether the job fits a (dp, mesh.pp, mesh.tp) mesh

    def choose(self, live_actors: int, reason: str) -> ResizeDecision | TooFewWorkers:
        """The mesh after a failure, preemption or eviction: the largest feasible dp up to
        ``elastic.max_dp`` (``fit``), unless that is below ``elastic.min_dp``."""
        best = self.fit(self.max_dp, live_actors)
        if best < self.min_dp:
            return TooFewWorkers(
                best_dp=best,
                message=(
                    f"{live_actors} live workers allow only dp={best} (pp*tp={self.replica} per replica), "
                    f"below elastic.min_dp={self.min_dp}: add nodes or lower elastic.min_dp"
                ),
            )
        return ResizeDecision(dp=best, reason=reason)

    def fit(self, wanted: int, live_actors: int) -> int:
        """The largest feasible dp <= ``wanted`` that ``live_actors`` can hold; 0 when not even one
        replica fits. A requested resize asks it with the dp requested (beyond ``elastic.max_dp``: an
        explicit request is the operator's call), ``choose`` with ``elastic.max_dp``."""
        best = min(wanted, live_actors // self.replica)
        while best >= 1 and not self.fits(best):
            best -= 1
        return max(best, 0)

    def grow_target(self, current_dp: int, live_actors: int) -> int | None:
        """A larger dp the live actors allow, or None when growing is not possible/useful."""
        decision = self.choose(live_actors, "grow")
        if isinstance(decision, ResizeDecision) and decision.dp > current_dp:
            return decision.dp
        return None

    def start(self) -> ResizeDecision:
        return ResizeDecision(dp=self.start_dp, reason="start")

    def after_failure(self, live_actors: int) -> ResizeDecision | TooFewWorkers:
        """The mesh to rebuild after a failure from the actors still alive."""
        return self.choose(live_actors, "failure")

    def after_preemption(self, live_actors: int) -> ResizeDecision | TooFewWorkers:
        """The mesh to re-form from the actors left once a draining node's actors are dropped."""
        return self.choose(live_actors, "preemption")

    def after_eviction(self, live_actors: int) -> ResizeDecision | TooFewWorkers:
        """The mesh to re-form from the actors left once the evicted stragglers are dropped."""
        return self.choose(live_actors, "straggler")

    def missing_for(self, dp: int, live_actors: int) -> int:
        """Actors to start before a requested resize to ``dp`` (<= 0: none)."""
        return dp * self.replica - live_actors

    def requested(self, dp: int, live_actors: int) -> ResizeDecision | TooFewWorkers:
        """A requested resize (tests, operators), once the missing actors were started if they could
        be: the largest feasible dp <= ``dp`` the live actors hold (``fit``)."""
        fitted = self.fit(dp, live_actors)
        if fitted < 1:
            return TooFewWorkers(best_dp=0, message=(
                f"resize to dp={dp}: {live_actors} live workers hold no whole replica that divides "
                "train.global_batch_size: add nodes"))
        return ResizeDecision(dp=fitted, reason="requested")

    def actors_to_adopt(self, live_actors: int, free_slots) -> int:
        """How many actors to start on capacity that appeared (autoscaler, replacement node): whole
        replicas, up to ``elastic.max_dp`` of them. ``free_slots`` (a callable: the probe asks Ray)
        is called only when more actors are wanted at all."""
        wanted = self.max_dp * self.replica + self.spares - live_actors
        if wanted <= 0:
            return 0
        count = min(wanted, free_slots())
        return count - count % self.replica if count >= self.replica else 0

    def grow(self, current_dp: int, live_actors: int) -> ResizeDecision | NoResize:
        """Grow to a larger dp when the live actors allow one, else keep the mesh."""
        target = self.grow_target(current_dp, live_actors - self.spares)
        return NoResize() if target is None else ResizeDecision(dp=target, reason="grow")
