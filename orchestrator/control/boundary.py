"""The step boundary's checks: an ordered list of deciders, each returning a decision or None (driver
side; no Ray, no torch).

Before each step the Running handler (handlers/running.py) runs the test/fault hooks, takes in actors
that answered since the last boundary, then asks ``DECIDERS`` in order (``decide``); the first
decision ends the step's boundary and ``carry_out_decision`` turns it into the next state: a stop
finishes the run, every other decision is a planned re-form, which leaves RUNNING for
``Forming(decision, save_first=True)`` — the new generation never forms inside a RUNNING step. A
decision taken with steps still in flight waits for them in ``Draining`` (handlers/draining.py),
and is taken again (``refresh``) when a failure or rollback ended them. In order:

1. ``decide_stop``: a signal asked to stop (`ray job stop`, Ctrl-C; launch.StopRequest): the step
   just trained is committed, the run ends and a rerun re-runs no step (handlers/finished.py).
2. ``decide_requested_resize``: ``controller.resize_requests`` (the context's ``inputs``) names this step (tests, operators).
3. ``decide_preemption``: a node holding ranks is draining (evacuate: drop its actors, re-form
   without them; no failure counted). When the in-memory snapshots hold every shard outside the
   draining nodes it re-forms from them at once and the save is owed; else, with time for a save, it
   commits the step first; a drain too short for one then only logs (the node's loss later takes the
   failure path); a drain of spares only drops them.
4. ``decide_eviction``: a straggler reported with ``elastic.evict_stragglers`` (unless dropping it
   would go below ``elastic.min_dp``).
5. ``decide_grow``: every ``elastic.grow_check_s`` (or when actors just answered): spares refilled,
   new capacity started in the background, and a larger dp formed when the live actors allow one
   (held for a few steps while a checkpoint is still being written).

A decider may act on the cluster only where the decision needs no re-form (the drain of spares
only, the background starts of the grow check); what it decides is data.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from orchestrator.control.context import DriverContext
from orchestrator.control.decisions import Boundary, Decision, Evacuate, Evict, Grow, ResizeTo, Stop
from orchestrator.control.scaling import ResizeDecision, TooFewWorkers
from orchestrator.control.states import Finishing, Forming
from orchestrator.errors import WorkerGroupStartupError


logger = logging.getLogger(__name__)


def decide_stop(ctx: DriverContext, at: Boundary) -> Stop | None:
    return Stop() if ctx.inputs.stop_requested() else None


def decide_requested_resize(ctx: DriverContext, at: Boundary) -> ResizeTo | None:
    dp = ctx.inputs.resize_requests.pop(at.step, None)
    return None if dp is None else ResizeTo(dp)


def decide_preemption(ctx: DriverContext, at: Boundary) -> Evacuate | None:
    """Act on drain notices (polled every ``elastic.drain_poll_s``; each node decided once)."""
    if not ctx.preemptions.due(ctx.clock()):
        return None
    gen = ctx.generation

    def covered(actors: frozenset[int]) -> bool:  # asked of every drain that takes ranks
        # The newest step read, not at.step - 1: with steps in flight (the default window) that one's
        # snapshots are not taken yet. Its copies are on the same holders (one ring per generation),
        # and the Forming state asks again about the step it resumes from.
        return ctx.snapshots.covers(ctx.group, gen, ctx.progress.next_step - 1, without=actors)

    notice = ctx.preemptions.check(ctx.group.draining_nodes(), actor_nodes=ctx.group.node_ids, members=gen.members,
                                 step=at.step, save_measured_s=ctx.checkpoints.save_measured_s, covered=covered)
    if notice is None:
        return None
    ctx.metrics.event("preemption", **notice.event())
    if notice.action != "evacuate":
        return None  # too short for a save: the node's loss takes the failure path
    if not notice.ranks:
        ctx.group.kill(sorted(notice.actors))  # only spares were there: dropped before the node goes
        return None
    left = len(set(ctx.group.live_ids) - notice.actors)
    return Evacuate(notice, ctx.scaling.after_preemption(left))


def decide_eviction(ctx: DriverContext, at: Boundary) -> Evict | None:
    actors = ctx.health.take_evictions(set(ctx.generation.members.values()))
    if not actors:
        return None
    decision = ctx.scaling.after_eviction(len(ctx.group.live_ids) - len(actors))
    if isinstance(decision, TooFewWorkers):  # a slow rank beats no rank: keep it
        logger.warning("straggler(s) %s kept: without them %s", sorted(actors), decision.message)
        return None
    return Evict(frozenset(actors), decision)


def decide_grow(ctx: DriverContext, at: Boundary) -> Grow | None:
    """A larger mesh when the live actors allow one; held while a checkpoint is still being written
    (``GrowCheck.hold``): the re-form would first wait for the write (a save uses the generation's
    groups), with every rank idle, while one more step at the current size loses nothing. (In the
    chaos bench the re-forms that met a save in flight waited 0.24-0.28 s for it; none of its grows
    met one in two campaigns: a grow follows its actors' answer, not the save schedule.)"""
    if not (ctx.grow_check.due() or at.adopted):
        return None
    ctx.spares.refill(ctx.generation.shape.world)  # spares first: a grow never takes them (control/scaling.py)
    ctx.spares.adopt_new_capacity(ctx.scaling)
    decision = ctx.scaling.grow(ctx.generation.shape.dp, len(ctx.group.live_ids))
    if not isinstance(decision, ResizeDecision):
        ctx.grow_check.release()
        return None
    if ctx.checkpoints.writing(ctx.group) and ctx.grow_check.hold():
        return None
    ctx.grow_check.release()
    return Grow(decision)


def refresh(ctx: DriverContext, decision: Decision) -> Decision | None:
    """A decision held while steps drained, taken again after a failure or rollback may have changed
    the actors: what it drops is narrowed to the actors still live, the mesh it forms is chosen again
    from them, and it lapses when nothing is left to do (the draining node already went; the stragglers
    died). A grow lapses too: the grow check decides again from the capacity there is now."""
    live = set(ctx.group.live_ids)
    if isinstance(decision, Evacuate):
        actors = decision.notice.actors & live
        if not actors & set(ctx.generation.members.values()):  # gone, or only spares now: drop, no re-form
            if actors:
                ctx.group.kill(sorted(actors))
            return None
        notice = replace(decision.notice, actors=frozenset(actors))
        return Evacuate(notice, ctx.scaling.after_preemption(len(live - actors)))
    if isinstance(decision, Evict):
        actors = decision.actors & set(ctx.generation.members.values())
        if not actors:
            return None
        resized = ctx.scaling.after_eviction(len(live) - len(actors))
        return Evict(frozenset(actors), resized) if isinstance(resized, ResizeDecision) else None
    if isinstance(decision, Grow):
        return None
    return decision  # a stop or a requested resize holds whatever happened


def carry_out_decision(ctx: DriverContext, decision: Decision, step: int) -> Finishing | Forming:
    """A boundary decision: a stop finishes (its step committed by the Finishing state); every other
    one is a planned re-form, begun here (its recovery clock starts) and formed in the FORMING state."""
    if isinstance(decision, Stop):
        return Finishing(step - 1, stopped=True)
    ctx.recovery_clock.begins()
    if isinstance(decision, ResizeTo):
        _await_background_starts(ctx, decision.dp)
        missing = ctx.scaling.missing_for(decision.dp, len(ctx.group.live_ids))
        if missing > 0:  # started as a replacement would be; if they cannot be placed, the live ones
            try:
                ctx.group.add(missing, wait_s=ctx.cfg.resources.placement_timeout_s)
            except WorkerGroupStartupError as exc:
                logger.warning("resize to dp=%d: %s", decision.dp, exc)
        return Forming(ctx.scaling.requested(decision.dp, len(ctx.group.live_ids)), save_first=True,
                       snapshot_may_replace_save=True)
    if isinstance(decision, Evacuate):  # without covering snapshots, the step is saved before the node goes
        from_snapshots = decision.notice.from_snapshots
        return Forming(decision.decision, save_first=True, drop=decision.notice.actors,
                       snapshot_may_replace_save=from_snapshots, owe_save=from_snapshots)
    if isinstance(decision, Evict):
        return Forming(decision.decision, save_first=True, drop=decision.actors, drop_event="evict",
                       snapshot_may_replace_save=True)
    if isinstance(decision, Grow):
        return Forming(decision.decision, save_first=True, snapshot_may_replace_save=True)
    raise TypeError(f"unknown boundary decision {decision!r}")


def _await_background_starts(ctx: DriverContext, dp: int) -> None:
    """Actors already starting in the background (a replacement asked for after a failure:
    handlers/forming.py) count toward a requested size: wait for them, up to
    resources.placement_timeout_s, before starting more, else a resize starts one actor too many."""
    ctx.spares.await_started(lambda: ctx.scaling.missing_for(dp, len(ctx.group.live_ids)) <= 0,
                             deadline=time.monotonic() + ctx.cfg.resources.placement_timeout_s)


DECIDERS = (decide_stop, decide_requested_resize, decide_preemption, decide_eviction, decide_grow)


def decide(ctx: DriverContext, step: int) -> Decision | None:
    """The first decision ``DECIDERS`` take at the boundary before ``step``, or None."""
    at = Boundary(step, adopted=ctx.spares.adopt_started())
    for decider in DECIDERS:
        decision = decider(ctx, at)
        if decision is not None:
            return decision
    return None
