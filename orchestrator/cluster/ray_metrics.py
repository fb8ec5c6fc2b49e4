"""Step metrics exported through Ray's metrics API (the dashboard, Prometheus) as ``elastimesh_*``.

``orchestrator.metrics.MetricsLog`` feeds it every step record and event next to the JSONL file; it is
best-effort there (a driver without Ray's metrics agent trains all the same).
"""

from __future__ import annotations


class RayMetrics:
    """Step metrics exported through ray.util.metrics (dashboard / Prometheus) as ``elastimesh_*``."""

    def __init__(self) -> None:
        from ray.util import metrics

        self.loss = metrics.Gauge("elastimesh_loss", "global-batch mean loss of the latest step")
        self.tps = metrics.Gauge("elastimesh_tokens_per_s", "training throughput, tokens per second")
        self.step = metrics.Gauge("elastimesh_step", "latest completed optimizer step")
        self.world = metrics.Gauge("elastimesh_world_size", "ranks in the current generation")
        self.events = metrics.Counter(
            "elastimesh_events_total", "failures, rebuilds, grows, checkpoints", tag_keys=("event",)
        )

    def on_step(self, rec: dict) -> None:
        self.loss.set(rec["loss"])
        self.tps.set(rec["tokens_per_s"])
        self.step.set(rec["step"])
        self.world.set(rec["dp"] * rec["pp"] * rec["tp"])

    def on_event(self, rec: dict) -> None:
        self.events.inc(1, tags={"event": rec["event"]})
