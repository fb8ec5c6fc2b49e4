"""The controller's hook for ``elastic.rebalance`` (driver side; pure: no Ray, no torch): each step's
microbatch split over the dp replicas, every rank's schedule for its replica's count, and the
``rebalance`` event.

The decisions are ``meshspeak.rebalance.SplitPolicy``'s (greedy split by measured speed, with
hysteresis); this module maps a generation onto it and step results into its measurements:

* replica r's keys are (actor, pp position) of its ranks, so what was measured of an actor still
  counts after a resize that keeps its pipeline position (an elastic resize changes only dp); a new
  generation starts at the even split and may rebalance at its first step;
* a rank's seconds per microbatch are its ``StepResult.forward_s`` (the straggler score's compute
  clock: workers/compute_clock.py) over its replica's count in the split that step was sent with;
  a generation's first step is not measured (it pays one-time set-ups: connections, caches).

The controller calls ``begin`` when a generation formed, ``orders_for`` as it sends a step (the split
is decided there, at the step boundary) and ``observe`` with a trained step's results. Steps go out
ahead of their results (control/window.py), so a decision uses what was read by then; a rank keeps
the last ``SplitOrders`` it was sent, so only the first step of a new split carries one, and every
generation starts at the even split its ``GenerationOrders`` hold. With the key off, or one replica,
nothing is sent. Nothing here is saved: a checkpoint records no split (it is derived), and a resumed
run measures again.
"""

from __future__ import annotations

from meshspeak.messages import SplitOrders, StepResult
from meshspeak.rebalance import Split, SplitPolicy, split_rules
from meshspeak.sections import TrainConfig
from orchestrator.control.generation import GenerationRecord


class Rebalancer:
    def __init__(self, enabled: bool, train: TrainConfig, metrics) -> None:
        self.enabled = enabled  # elastic.rebalance
        self.total = train.global_batch_size // train.micro_batch_size  # microbatches per step
        self.metrics = metrics
        self.policy = SplitPolicy()
        self.generation: GenerationRecord | None = None
        self._sent: dict[int, Split] = {}  # step -> the split it was sent with
        self._first = True  # the next step sent is the generation's first: not measured
        self._held: Split | None = None  # the split the ranks train (None: the even one, from joining)

    @property
    def active(self) -> bool:
        return self.enabled and self.generation is not None and self.generation.shape.dp > 1

    def begin(self, gen: GenerationRecord) -> None:
        """Generation ``gen`` formed: its replicas' keys, the even split."""
        self.generation = gen
        self._sent.clear()
        self._first = True
        if not self.active:
            return
        replicas: list[list[tuple[int, int]]] = [[] for _ in range(gen.shape.dp)]
        for rank, actor in sorted(gen.members.items()):
            coords = gen.shape.coords(rank)
            replicas[coords.dp].append((actor, coords.pp))
        plan = gen.plan
        self.policy.begin(replicas, self.total, split_rules(plan.shape.pp, plan.virtual_stages, plan.schedule_name))
        self._held = self.policy.split  # even: what the members train with their GenerationOrders

    def orders_for(self, step: int) -> dict[int, SplitOrders] | None:
        """Actor -> ``SplitOrders`` when ``step`` starts a new split (each rank's action list for its
        replica's count); None when the ranks keep the split they have."""
        if not self.active:
            return None
        if self.policy.decide() is not None:
            seconds = self.policy.replica_seconds()
            self.metrics.event("rebalance", step=step, microbatches=list(self.policy.split),
                               speeds=[round(1.0 / s, 3) if s > 0 else None for s in seconds])
        split = self.policy.split
        if not self._first:
            self._sent[step] = split
        self._first = False
        if split == self._held:
            return None
        self._held = split
        gen = self.generation
        lists = {count: gen.plan.actions(count) for count in set(split)}
        orders = {}
        for rank, actor in gen.members.items():
            coords = gen.shape.coords(rank)
            orders[actor] = SplitOrders(split=tuple(split), actions=tuple(lists[split[coords.dp]][coords.pp]))
        return orders

    def observe(self, step: int, results: list[StepResult]) -> None:
        """A trained step: each rank's seconds per microbatch, for the next decision."""
        split = self._sent.pop(step, None)
        for older in [s for s in self._sent if s < step]:  # skipped as bad: never recorded
            del self._sent[older]
        if split is None or not self.active:
            return
        gen = self.generation
        seconds = {}
        for result in results:
            actor = gen.members.get(result.world_rank)
            if actor is not None:
                coords = gen.shape.coords(result.world_rank)
                seconds[(actor, coords.pp)] = result.forward_s / split[coords.dp]
        self.policy.observe(seconds)
