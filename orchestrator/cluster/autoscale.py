"""Asking the cluster for the capacity the job wants: the driver's half of autoscaling.

An elastic job wants ``elastic.max_dp`` whole replicas (pp*tp ranks each, one placement bundle per
rank) but may start on a cluster with room for fewer: a cold autoscaling cluster has no GPU node at
all. ``ray.autoscaler.sdk.request_resources(bundles=...)`` tells Ray's autoscaler the shape of
everything the job wants so it launches nodes; the controller's periodic grow check then starts
actors on the free resources (``control/spares.py``, ``adopt_new_capacity``) and grows the mesh once
they answer (``control/boundary.py``, ``decide_grow``).

Ray's request is a *floor for the whole cluster*, not an increment: only the latest call counts, and
the autoscaler bin-packs its bundles against every node's total resources (not what is free). So we
ask for the full max world, not the missing part; the request then also covers a node lost later
(the autoscaler replaces it and the job grows back); and we clear it when the job ends, or idle
nodes would be kept (and billed) forever. It is one value per cluster: two jobs that both request
overwrite each other's. A cluster without an autoscaler only stores it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping

from meshspeak.sections import JobConfig, dp_bounds
from orchestrator.control.scaling import feasible_dp

logger = logging.getLogger(__name__)

Bundle = dict[str, float]


def wanted_bundles(cfg: JobConfig, bundle: Mapping[str, float]) -> list[Bundle]:
    """One bundle per rank of the largest mesh the job may grow to: elastic.max_dp replicas, or fewer
    when that dp does not split the global batch (the controller would never form it); plus one per
    hot spare (elastic.spares)."""
    _, dp = dp_bounds(cfg.mesh, cfg.elastic)
    while dp > cfg.mesh.dp and not feasible_dp(cfg, dp):
        dp -= 1
    return [dict(bundle) for _ in range(dp * cfg.mesh.pp * cfg.mesh.tp + cfg.elastic.spares)]


def bundles_that_fit(bundle: Mapping[str, float], node_totals: Iterable[Mapping[str, float]]) -> int:
    """How many ``bundle``s the nodes could hold if they were empty (a bundle never spans nodes)."""
    count = 0
    for node in node_totals:
        count += min(int(node.get(key, 0.0) // amount) for key, amount in bundle.items() if amount > 0)
    return count


def alive_node_totals() -> list[dict[str, float]]:
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def _ray_request(bundles: list[Bundle]) -> None:
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)


class CapacityRequest:
    """The job's standing request to the autoscaler; ``release()`` withdraws it (idempotent)."""

    def __init__(self, request_fn: Callable[[list[Bundle]], None] = _ray_request) -> None:
        self._request_fn = request_fn
        self.bundles: list[Bundle] = []
        self._lock = threading.Lock()

    def ask(self, bundles: list[Bundle], *, fits_now: int | None = None) -> None:
        self._request_fn(bundles)
        self.bundles = list(bundles)
        if bundles and fits_now is not None and fits_now < len(bundles):
            logger.info(
                "asked the autoscaler for %d x %s (elastic.max_dp replicas); the cluster holds %d now: "
                "the job grows as nodes join", len(bundles), bundles[0], fits_now,
            )

    def release(self) -> None:
        """Withdraw the request, once: a stop signal's thread and the run's ``finally`` may both call."""
        with self._lock:
            if not self.bundles:
                return
            self.bundles = []
        try:
            self._request_fn([])
        except Exception as exc:  # the cluster may already be gone; nothing is left to scale then
            logger.warning("could not withdraw the autoscaler request: %s", exc)
