"""The training steps, as the Running and Draining handlers drive them (driver side; no Ray, no
torch): cross a step boundary, keep the window of steps in flight full, read the oldest step and
record it (docs/design.md, The step loop).

Every function takes the driver context (control/context.py) and answers the next state, never
raising for a failure: a call that broke is ``Recovering`` (handlers/recovering.py), checkpoint
storage failing with every rank alive (or ranks disagreeing about a bad step) ``Errored``. ``draining`` is
the ``Draining`` state whose decision waits for the steps in flight (None while Running); it is
handed on to the state each function returns, so that a failure or rollback ending those steps does
not drop it.
"""

from __future__ import annotations

from meshspeak.messages import CallOutcome, StepResult
from orchestrator.control.boundary import carry_out_decision, decide, refresh
from orchestrator.control.context import DriverContext
from orchestrator.control.health import Verdict
from orchestrator.control.states import (
    ControllerState,
    Draining,
    Errored,
    Finishing,
    Forming,
    Recovering,
    Running,
    after_reset,
)
from orchestrator.errors import TrainingFailed
from orchestrator.metrics import step_record
from orchestrator.recovery.failure_policy import Phase
from orchestrator.saves.checkpointing import RestoreFailed


def cross_boundary(ctx: DriverContext,
                   draining: Draining | None) -> Finishing | Forming | Running | Errored | None:
    """The boundary before the next step, nothing in flight: the end of the run (handlers/finished.py),
    the decision that waited while the window drained (taken again when a failure or rollback came
    between: the actors may have changed), else the hooks due, the actors that answered and the
    deciders; a step replayed as a recorded skip. None: no decision, the step was sent."""
    step = ctx.progress.next_step
    if step > ctx.cfg.train.steps:
        return Finishing(step - 1)
    decision = None if draining is None else draining.decision
    if decision is not None and draining.stale:
        decision = refresh(ctx, decision)
    if decision is None:
        ctx.inputs.run_hooks(step)
        decision = decide(ctx, step)
    if decision is not None:
        return carry_out_decision(ctx, decision, step)
    if ctx.health.bad_steps.is_skipped(step):  # skipped before a rollback or resume: the same choice
        ctx.metrics.event("bad_step", step=step, reason="recorded")
        ctx.progress.next_step = step + 1
        return _saves_after(ctx, step) or Running()
    send(ctx, step)
    return None


def top_up(ctx: DriverContext) -> Draining | None:
    """Send further steps while the window has room and nothing stands between them; a decision
    taken at such a boundary waits (``Draining``) until the steps in flight are read."""
    window = ctx.window
    while len(window) < window.size:
        step = window.last + 1
        if needs_empty_window(ctx, step):
            return None
        decision = decide(ctx, step)
        if decision is not None:
            return Draining(decision)
        send(ctx, step)
    return None


def needs_empty_window(ctx: DriverContext, step: int) -> bool:
    """Whether ``step`` must wait until every step before it was read: the end, a requested resize,
    a hook due, a replayed skip, an eval or a checkpoint save after the step before. A save goes
    out only once its step was read good (never one of a step that broke or turns out bad), and
    before the next step changes the state; one that must wait for a slow write does not hold the
    steps back (``CheckpointCoordinator.wants_empty_window``)."""
    return (step > ctx.cfg.train.steps or step in ctx.inputs.resize_requests or ctx.inputs.hook_due(step)
            or ctx.health.bad_steps.is_skipped(step) or ctx.evaluator.due(step - 1)
            or ctx.checkpoints.wants_empty_window(ctx.group, step - 1))


def send(ctx: DriverContext, step: int) -> None:
    """Send ``step`` to every member."""
    split = ctx.rebalance.orders_for(step)  # elastic.rebalance: a new split starts here (or None)
    ctx.window.send(ctx.group, list(ctx.generation.members.values()), step, ctx.snapshots.keep, split)


def read_oldest(ctx: DriverContext, draining: Draining | None) -> ControllerState:
    """Read the oldest step in flight: recorded when every rank trained it, else ``Recovering``."""
    window = ctx.window
    flight, outcome = window.read_oldest(ctx.group, ctx.cfg.elastic.step_timeout_s, step_broken, ctx.hang_watch)
    results = list(outcome.results.values())
    if not (outcome.ok and all(r.ok for r in results)):
        return Recovering(Phase.STEP, window.broken(outcome), tuple(results), draining=draining)
    window.done()
    ctx.hang_watch.step_read()
    return _trained(ctx, flight.step, results, draining)


