"""What the controller reads from each trained step besides its loss: bad steps and stragglers
(driver side; the decisions are pure: ``orchestrator.recovery.bad_steps``, ``.stragglers``;
docs/design.md, Bad steps and Stragglers).

* Bad steps: a step every rank skipped (loss or grad norm not finite) is logged (``bad_step``) and
  recorded; ``train.max_bad_steps`` in a row call for a rollback: the controller reloads the newest
  snapshot or checkpoint in place and replays the recorded steps as skips.
* Stragglers: each trained step's ``forward_s`` is scored; a straggler is reported (``straggler``
  {rank, node, factor}) and with ``elastic.evict_stragglers`` queued for eviction, which the
  boundary's eviction decider takes (orchestrator/control/boundary.py).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from meshspeak.messages import StepResult
from meshspeak.sections import ElasticConfig
from orchestrator.recovery.bad_steps import BadSteps, bad_reason
from orchestrator.recovery.stragglers import StragglerWatch


class Verdict(Enum):
    """What a trained step's results say about the step itself."""

    GOOD = "good"
    SKIPPED = "skipped"  # every rank skipped the update: logged and recorded, training goes on
    ROLL_BACK = "roll back"  # ``train.max_bad_steps`` skipped in a row (and something to roll back to)


class StepHealth:
    def __init__(self, elastic: ElasticConfig, max_bad_steps: int, metrics, skipped_steps: set[int]) -> None:
        self.metrics = metrics
        self.evict_stragglers = elastic.evict_stragglers
        self.bad_steps = BadSteps(max_bad_steps, skipped_steps)  # one set: saved, restored
        self.stragglers = StragglerWatch(elastic.straggler_factor, elastic.straggler_steps)
        self.evict: set[int] = set()  # stragglers to drop at the next step boundary

    def verdict(self, step: int, results: list[StepResult], *, restorable: Callable[[], bool]) -> Verdict:
        """A bad step is logged and recorded; the ``train.max_bad_steps``-th in a row asks for a
        rollback when there is something to roll back to (``restorable()``), else training goes on
        (the skips already left the state untouched)."""
        reason = bad_reason(step, results)
        if not reason:
            self.bad_steps.good()
            return Verdict.GOOD
        self.metrics.event("bad_step", step=step, reason=reason)
        if self.bad_steps.bad(step) and restorable():
            return Verdict.ROLL_BACK
        return Verdict.SKIPPED

    def score(self, results: list[StepResult], members: dict[int, int], pp_of, node_ips: dict[int, str]) -> None:
        """Score one trained step's ``forward_s``; report stragglers (and queue them for eviction).

        ``members``: world rank -> actor id; ``pp_of(rank)``: the rank's pipeline position."""
        own = {members[r.world_rank]: (pp_of(r.world_rank), r.forward_s) for r in results
               if r.world_rank in members}
        found = self.stragglers.observe(own)
        if not found:
            return
        rank_of = {actor: rank for rank, actor in members.items()}
        for straggler in found:
            self.metrics.event("straggler", rank=rank_of[straggler.actor], node=node_ips.get(straggler.actor, ""),
                               factor=round(straggler.factor, 3), actor=straggler.actor, step=results[0].step)
            if self.evict_stragglers:
                self.evict.add(straggler.actor)

    def take_evictions(self, members: set[int]) -> set[int]:
        """The queued stragglers that are still members; the queue is emptied."""
        actors = self.evict & members
        self.evict.clear()
        return actors
