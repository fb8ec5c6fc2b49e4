"""Forming a generation: plan the mesh, assign ranks, have the members join, restore the newest state
(driver side; no Ray, no torch). Called by the Forming and Rebuilding handlers only
(handlers/forming.py), which it answers with the next state: the generation trains, or the formation
broke and the failure path takes over (``Recovering``); it never calls the failure path itself.

What each member gets, once per generation: its ``JoinSpec`` (world rank, mesh, store prefix), the
``RuntimeSpec`` every member shares, and its ``GenerationOrders`` — its pipeline action list (the
same every step, so steps carry only their number) and, with ``checkpoint.memory_every``, the handle
of the actor that holds its snapshots (docs/design.md, Generations; In-memory snapshots).
"""

from __future__ import annotations

import logging
import time

from meshspeak.messages import CallOutcome, GenerationOrders, JoinSpec, RestoreSource, RuntimeSpec
from meshspeak.rank_calls import RankCalls
from orchestrator.control.context import DriverContext
from orchestrator.control.generation import GenerationRecord, assign_ranks, runtime_spec
from orchestrator.control.scaling import ResizeDecision
from orchestrator.control.states import Draining, Errored, Recovering, Running, after_reset
from orchestrator.errors import TrainingFailed
from orchestrator.plan.mesh_plan import MeshPlan, make_plan
from orchestrator.recovery.failure_policy import Phase
from orchestrator.recovery.hang_watch import collect_while_alive, probe
from orchestrator.saves.checkpointing import RestoreFailed
from orchestrator.saves.snapshots import RestorePlan, Restored

logger = logging.getLogger(__name__)


def form_generation(ctx: DriverContext, decision: ResizeDecision,
                    draining: Draining | None = None) -> Running | Draining | Recovering:
    """Form the next generation at ``decision.dp`` from the live actors and resume it from the newest
    snapshot or checkpoint: Running when it worked (or, stale, the ``draining`` state a failure
    interrupted: its decision is taken again), else ``Recovering`` from what broke."""
    previous = ctx.generation
    number = (previous.number + 1) if previous else 1
    plan = make_plan(ctx.cfg, decision.dp)
    members, spares = assign_ranks(ctx.group.live_ids, ctx.group.node_ips, plan.shape, previous)
    ctx.spares.formed(number, members, spares)
    ctx.health.stragglers.forget(set(members.values()))
    # Decided before the join: the members are told whether a load follows (they then skip the init).
    restore = ctx.snapshots.plan_restore(ctx.group, ctx.checkpoints, at_most=ctx.progress.next_step - 1)
    ctx.recovery_clock.mark("restore_planned")
    live = [*members.values(), *spares]  # the new members first: they are given second copies first
    node_of = {a: ctx.group.node_ids.get(a, "") for a in live}
    keeps = ctx.snapshots.second_copies(ctx.group, restore, live, node_of, members)
    if keeps:
        ctx.recovery_clock.mark("given")
    spec = _shared_spec(ctx, plan, restore)
    gen = GenerationRecord(number, plan, members)
    holders = ctx.snapshots.holders_for(gen, {a: node_of[a] for a in members.values()})
    source = ctx.snapshots.source_of(ctx.group, restore)
    outcome = _join(ctx, gen, spares, _join_args(ctx, gen, spec, holders, source))
    # Kept while the members joined; waited for even when the join broke (a member killed as it
    # joined: the shard it gave is kept elsewhere, and the next formation's plan must see that copy).
    ctx.snapshots.wait_copies(ctx.group, keeps)
    if not outcome.ok:
        return Recovering(Phase.JOINING, outcome, draining=draining)
    try:  # in-memory snapshots when every shard has a live copy, else the newest checkpoint
        restored = ctx.snapshots.restore_best(ctx.group, ctx.generation, ctx.checkpoints,
                                              at_most=ctx.progress.next_step - 1, plan=restore)
    except RestoreFailed as exc:
        return Recovering(Phase.LOADING, exc.outcome, draining=draining)
    _resume_from(ctx, restored, holders)
    _announce(ctx, decision, spec, restored, spares)
    ctx.spares.ask_after_first_step(plan.shape.world)
    return after_reset(draining)


def _shared_spec(ctx: DriverContext, plan: MeshPlan, restore: RestorePlan) -> RuntimeSpec:
    """The ``RuntimeSpec`` every member of the generation shares.

    The ranks skip the random init a load overwrites, and refuse to train until it came
    (workers/runtime.py), so ``load_follows`` is the restore's own decision (``restore``), which
    ``restore_best`` then carries out: a guess from the driver's newest complete set once said yes
    while the restore, finding some copy missing, fell back to storage with nothing committed and
    loaded nothing (the generation's first step failed: 'left uninitialised for a ... load that
    never came')."""
    identity = ctx.identity
    return runtime_spec(ctx.cfg, plan, data_path=identity.data_path, use_gpu=identity.use_gpu,
                        mask_eos_id=identity.mask_eos_id, resuming=restore.storage_step is not None,
                        load_follows=restore.loads)


