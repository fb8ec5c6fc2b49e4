"""Forming a generation: plan the mesh, assign ranks, have the members join, restore the newest state
(driver side; no Ray, no torch). Called by the controller's FORMING and REBUILDING handlers only.

What each member gets, once per generation: its ``JoinSpec`` (world rank, mesh, store prefix), the
``RuntimeSpec`` every member shares, and its ``GenerationOrders`` — its pipeline action list (the
same every step, so steps carry only their number) and, with ``checkpoint.memory_every``, the handle
of the actor that holds its snapshots (docs/design.md, Generations; In-memory snapshots).
"""

from __future__ import annotations

import logging

from meshspeak.messages import CallOutcome, GenerationOrders, JoinSpec, RuntimeSpec
from meshspeak.rank_calls import RankCalls
from orchestrator.control.controller_view import FormationView
from orchestrator.control.generation import GenerationRecord, assign_ranks, runtime_spec
from orchestrator.control.scaling import ResizeDecision
from orchestrator.control.states import ControllerState, Running
from orchestrator.errors import TrainingFailed
from orchestrator.plan.mesh_plan import MeshPlan, make_plan
from orchestrator.recovery.failure_policy import Phase
from orchestrator.recovery.hang_watch import collect_while_alive
from orchestrator.saves.checkpointing import RestoreFailed
from orchestrator.saves.snapshots import Restored

logger = logging.getLogger(__name__)


def form_generation(c: FormationView, decision: ResizeDecision) -> ControllerState:
    """Form the next generation at ``decision.dp`` from the live actors and resume it from the newest
    snapshot or checkpoint: Running when it worked, else the failure path's state."""
    previous = c.generation
    number = (previous.number + 1) if previous else 1
    plan = make_plan(c.cfg, decision.dp)
    members, spares = assign_ranks(c.group.live_ids, c.group.node_ips, plan.shape)
    c.spares.formed(number, members, spares)
    c.health.stragglers.forget(set(members.values()))
    spec = _shared_spec(c, plan)
    gen = GenerationRecord(number, plan, members)
    holders = c.snapshots.holders_for(gen, {a: c.group.node_ids.get(a, "") for a in members.values()})
    outcome = _join(c, gen, spares, _join_args(c, gen, spec, holders))
    if not outcome.ok:
        return c.fail(Phase.JOINING, outcome)
    try:  # in-memory snapshots when every shard has a live copy, else the newest checkpoint
        restored = c.snapshots.restore_best(c.group, c.generation, c.ckpt,
                                            at_most=c.progress.next_step - 1)
    except RestoreFailed as exc:
        return c.fail(Phase.LOADING, exc.outcome)
    _resume_from(c, restored, holders)
    _announce(c, decision, spec, restored, spares)
    c.spares.refill(plan.shape.world)
    return Running()


def _shared_spec(c: FormationView, plan: MeshPlan) -> RuntimeSpec:
    """The ``RuntimeSpec`` every member of the generation shares."""
    resuming = c.ckpt.resume_point() is not None
    # The ranks skip the random init a load overwrites (a checkpoint, or a snapshot set with a live copy
    # of every shard); a load that then never comes fails their first step (workers/runtime.py).
    snapshot = c.snapshots.active and c.snapshots.usable(set(c.group.live_ids)) is not None
    return runtime_spec(c.cfg, plan, data_path=c.data_path, use_gpu=c.use_gpu, mask_eos_id=c.mask_eos_id,
                        resuming=resuming, load_follows=resuming or snapshot)


def _join_args(c: FormationView, gen: GenerationRecord, spec: RuntimeSpec,
               holders: dict[int, int]) -> dict[int, tuple[JoinSpec, RuntimeSpec, GenerationOrders]]:
    """Each member's join call: its ``JoinSpec``, the shared spec, and its ``GenerationOrders``."""
    number, plan, members = gen.number, gen.plan, gen.members
    actions = plan.actions()
    host, port = c.store.address()
    args = {}
    for rank, actor in members.items():
        orders = GenerationOrders(actions=tuple(actions[plan.shape.coords(rank).pp]),
                                  snapshot_every=c.snapshots.every if holders else 0,
                                  holder=c.group.handle(members[holders[rank]]) if holders else None,
                                  holder_rank=holders.get(rank, -1))
        args[actor] = (JoinSpec(number, plan.shape, rank, host, port, f"{c.run_id}-gen{number}",
                                 store_secret=c.store_secret), spec, orders)
    return args