def _trained(ctx: DriverContext, step: int, results: list[StepResult],
             draining: Draining | None) -> ControllerState:
    """Step ``step`` trained on every rank: record it (or its skip), then the boundary's saves."""
    ctx.progress.next_step = step + 1
    ctx.snapshots.after_results(results)
    try:
        verdict = ctx.health.verdict(step, results, restorable=lambda: _restorable(ctx))
    except TrainingFailed as exc:  # some ranks skipped the update and some did not: their states diverged
        return Errored(exc)
    if verdict is Verdict.ROLL_BACK:
        return _roll_back(ctx, step, draining)
    if verdict is Verdict.GOOD:
        _record(ctx, step, results)
    stopped = _saves_after(ctx, step)
    if stopped is not None:
        return stopped
    if verdict is not Verdict.SKIPPED and ctx.evaluator.due(step):  # the next step waits for it
        failed = ctx.evaluator.run(ctx.group, ctx.generation, ctx.metrics, step)
        if failed is not None:
            return Recovering(Phase.STEP, failed, draining=draining)
    return draining or Running()


def _saves_after(ctx: DriverContext, step: int) -> Errored | None:
    """The boundary's saves after ``step`` (a commit, a periodic or owed save: the checkpoint
    coordinator's ``after_step``); Errored when checkpoint storage failed with every rank alive."""
    try:
        ctx.checkpoints.after_step(ctx.group, ctx.generation, step, later_sent=len(ctx.window) > 0)
    except TrainingFailed as exc:
        return Errored(exc)
    return None


def _restorable(ctx: DriverContext) -> bool:
    """Something to roll back to: a committed checkpoint, or a snapshot set with a live copy of
    every shard."""
    return (ctx.checkpoints.resume_point() is not None
            or ctx.snapshots.usable(set(ctx.group.live_ids)) is not None)


def _roll_back(ctx: DriverContext, step: int, draining: Draining | None) -> ControllerState:
    """``train.max_bad_steps`` bad steps in a row: reload the newest snapshot (else checkpoint) in
    place; its replay skips the recorded steps. The steps in flight are read and dropped first."""
    broken = ctx.window.drain(ctx.group, ctx.cfg.elastic.step_timeout_s, step_broken)
    if broken is not None:
        return Recovering(Phase.STEP, broken, draining=draining)
    try:
        ctx.checkpoints.finish(ctx.group, ctx.generation, step)  # no save in flight while loading
    except TrainingFailed as exc:  # storage failing with every rank alive
        return Errored(exc)
    try:
        restored = ctx.snapshots.restore_best(ctx.group, ctx.generation, ctx.checkpoints, at_most=step)
    except RestoreFailed as exc:
        return Recovering(Phase.LOADING, exc.outcome, draining=draining)
    ctx.metrics.event("rollback", step=step, resumed_from_step=restored.step, restored_from=restored.source,
                      skipped=sorted(ctx.health.bad_steps.skipped))
    ctx.window.reset(restored.step)
    ctx.progress.next_step = restored.step + 1
    return after_reset(draining)


def _record(ctx: DriverContext, step: int, results: list[StepResult]) -> None:
    gen = ctx.generation
    record = step_record(step, results, train=ctx.cfg.train, seq_len=ctx.cfg.model.seq_len,
                         shape=gen.shape, generation=gen.number)
    ctx.progress.losses[step] = record["loss"]
    ctx.metrics.step(record)
    ctx.metrics.timeline(step, results)
    ctx.health.score(results, gen.members, lambda rank: gen.shape.coords(rank).pp, ctx.group.node_ips)
    ctx.rebalance.observe(step, results)
    ctx.recovery_clock.trained()
    ctx.spares.step_read()  # what the generation's formation asked for, once its first step trained
    ctx.store.step_read()  # the store's standby, likewise (orchestrator/cluster/store_provider.py)


def step_broken(o: CallOutcome) -> bool:
    # Stop waiting as soon as an actor died or a rank latched an error: survivors are then
    # blocked in a collective and must be freed now, not after the timeout.
    # An ``early`` answer is no failure: the window sends that step again (control/window.py).
    return bool(o.dead or o.failed) or any(not r.ok and not r.early for r in o.results.values())
