"""The controller's rank-health transitions: bad steps, stragglers and hot spares (driver side).

``Controller`` inherits these methods (split out to keep orchestrator/control/controller.py small); they use its
state (``cfg``, ``group``, ``generation``, ``ckpt``, ``metrics``) and its transitions (``_form``,
``_fail``, ``_begin_resize``). The decisions themselves are pure: ``orchestrator.recovery.bad_steps``,
``orchestrator.recovery.stragglers``, ``orchestrator.control.scaling`` (docs/design.md: Bad steps, Stragglers, Hot
spares).

* Bad steps: a step every rank skipped (loss or grad norm not finite) is logged (``bad_step``) and
  recorded; ``train.max_bad_steps`` in a row reload the newest checkpoint in place (``rollback``) and
  replay the recorded steps as skips, going on past their batches.
* Stragglers: each trained step's ``forward_s`` is scored; a straggler is reported (``straggler``
  {rank, node, factor}) and with ``elastic.evict_stragglers`` dropped at the next step boundary: the
  step is committed, the actor killed and the mesh re-formed from the live actors (a spare takes its
  place, else dp shrinks); no step is re-run and no restart counted.
* Hot spares: ``elastic.spares`` actors beyond the mesh, started with it (``launch.py``) and kept;
  a re-formed mesh that takes one in reports ``spare_promoted``, and missing spares are requested
  (``spare_requested``) right after each formation and at every grow check, as far as the cluster has
  room for them now (``free_slots``), started in the background so training never stalls on them.
"""

from __future__ import annotations

import logging

from meshspeak.messages import StepResult
from orchestrator.control.scaling import TooFewWorkers, choose_dp
from orchestrator.errors import WorkerGroupStartupError
from orchestrator.recovery.bad_steps import BadSteps, bad_reason
from orchestrator.recovery.failure_policy import Phase
from orchestrator.recovery.stragglers import StragglerWatch
from orchestrator.saves.checkpointing import RestoreFailed

logger = logging.getLogger(__name__)