def _join(c: FormationView, gen: GenerationRecord, spares: list[int], args: dict) -> CallOutcome:
    """Spares leave the old generation, the members join the new one; the controller's generation is
    the new one from here, with what its members reported."""
    if spares:
        c.group.call(spares, RankCalls.leave_generation, timeout_s=30.0)
    c.recovery.mark("planned")
    refs = c.group.submit(list(gen.members.values()), RankCalls.join_generation, args)
    # Waited for while the members answer liveness probes (a model build or an init_from read can take
    # minutes): elastic.rebuild_timeout_s is how often they are probed, not a deadline.
    outcome = collect_while_alive(c.group, refs, c.cfg.elastic.rebuild_timeout_s,
                                  f"generation {gen.number}: joining", stop_early=_join_broken)
    c.generation = GenerationRecord(gen.number, gen.plan, gen.members, infos=dict(outcome.results))
    c.recovery.mark("joined")
    return outcome


def _resume_from(c: FormationView, restored: Restored, holders: dict[int, int]) -> None:
    """The generation restored ``restored.step``: snapshots, the microbatch split, the window and the
    progress start again from there."""
    c.last_restore = restored
    c.recovery.mark("restored")
    if restored.source == "snapshot":
        logger.info("generation %d restored step %d from snapshots: %d bytes fetched for %d bytes of state",
                    c.generation.number, restored.step, restored.fetched_bytes, restored.shard_bytes)
    c.snapshots.begin_generation(c.generation, holders)
    c.rebalance.begin(c.generation)  # elastic.rebalance: the even split, measured again
    c.window.reset(restored.step)
    c.hang_watch.pause()  # the formation is no step interval
    c.progress.next_step = restored.step + 1


def _announce(c: FormationView, decision: ResizeDecision, spec: RuntimeSpec, restored: Restored,
              spares: list[int]) -> None:
    """The run's first formation is the ``start`` event now; a later one's event waits in the recovery
    until its first step trained."""
    shape = c.generation.plan.shape
    event = {"kind": "rebuild" if decision.reason != "grow" else "grow", "generation": c.generation.number,
             "dp": shape.dp, "pp": shape.pp, "tp": shape.tp,
             "dp_replicate": spec.dp.replicate, "resumed_from_step": restored.step,
             "restored_from": restored.source, "restore_s": round(restored.load_s, 4),
             "reason": decision.reason, "spares": len(spares)}
    if decision.reason == "start":
        c.metrics.event("start", **{k: v for k, v in event.items() if k != "kind"})
    else:
        c.recovery.pending_event = event


def save_before_reform(c: FormationView, step: int, *, only_pending: bool = False) -> ControllerState | None:
    """Commit ``step`` (finishing any save in flight first) so the next generation resumes exactly
    there; ``only_pending``: only finish the save in flight (the snapshot of ``step`` resumes it).
    A member lost meanwhile (a drained node that went early) is a failure like any other; a save
    that fails with everyone alive is storage failing, which stops the run."""
    try:
        if only_pending:
            c.ckpt.finish(c.group, c.generation, step)
        else:
            c.ckpt.save_now(c.group, c.generation, step)
    except TrainingFailed:
        polled = c.group.call(list(c.generation.members.values()), RankCalls.status, timeout_s=3.0)
        if polled.ok:
            raise
        return c.fail(Phase.STEP, polled)
    return None


def _join_broken(o: CallOutcome) -> bool:
    # A member that died or failed to join leaves the others blocked in the rendezvous.
    return bool(o.dead or o.failed)
