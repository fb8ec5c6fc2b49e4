"""The Recovering state's handler: the failure path, one for every phase (driver side; no Ray, no
torch).

A call broke (a training step, a generation's join, a load): ``free_survivors`` resolves it — the
dead and hung are killed, the survivors kicked out of the broken collectives and waited for
(orchestrator/recovery/settle.py) — then tells the survivors to leave it (their teardown overlaps the
driver's settling and planning) and ends what the generation had under way (a save in flight, the
window, the snapshot pushes); ``diagnose`` names the failure and ``decide`` answers with the next
state, a pure decision: ``Rebuilding(failure)`` or ``Errored`` with the error the failure policy gives.
"""

from __future__ import annotations

from meshspeak.rank_calls import RankCalls
from orchestrator.control.context import DriverContext
from orchestrator.control.states import Draining, Errored, Rebuilding, Recovering
from orchestrator.recovery.failure_policy import Failure, FailurePolicy, Phase, Raise, diagnose
from orchestrator.recovery.settle import Casualties, free_broken_call, kicked_wait_s

SETTLE_SNAPSHOTS_S = 5.0  # after a failure, how long the survivors' snapshot pushes may take to land


def handle(state: Recovering, ctx: DriverContext) -> Rebuilding | Errored:
    found = free_survivors(ctx, state)
    ctx.spares.drop_lost(found.spares_lost)
    gen = ctx.generation
    _leave_now(ctx, [a for a in gen.members.values() if a not in found.lost])
    # Forming broke with nobody lost: if the store died, the next formation re-hosts it (not a bug).
    store_lost = state.phase.forming and not found.lost and not ctx.store.healthy()
    failure = diagnose(state.phase, step=ctx.progress.next_step, generation=gen.number, members=gen.members,
                       found=found, results=state.results, step_timeout_s=ctx.cfg.elastic.step_timeout_s,
                       store_lost=store_lost, preempted=frozenset(ctx.preemptions.doomed))
    ctx.metrics.event("failure", step=failure.step, ranks=list(failure.ranks), reason=failure.reason)
    _end_generation_work(ctx)
    return decide(ctx.failures, failure, state.draining)


def free_survivors(ctx: DriverContext, state: Recovering) -> Casualties:
    """Free the broken call's survivors (killing the dead, the hung and those that never return); the
    recovery clock starts here, unless a formation broke within the recovery under way."""
    ctx.hang_watch.pause()  # the recovery is no step interval
    if not state.phase.forming or not ctx.recovery_clock.under_way:
        ctx.recovery_clock.begins()
    gen = ctx.generation
    listeners = {actor: info.gloo_listeners for actor, info in gen.infos.items()}
    pace = ctx.hang_watch.pace_s() if state.phase is Phase.STEP else None  # a join or load has none
    wait_s = kicked_wait_s(ctx.cfg.elastic.collective_timeout_s + 5, pace)
    # Not the step timeout: a peer died, raised, or was found hung by a probe while the step ran.
    broke_early = bool(state.outcome.dead or state.outcome.failed or state.outcome.hung)
    found = free_broken_call(ctx.group, state.outcome, list(gen.members.values()), listeners=listeners,
                             wait_s=wait_s, hang_reason=state.phase.hang_reason(broke_early),
                             while_alive=pace is None, generation=gen.number)
    ctx.recovery_clock.mark("settled")
    return found


def _leave_now(ctx: DriverContext, survivors: list[int]) -> None:
    """The freed survivors leave the broken generation now, on their training threads, while the
    driver settles the snapshots and plans the next one: their teardown (a GC pass, 0.04-0.17 s per
    rank on bench/recovery.py) was the first part of every member's join. Not waited for here; the
    next formation waits for these calls (``ctx.leaving``). The calls name the generation they leave,
    as a later call may overtake them on a threaded actor. A survivor the step's failure did not
    reach still leaves: no broken generation trains again (every Recovering ends in a new one or
    the run's end)."""
    live = set(ctx.group.live_ids)
    survivors = [a for a in survivors if a in live]
    if survivors:
        ctx.leaving.update(ctx.group.submit(survivors, RankCalls.leave_generation, (ctx.generation.number,)))


def _end_generation_work(ctx: DriverContext) -> None:
    """What the broken generation had under way ends with it: a save in flight (none while forming),
    the steps in flight (settled with the outcome), the snapshot pushes (those under way may land)."""
    ctx.checkpoints.abandon_pending()
    ctx.window.reset(ctx.window.prev_step)
    ctx.snapshots.settle(ctx.group, ctx.generation, timeout_s=SETTLE_SNAPSHOTS_S)
    ctx.recovery_clock.mark("snapshots_settled")


def decide(policy: FailurePolicy, failure: Failure, draining: Draining | None) -> Rebuilding | Errored:
    """The failure policy's decision as the next state (``draining``: the state whose decision waited
    for the steps the failure ended, handed on to the next generation)."""
    decision = policy.decide(failure)
    if isinstance(decision, Raise):
        return Errored(decision.error)
    return Rebuilding(failure, draining)
