"""The Forming and Rebuilding states' handler: form the next generation (driver side; no Ray, no
torch; the formation itself: orchestrator/control/formation.py).

``Forming`` is a planned re-form decided at a step boundary (or the run's start): the boundary's step
is committed first, the actors it drops are killed, then the mesh it decided is formed. ``Rebuilding``
follows a failure (``Rebuilding.failure``, decided in handlers/recovering.py): the mesh is re-planned
from the live actors. Either way the answer is Running (or the decision a failure interrupted, as a
stale Draining), ``Recovering`` when forming broke, or ``Errored`` when too few actors are left —
counting the actors still starting: a rebuild below ``elastic.min_dp`` waits for them (``_enough_actors``).
"""

from __future__ import annotations

import logging

from orchestrator.control.context import DriverContext
from orchestrator.control.formation import form_generation, save_before_reform
from orchestrator.control.scaling import ResizeDecision, TooFewWorkers
from orchestrator.control.states import ControllerState, Draining, Errored, Forming, Rebuilding, Recovering
from orchestrator.errors import TrainingFailed

logger = logging.getLogger(__name__)


def handle(state: Forming, ctx: DriverContext) -> ControllerState:
    step = ctx.progress.next_step - 1
    if state.save_first:
        # A covered snapshot of ``step`` replaces its save (a save in flight still commits, unless the
        # save is owed: a drain, whose actors write the one in flight too).
        covered = state.snapshot_may_replace_save and ctx.snapshots.covers(
            ctx.group, ctx.generation, step, without=state.drop)
        if covered and state.owe_save:
            ctx.checkpoints.set_aside(ctx.group, step)
        else:
            if state.owe_save:  # decided from snapshots that no longer cover the state (a holder was lost)
                logger.warning("step %d: the snapshots no longer hold every shard without actors %s: saving it "
                               "before they go instead", step, sorted(state.drop))
            broke = save_before_reform(ctx, step, only_pending=covered)
            if broke is not None:
                return broke
    if state.drop:
        if state.drop_event:
            ctx.metrics.event(state.drop_event, step=step, actors=sorted(state.drop))
        ctx.group.kill(sorted(state.drop))  # before the node goes / the straggler trains on
    return _form(ctx, state.decision)


def handle_rebuilding(state: Rebuilding, ctx: DriverContext) -> ControllerState:
    failure = state.failure
    live = len(ctx.group.live_ids)
    logger.info("generation %d broke at step %d (%s): re-forming from %d live actors", failure.generation,
                failure.step, failure.reason, live)
    formed = _form(ctx, _enough_actors(ctx), draining=state.draining)
    if isinstance(formed, Recovering):  # the formation broke: no first step is near, ask now
        ctx.spares.adopt_new_capacity(ctx.scaling)
    elif not isinstance(formed, Errored):
        # What the failure took is replaced once the new generation's first step was read, not at the
        # next grow check (elastic.grow_check_s later): an actor's start (a process importing torch)
        # takes seconds, and the mesh grows back at the first boundary after it answered
        # (control/boundary.py). Not before that first step: the start would compete with the
        # rebuild's join, load and first step for the cores (SparePool.ask_after_first_step).
        ctx.spares.ask_after_first_step(ctx.generation.shape.world, ctx.scaling)
    return formed


def _enough_actors(ctx: DriverContext) -> ResizeDecision | TooFewWorkers:
    """The mesh to rebuild from the live actors. Below ``elastic.min_dp``, replacements are asked for now
    and waited for while any is still starting: an actor being created (a process importing torch:
    13-14 s each when four start at once on 2 busy cores) is alive, and one that never answers is given
    up by its own deadline (orchestrator/cluster/worker_group.py, START_GRACE_S), so time alone does not
    fail the run. bench/chaos.py --quick stopped at 0 live actors with four replacements ~2 s from
    answering. Errored only when nothing more is starting."""
    def decide() -> ResizeDecision | TooFewWorkers:
        return ctx.scaling.after_failure(len(ctx.group.live_ids))

    decision = decide()
    if isinstance(decision, ResizeDecision):
        return decision
    ctx.spares.adopt_new_capacity(ctx.scaling)
    if ctx.group.starting:
        logger.warning("%s; waiting for the %d actors still starting", decision.message, ctx.group.starting)
    ctx.spares.await_started(lambda: isinstance(decide(), ResizeDecision))
    return decide()


def _form(ctx: DriverContext, decision: ResizeDecision | TooFewWorkers,
          draining: Draining | None = None) -> ControllerState:
    if isinstance(decision, TooFewWorkers):
        return Errored(TrainingFailed(decision.message))
    return form_generation(ctx, decision, draining)