class RankHealth:
    def _init_rank_health(self) -> None:
        self.bad_steps = BadSteps(self.cfg.train.max_bad_steps, self.ckpt.skipped_steps)  # one set: saved, restored
        self.stragglers = StragglerWatch(self.cfg.elastic.straggler_factor, self.cfg.elastic.straggler_steps)
        self._evict: set[int] = set()  # stragglers to drop at the next step boundary
        self.spare_ids: list[int] = []  # live actors outside the current mesh

    # -- bad steps --------------------------------------------------------------------------------
    def _bad_step(self, step: int, results: list[StepResult]) -> bool:
        """True when every rank skipped ``step`` as bad: logged and recorded; ``train.max_bad_steps``
        in a row roll back to the newest snapshot (else checkpoint), whose replay skips the recorded steps."""
        reason = bad_reason(step, results)
        if not reason:
            self.bad_steps.good()
            return False
        self.metrics.event("bad_step", step=step, reason=reason)
        self.next_step = step + 1
        restorable = self.ckpt.resume_point() is not None or self.snapshots.usable(set(self.group.live_ids))
        if not self.bad_steps.bad(step) or not restorable:
            self.ckpt.after_step(self.group, self.generation, step)  # nothing to roll back to: go on
            return True
        self.ckpt.finish(self.group, self.generation, step)  # no save in flight while loading
        try:  # the newest snapshot when every shard has a live copy, else storage (orchestrator/saves/snapshots.py)
            restored = self.snapshots.restore_best(self.group, self.generation, self.ckpt)
        except RestoreFailed as exc:
            self._fail(Phase.LOADING, exc.outcome)
            return True
        self.metrics.event("rollback", step=step, resumed_from_step=restored.step, restored_from=restored.source,
                           skipped=sorted(self.bad_steps.skipped))
        self.next_step = restored.step + 1
        return True

    # -- stragglers -------------------------------------------------------------------------------
    def _score_stragglers(self, results: list[StepResult]) -> None:
        gen = self.generation
        actor_of = gen.members
        own = {actor_of[r.world_rank]: (gen.shape.coords(r.world_rank).pp, r.forward_s) for r in results
               if r.world_rank in actor_of}
        for found in self.stragglers.observe(own):
            rank = next(r for r, a in actor_of.items() if a == found.actor)
            self.metrics.event("straggler", rank=rank, node=self.group.node_ips.get(found.actor, ""),
                               factor=round(found.factor, 3), actor=found.actor, step=results[0].step)
            if self.cfg.elastic.evict_stragglers:
                self._evict.add(found.actor)

    def _evict_stragglers(self, step: int) -> bool:
        """At the step boundary: drop the stragglers to evict (step ``step - 1`` committed first) and
        re-form from the live actors; True when the mesh was re-formed."""
        actors = self._evict & set(self.generation.members.values())
        self._evict.clear()
        if not actors:
            return False
        decision = choose_dp(self.cfg, len(self.group.live_ids) - len(actors), "straggler")
        if isinstance(decision, TooFewWorkers):  # a slow rank beats no rank: keep it
            logger.warning("straggler(s) %s kept: without them %s", sorted(actors), decision.message)
            return False
        self._begin_resize()
        self.metrics.event("evict", step=step - 1, actors=sorted(actors))
        self.group.kill(sorted(actors))
        self._form(decision)
        return True

    # -- hot spares -------------------------------------------------------------------------------
    def _spares_formed(self, number: int, members: dict[int, int], spares: list[int]) -> None:
        """Generation ``number`` was assigned: report spares it took in, then remember the new spares."""
        promoted = {rank: actor for rank, actor in members.items() if actor in self.spare_ids}
        if promoted:
            self.metrics.event("spare_promoted", generation=number, ranks=sorted(promoted), actors=sorted(promoted.values()))
        self._warm([a for a in spares if a not in self.spare_ids])
        self.spare_ids = list(spares)
        self.stragglers.forget(set(members.values()))

    def _refill_spares(self) -> None:
        """Ask for the spares missing beyond the current mesh, without waiting: they are started in the
        background and taken in by ``_adopt_started`` once they answer."""
        wanted = self.cfg.elastic.spares
        if not wanted or self.generation is None:
            return
        missing = wanted - (len(self.group.live_ids) - self.generation.shape.world) - self.group.starting
        if missing <= 0:
            return
        # Only what the cluster holds now: the rest is the autoscaler's to provide (launch.py asked for
        # it), never a placement group left pending (orchestrator/cluster/bundles.py).
        missing = min(missing, self.group.free_slots())
        if missing <= 0:
            return
        try:
            self.group.start_background(missing, strategy="SPREAD")
        except WorkerGroupStartupError as exc:  # e.g. a placement group could not even be created
            logger.info("spares: could not ask for %d yet (%s)", missing, exc)
            return
        self.metrics.event("spare_requested", count=missing)

    def _adopt_started(self) -> bool:
        """At each step boundary: actors started in the background that answered become live, outside
        the mesh (spares, or capacity for a grow: True, so the grow check runs now). Spares found on a
        node that died are dropped now (members are found by the next step's call)."""
        ready = self.group.adopt_started()
        lost = [a for a in self.group.lost_ids if a in self.spare_ids]
        if lost:
            logger.info("spares %s were lost with their node", lost)
            self.group.kill(lost)
            self.spare_ids = [a for a in self.spare_ids if a not in lost]
        if ready:
            self.spare_ids += ready
            self._warm(ready)
            self.metrics.event("actors_ready", actors=ready)
        return bool(ready)

    def _warm(self, actors: list[int]) -> None:
        """Have new spares import the training code now (``RankActor.warm``); not waited for."""
        if actors and self.cfg.elastic.spares:
            self.group.submit(actors, "warm")