def _join_args(ctx: DriverContext, gen: GenerationRecord, spec: RuntimeSpec, holders: dict[int, int],
               source: RestoreSource | None) -> dict[int, tuple[JoinSpec, RuntimeSpec, GenerationOrders]]:
    """Each member's join call: its ``JoinSpec``, the shared spec, and its ``GenerationOrders``
    (``source``: the snapshot set the members load next, if any)."""
    number, plan, members = gen.number, gen.plan, gen.members
    actions = plan.actions()
    host, port = ctx.store.address()
    args = {}
    for rank, actor in members.items():
        orders = GenerationOrders(actions=tuple(actions[plan.shape.coords(rank).pp]),
                                  snapshot_every=ctx.snapshots.every if holders else 0,
                                  holder=ctx.group.handle(members[holders[rank]]) if holders else None,
                                  holder_rank=holders.get(rank, -1), restore=source)
        args[actor] = (JoinSpec(number, plan.shape, rank, host, port, f"{ctx.identity.run_id}-gen{number}",
                                store_secret=ctx.identity.store_secret), spec, orders)
    return args


def _join(ctx: DriverContext, gen: GenerationRecord, spares: list[int], args: dict) -> CallOutcome:
    """Spares leave the old generation, the members join the new one; the controller's generation is
    the new one from here, with what its members reported."""
    # The spares leave while the members join (their teardown, a GC pass, took 30-50 ms of the
    # recovery when waited for first), and are waited for before this returns: a threaded actor's
    # calls may run out of order, so no later call may reach a spare before its leave has run. The
    # survivors of a failure were told to leave as soon as they were freed (handlers/recovering.py).
    leaving, ctx.leaving = ctx.leaving, {}
    not_told = [a for a in spares if a not in leaving.values()]
    if not_told:
        leaving.update(ctx.group.submit(not_told, RankCalls.leave_generation))
    ctx.recovery_clock.mark("planned")
    refs = ctx.group.submit(list(gen.members.values()), RankCalls.join_generation, args)
    # Waited for while the members answer liveness probes (a model build or an init_from read can take
    # minutes): elastic.rebuild_timeout_s is how often they are probed, not a deadline.
    outcome = collect_while_alive(ctx.group, refs, ctx.cfg.elastic.rebuild_timeout_s,
                                  f"generation {gen.number}: joining", stop_early=_join_broken)
    if leaving:
        ctx.group.collect(leaving, 30.0)
    ctx.generation = GenerationRecord(gen.number, gen.plan, gen.members, infos=dict(outcome.results))
    ctx.recovery_clock.mark("joined")
    return outcome


def _resume_from(ctx: DriverContext, restored: Restored, holders: dict[int, int]) -> None:
    """The generation restored ``restored.step``: snapshots, the microbatch split, the window and the
    progress start again from there."""
    ctx.last_restore = restored
    ctx.recovery_clock.mark("restored")
    if restored.source == "snapshot":
        logger.info("generation %d restored step %d from snapshots: %d bytes fetched for %d bytes of state",
                    ctx.generation.number, restored.step, restored.fetched_bytes, restored.shard_bytes)
    ctx.snapshots.begin_generation(ctx.generation, holders)
    ctx.rebalance.begin(ctx.generation)  # elastic.rebalance: the even split, measured again
    ctx.window.reset(restored.step)
    ctx.hang_watch.new_generation()  # the formation is no step interval, and its pace is its own
    ctx.grow_check.release()  # a grow held in the generation before is decided afresh in this one
    ctx.progress.next_step = restored.step + 1


def _announce(ctx: DriverContext, decision: ResizeDecision, spec: RuntimeSpec, restored: Restored,
              spares: list[int]) -> None:
    """The run's first formation is the ``start`` event now; a later one's event waits in the recovery
    until its first step trained."""
    shape = ctx.generation.plan.shape
    event = {"kind": "rebuild" if decision.reason != "grow" else "grow", "generation": ctx.generation.number,
             "dp": shape.dp, "pp": shape.pp, "tp": shape.tp,
             "dp_replicate": spec.dp.replicate, "resumed_from_step": restored.step,
             "restored_from": restored.source, "restore_s": round(restored.load_s, 4),
             "restored_in_place": restored.direct, "fetched_bytes": restored.fetched_bytes,
             "fetched_ahead_bytes": restored.fetched_ahead_bytes,
             "reason": decision.reason, "spares": len(spares)}
    if decision.reason == "start":
        ctx.metrics.event("start", **{k: v for k, v in event.items() if k != "kind"})
    else:
        ctx.recovery_clock.pending_event = event


def save_before_reform(ctx: DriverContext, step: int, *,
                       only_pending: bool = False) -> Errored | Recovering | None:
    """Commit ``step`` (finishing any save in flight first) so the next generation resumes exactly
    there; ``only_pending``: only finish the save in flight (the snapshot of ``step`` resumes it).
    A member lost meanwhile (a drained node that went early) is a failure like any other; a save
    that fails with everyone alive is storage failing, which stops the run. None when committed."""
    try:
        if only_pending:
            ctx.checkpoints.finish(ctx.group, ctx.generation, step)
        else:
            ctx.checkpoints.save_now(ctx.group, ctx.generation, step)
    except TrainingFailed as exc:
        polled, given_s = probe(ctx.group, list(ctx.generation.members.values()), time.monotonic)
        if polled.ok:
            return Errored(exc)
        polled.hung = {actor: f"no answer within {given_s:.1f} s to a liveness probe after a save failed"
                       for actor in polled.pending}  # not asked again while their survivors are freed
        return Recovering(Phase.STEP, polled)
    return None


def _join_broken(o: CallOutcome) -> bool:
    # A member that died or failed to join leaves the others blocked in the rendezvous.
    return bool(o.dead or o.failed)
