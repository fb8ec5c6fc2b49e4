"""The step boundary's checks: an ordered list of deciders, each returning a decision or None (driver
side; no Ray, no torch).

Before each step the controller runs the test/fault hooks, takes in actors that answered since the
last boundary, then asks ``DECIDERS`` in order; the first decision ends the step's boundary and the
controller carries it out (``Controller._carry_out``): a stop finishes the run, every other decision
is a planned re-form, which leaves RUNNING for ``Forming(decision, save_first=True)`` — the new
generation never forms inside a RUNNING step. In order:

1. ``decide_stop``: a signal asked to stop (`ray job stop`, Ctrl-C; launch.StopRequest): the step
   just trained is committed, the run ends and a rerun re-runs no step.
2. ``decide_requested_resize``: ``controller.resize_requests`` names this step (tests, operators).
3. ``decide_preemption``: a node holding ranks is draining with time for a save (evacuate: commit,
   drop its actors, re-form without them; no failure counted). A drain too short for a save only
   logs (the node's loss later takes the failure path), and a drain of spares only drops them.
4. ``decide_eviction``: a straggler reported with ``elastic.evict_stragglers`` (unless dropping it
   would go below ``elastic.min_dp``).
5. ``decide_grow``: every ``elastic.grow_check_s`` (or when actors just answered): spares refilled,
   new capacity started in the background, and a larger dp formed when the live actors allow one.

A decider may act on the cluster only where the decision needs no re-form (the drain of spares
only, the background starts of the grow check); what it decides is data.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from orchestrator.control.controller_view import BoundaryView
from orchestrator.control.scaling import ResizeDecision, TooFewWorkers, choose_dp
from orchestrator.control.states import ControllerState, Finished, Forming
from orchestrator.errors import WorkerGroupStartupError
from orchestrator.recovery.preemption import Preemption

logger = logging.getLogger(__name__)


@dataclass
class Boundary:
    """The boundary before ``step`` (the next step to train)."""

    step: int
    adopted: bool = False  # actors started in the background answered at this boundary


@dataclass(frozen=True)
class Stop:
    """Commit the step just trained and finish (a stop signal)."""


@dataclass(frozen=True)
class ResizeTo:
    """A requested resize to ``dp`` (started actors are added first if the live ones are too few)."""

    dp: int


@dataclass(frozen=True)
class Evacuate:
    """A draining node with time for a save: commit, drop its actors, re-form without them."""

    notice: Preemption
    decision: ResizeDecision | TooFewWorkers


@dataclass(frozen=True)
class Evict:
    """Drop stragglers: commit, kill them, re-form from the others."""

    actors: frozenset[int]
    decision: ResizeDecision


@dataclass(frozen=True)
class Grow:
    """The live actors hold more whole replicas than the mesh: commit, form the larger mesh."""

    decision: ResizeDecision


Decision = Stop | ResizeTo | Evacuate | Evict | Grow


def decide_stop(c: BoundaryView, at: Boundary) -> Stop | None:
    return Stop() if c.stop_requested() else None


def decide_requested_resize(c: BoundaryView, at: Boundary) -> ResizeTo | None:
    dp = c.resize_requests.pop(at.step, None)
    return None if dp is None else ResizeTo(dp)


def decide_preemption(c: BoundaryView, at: Boundary) -> Evacuate | None:
    """Act on drain notices (polled every ``elastic.drain_poll_s``; each node decided once)."""
    if not c.preemptions.due(c.clock()):
        return None
    gen = c.generation
    notice = c.preemptions.check(c.group.draining_nodes(), actor_nodes=c.group.node_ids, members=gen.members,
                                 step=at.step, save_measured_s=c.ckpt.save_measured_s)
    if notice is None:
        return None
    c.preempted |= notice.actors
    c.metrics.event("preemption", **notice.event())
    if notice.action != "evacuate":
        return None  # too short for a save: the node's loss takes the failure path
    if not notice.ranks:
        c.group.kill(sorted(notice.actors))  # only spares were there: dropped before the node goes
        return None
    left = len(set(c.group.live_ids) - notice.actors)
    return Evacuate(notice, c.scaling.after_preemption(left))


def decide_eviction(c: BoundaryView, at: Boundary) -> Evict | None:
    actors = c.health.take_evictions(set(c.generation.members.values()))
    if not actors:
        return None
    decision = choose_dp(c.cfg, len(c.group.live_ids) - len(actors), "straggler")
    if isinstance(decision, TooFewWorkers):  # a slow rank beats no rank: keep it
        logger.warning("straggler(s) %s kept: without them %s", sorted(actors), decision.message)
        return None
    return Evict(frozenset(actors), decision)


def decide_grow(c: BoundaryView, at: Boundary) -> Grow | None:
    if not (c.grow_due() or at.adopted):
        return None
    c.spares.refill(c.generation.shape.world)  # spares first: a grow never takes them (control/scaling.py)
    c.spares.adopt_new_capacity(c.scaling)
    decision = c.scaling.grow(c.generation.shape.dp, len(c.group.live_ids))
    return Grow(decision) if isinstance(decision, ResizeDecision) else None


def refresh(c: BoundaryView, decision: Decision) -> Decision | None:
    """A decision held while steps drained, taken again after a failure or rollback may have changed
    the actors: what it drops is narrowed to the actors still live, the mesh it forms is chosen again
    from them, and it lapses when nothing is left to do (the draining node already went; the stragglers
    died). A grow lapses too: the grow check decides again from the capacity there is now."""
    live = set(c.group.live_ids)
    if isinstance(decision, Evacuate):
        actors = decision.notice.actors & live
        if not actors & set(c.generation.members.values()):  # gone, or only spares now: drop, no re-form
            if actors:
                c.group.kill(sorted(actors))
            return None
        notice = replace(decision.notice, actors=frozenset(actors))
        return Evacuate(notice, c.scaling.after_preemption(len(live - actors)))
    if isinstance(decision, Evict):
        actors = decision.actors & set(c.generation.members.values())
        if not actors:
            return None
        resized = choose_dp(c.cfg, len(live) - len(actors), "straggler")
        return Evict(frozenset(actors), resized) if isinstance(resized, ResizeDecision) else None
    if isinstance(decision, Grow):
        return None
    return decision  # a stop or a requested resize holds whatever happened


def carry_out_decision(c: BoundaryView, decision: Decision, step: int) -> ControllerState:
    """A boundary decision: a stop finishes; every other one is a planned re-form, begun here
    (its recovery clock starts) and formed in the FORMING state."""
    if isinstance(decision, Stop):
        return _stop(c, step - 1)
    c.recovery.begins()
    if isinstance(decision, ResizeTo):
        missing = c.scaling.missing_for(decision.dp, len(c.group.live_ids))
        if missing > 0:  # started as a replacement would be; if they cannot be placed, the live ones
            try:
                c.group.add(missing, wait_s=c.cfg.resources.placement_timeout_s)
            except WorkerGroupStartupError as exc:
                logger.warning("resize to dp=%d: %s", decision.dp, exc)
        return Forming(c.scaling.requested(decision.dp, len(c.group.live_ids)), save_first=True,
                       snapshot_may_replace_save=True)
    if isinstance(decision, Evacuate):
        return Forming(decision.decision, save_first=True, drop=decision.notice.actors)
    if isinstance(decision, Evict):
        return Forming(decision.decision, save_first=True, drop=decision.actors, drop_event="evict",
                       snapshot_may_replace_save=True)
    if isinstance(decision, Grow):
        return Forming(decision.decision, save_first=True, snapshot_may_replace_save=True)
    raise TypeError(f"unknown boundary decision {decision!r}")


def _stop(c: BoundaryView, step: int) -> Finished:
    """Stopped by a signal (`ray job stop`, Ctrl-C): commit ``step`` so a rerun re-runs no step."""
    saved = bool(c.ckpt.user_dir)  # without it nothing outlives the run: a rerun starts over
    (c.ckpt.save_now if saved else c.ckpt.finish)(c.group, c.generation, step)
    c.progress.resume_step = (c.ckpt.last_committed if saved else 0) + 1
    c.metrics.event("stopped", step=step, resume_step=c.progress.resume_step)
    return Finished(step)


DECIDERS = (decide_stop, decide_requested_resize, decide_preemption, decide_eviction, decide_grow)
