"""Freeing a broken generation (driver side; never imports torch.distributed).

Whatever broke — a training step, a rebuild's rendezvous, a checkpoint load — the same three things
must happen before the next generation can form, and fast (seconds, not ``collective_timeout_s``):

1. tell dead from hung from merely blocked: actors whose call raised ``RayActorError``, or whose
   process on the driver's node is gone before Ray said so (``WorkerGroup.exited``), are dead;
   actors still inside the call get a liveness probe (``hang_watch.probe``, the one definition of
   hung: a live rank answers on its second actor thread within milliseconds, as fast as its peers),
   and only a stopped (SIGSTOP) or wedged process fails to answer — those count as hung (the ones a
   probe already found while the call ran, ``CallOutcome.hung``, are not asked again);
2. SIGKILL dead and hung processes (``WorkerGroup.kill_now``: ``ray.kill`` on a stopped process
   takes ~5 s: docs/design.md, Facts the code relies on, "A hung (stopped) peer is freed only by
   killing it");
3. kick the survivors (shut this generation's gloo sockets, and mid-join their store connection, see
   ``RankActor.kick``) and wait for their calls to return, kicking again those still inside, soon
   at first and then every ``REKICK_S`` (``rekick_waits``): a survivor still leaving the last
   generation when the kick came reaches the rendezvous only afterwards and blocks there for the
   whole store timeout unless kicked again (the chaos bench's kill during a rebuild lost 15 s to
   it). One that never returns is killed too.

The spares on the Ray node of a member lost or silent get a liveness probe too (``spares_beside``),
in the same probe as the members (``probe_members_and_spares``): one gone with the node is dropped
now, before the next formation could promote it. The members that already returned from the broken
call are asked in that probe as well, though nothing is decided about them: they are the peers whose
answers bound the wait for the silent (``hang_watch.probe``'s quiet window). Without them, a probe of
only a vanished node's actors heard nobody and waited its whole ``PROBE_ANSWER_S``.

The survivors' processes are never restarted: that is the point of the elastic design.

One exception to "kill what never returns": a join that failed because the network keeps ranks from
the store or from each other (``meshspeak.rank_errors.UNREACHABLE``: the rank's line names the
address and what to open, workers/reach.py) while every member is alive. Ranks still dialling a
peer then do not return to a kick (there is no connection to shut yet), and killing them as "did not
return" turned a cluster that cannot form its mesh into a silent shrink onto fewer hosts (issue 35).
They are left alone after a short wait (``UNREACHABLE_WAIT_S``) and ``Casualties.unreachable`` carries
the line: the failure policy stops the run with it (exit 2).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshspeak.messages import CallOutcome
from meshspeak.rank_calls import RankCalls
from meshspeak.rank_errors import unreachable
from orchestrator.recovery.hang_watch import probe

if TYPE_CHECKING:  # the Ray-backed group; tests drive these functions with a fake one
    from orchestrator.cluster.worker_group import WorkerGroup

logger = logging.getLogger(__name__)

KICK_S = 10.0
REKICK_S = 1.0  # how often survivors that have not returned from the broken call are kicked again
# ... after a first re-kick this soon, the waits doubling up to REKICK_S. A survivor the first kick
# missed (it was still computing, or leaving the last generation) enters its next collective within
# milliseconds; a whole REKICK_S was a second of every recovery that needed a re-kick. (The chaos
# bench's ~1 s "settled" phases are not these: they are the liveness probe's quiet floor for members
# gone but not yet reported dead, or stopped: recovery/hang_watch.py PROBE_QUIET_FLOOR_S.)
REKICK_FIRST_S = 0.1
# A kicked survivor in a training step returns at its next collective, i.e. within a fraction of a
# step; one still inside after this many steps (at least the floor) is wedged and is killed, instead
# of being waited for until the group timeout: in the chaos bench one survivor's all-gather stayed
# blocked through every kick until gloo's 15 s timeout (2 of 4 campaigns; cause in docs/design.md,
# Failure path, open), which cost more than replacing it.
KICKED_STEPS = 3
KICKED_FLOOR_S = 5.0
MAX_ALIVE_WAITS = 1000  # with while_alive: the rounds' bound, in waits of wait_s (never reached on a clock)
UNREACHABLE_WAIT_S = 3.0  # kicked members of a join the network broke: how long they may take to return


def rekick_waits(wait_s: float) -> list[float]:
    """The waits between kicks that cover ``wait_s``: ``REKICK_FIRST_S`` doubling up to ``REKICK_S``,
    the last one cut to what is left. Their count bounds the rounds when no time passes (tests)."""
    waits: list[float] = []
    pause, total = REKICK_FIRST_S, 0.0
    while total < wait_s:
        waits.append(min(pause, wait_s - total))
        total += waits[-1]
        pause = min(2 * pause, REKICK_S)
    return waits or [wait_s]


def kicked_wait_s(timeout_s: float, pace_s: float | None) -> float:
    """How long kicked survivors of a broken training step may take to return: ``timeout_s`` (the
    group timeout's bound) unless the run's pace is known (``pace_s``: the recent median step), then
    ``KICKED_STEPS`` steps, at least ``KICKED_FLOOR_S``. A rebuild's join or load has no such pace:
    the caller passes None there."""
    if pace_s is None:
        return timeout_s
    return min(timeout_s, max(KICKED_FLOOR_S, KICKED_STEPS * pace_s))


@dataclass
class Casualties:
    """Who a broken fan-out call lost, and why (actor id -> first line of the reason)."""

    lost: set[int] = field(default_factory=set)  # killed: dead, hung, or never freed
    reasons: dict[int, str] = field(default_factory=dict)
    unreachable: str = ""  # with every member alive, the network kept ranks apart: the line naming it
    # Spares (live actors outside the call) on a lost member's node that answered no probe: killed too.
    spares_lost: dict[int, str] = field(default_factory=dict)


def spares_beside(group: WorkerGroup, lost: set[int], members: list[int]) -> list[int]:
    """The spares (live actors outside ``members``) on the Ray node of a ``lost`` member (or of one not
    yet known alive: a member still inside the broken call), other than the driver's own node (which
    is up: the driver runs there), to be asked whether they live.

    A node that vanished takes its spares with it, but Ray reports them dead only once the GCS
    declares the node dead (~15 s; a call meanwhile raises ActorUnavailableError after ~1.8 s:
    docs/design.md, F21). The next formation would promote such a spare — placement knows nodes,
    not which of them are gone — and its join failed only when that call did: in the chaos bench a
    node holding a rank and the spare cost 6.6 s instead of ~2.5 s (a failed join, a second settle,
    two steps re-run). Read before the lost are killed (a kill forgets an actor's node)."""
    nodes = {group.node_ids.get(a) for a in lost} - {None, ""}
    if nodes:
        nodes.discard(group.driver_node())
    if not nodes:
        return []
    return [a for a in group.live_ids if a not in lost and a not in members and group.node_ids.get(a) in nodes]


def probe_members_and_spares(group: WorkerGroup, asked: list[int], beside: list[int], reference: list[int],
                             hang_reason: str) -> tuple[dict[int, str], dict[int, str], set[int]]:
    """One liveness probe of the members still inside the broken call (``asked``), the spares on their
    nodes or on a lost member's (``beside``) and the members that returned from it (``reference``):
    (the hung members: actor id -> ``hang_reason``; the silent spares: actor id -> why; the spares the
    probe found dead). Nothing is decided about ``reference``: live and idle, they answer in
    milliseconds, which gives the silent ``hang_watch.probe``'s quiet window (``PROBE_QUIET_FLOOR_S``)
    instead of its whole ``PROBE_ANSWER_S``. A silent spare is only judged here; whether it is dropped
    depends on whether a member on its node was lost (``free_broken_call``)."""
    polled, given_s = probe(group, [*asked, *beside, *reference], time.monotonic)
    hung = {a: hang_reason for a in asked if a not in polled.results}
    why = {**{a: f"its probe failed: {r}" for a, r in polled.failed.items()},
           **{a: f"its probe found it dead: {r}" for a, r in polled.dead.items()}}
    silent = {a: why.get(a, f"no answer within {given_s:.1f} s to a liveness probe")
              for a in beside if a not in polled.results}
    return hung, silent, set(polled.dead) & set(beside)


def free_broken_call(
    group: WorkerGroup,
    outcome: CallOutcome,
    members: list[int],
    *,
    listeners: dict[int, tuple[tuple[str, int], ...]],
    wait_s: float,
    hang_reason: str,
    while_alive: bool = False,
    generation: int | None = None,
) -> Casualties:
    """Resolve a fan-out call over ``members`` that did not end cleanly (see the module docstring).

    Args:
        outcome: the call's outcome so far (``pending_refs`` still running).
        listeners: actor id -> its gloo listening endpoints in the broken generation (those the
            driver knows: members that finished joining).
        wait_s: how long freed survivors may take to return from the call.
        hang_reason: the reason recorded for actors that answer no liveness probe.
        while_alive: survivors still inside after ``wait_s`` that answer a liveness probe are waited
            for again (a join or load: a rank reading a large checkpoint returns only when its read
            does; time alone never fails a live run). Without it they are killed (a training step:
            a kicked survivor returns within a fraction of a step, one still inside is wedged).
        generation: the broken generation's number, sent with every kick: a rank the kick reaches only
            once it joins a later one ignores it (``RankActor.kick``).

    Returns:
        The casualties; every lost actor is already killed and removed from ``group``, as are the
        spares beside them that answered no probe (``Casualties.spares_lost``, not blamed).
    """
    found = Casualties()
    found.reasons.update(outcome.dead)
    found.reasons.update(outcome.failed)
    dead = set(outcome.dead) | set(outcome.hung)
    found.reasons.update(outcome.hung)  # found by a liveness probe already (recovery/hang_watch.py)
    # A process seen gone (on the driver's node) is dead: no probe to wait out on it.
    gone = group.exited([a for a in outcome.pending if a not in dead])
    dead |= gone
    found.reasons.update({a: "ActorDiedError (its process is gone)" for a in gone})
    asked = [a for a in outcome.pending if a not in dead]
    beside = spares_beside(group, dead | set(asked), members)  # read before any kill (it forgets nodes)
    if asked or beside:
        live = set(group.live_ids)
        # In a join or a load (``while_alive``) a whole host may stall for a moment: members that are
        # idle elsewhere would cut its members' wait to the quiet window, so they are not asked there.
        reference = [] if while_alive else [a for a in members if a not in dead and a not in asked and a in live]
        hung, silent_spares, dead_spares = probe_members_and_spares(group, asked, beside, reference, hang_reason)
        dead |= set(hung)  # silent, or died or failed while asked
        found.reasons.update(hung)
        lost_nodes = {group.node_ids.get(a) for a in dead} - {None, ""}
        # Dropped: the silent spares beside a lost member, and any the probe found dead.
        found.spares_lost = {a: why for a, why in silent_spares.items()
                             if group.node_ids.get(a) in lost_nodes or a in dead_spares}
        if found.spares_lost:
            logger.warning("spares on the node of a lost member did not answer a liveness probe: dropped: %s",
                           found.spares_lost)
    group.kill_now(dead | set(found.spares_lost))
    found.lost = dead | _free_survivors(group, outcome, members, dead, listeners, wait_s, found, while_alive,
                                        generation)
    return found


def _free_survivors(group: WorkerGroup, outcome: CallOutcome, members: list[int], dead: set[int],
                    listeners: dict[int, tuple[tuple[str, int], ...]], wait_s: float, found: Casualties,
                    while_alive: bool, generation: int | None) -> set[int]:
    """Kick the survivors and wait for their calls to return (step 3 of the module docstring); the
    ones killed because they never did. Sets ``found.unreachable`` instead when the network broke the
    join (the module docstring's exception): then nobody is killed."""
    live = set(group.live_ids)
    survivors = [a for a in members if a not in dead and a in live]
    # Survivors' listeners, and apart the dead ones' (a dead rank's port may already belong to another
    # process: a rank matches those only against the connections its join recorded, RankActor.kick).
    alive = [ep for a in survivors for ep in listeners.get(a, ())]
    gone = [ep for a in members if a not in survivors for ep in listeners.get(a, ())]
    if survivors:
        group.call(survivors, RankCalls.kick, (alive, gone, generation), timeout_s=KICK_S)
    # Let the freed survivors finish their (failed) call so their threads are idle again.
    still = {ref: a for ref, a in outcome.pending_refs.items() if a not in dead}
    cut_off = {a: r for a, r in outcome.failed.items() if unreachable(r)}
    if cut_off and not dead:  # the network, not a rank (module docstring): nobody is killed for it
        _wait_returned(group, still, (alive, gone, generation), UNREACHABLE_WAIT_S, found.reasons)
        found.unreachable = unreachable_line(cut_off)
        return set()
    if not still:
        return set()
    never = _wait_returned(group, still, (alive, gone, generation), wait_s, found.reasons, stop_if_unreachable=not dead,
                           while_alive=while_alive)
    late_cut_off = {a: r for a, r in found.reasons.items() if unreachable(r)}
    if late_cut_off and not dead:  # one that did return said why the others cannot
        found.unreachable = unreachable_line(late_cut_off)
        return set()
    if never:
        logger.warning("actors %s did not come back after the kick: killing them", sorted(never))
        found.reasons.update({a: "did not return after the kick" for a in never})
    group.kill_now(never)
    return never


def _wait_returned(group: WorkerGroup, still: dict, kick_args: tuple, wait_s: float, reasons: dict[int, str], *,
                   stop_if_unreachable: bool = False, while_alive: bool = False) -> set[int]:
    """Wait up to ``wait_s`` for the kicked survivors' calls (``still``: ref -> actor id) to return,
    kicking again (``kick_args``) the ones still inside after each of ``rekick_waits`` (see the module
    docstring); the actors that died meanwhile or never returned. The errors of the calls that failed
    unreachable are added to ``reasons`` (a join that waited out a peer it could not connect to says
    so only now), and with ``stop_if_unreachable`` the wait ends there. With ``while_alive``, the ones
    still inside at the end that answer a liveness probe get ``wait_s`` again (``free_broken_call``).
    Bounded by rounds as well as by the clock."""
    lost: set[int] = set()
    deadline = time.monotonic() + wait_s
    waits = rekick_waits(wait_s)
    rounds = len(waits)
    for round_no in range(1, MAX_ALIVE_WAITS * rounds + 1):
        pause = waits[(round_no - 1) % rounds]
        late = group.collect(still, max(0.05, min(pause, deadline - time.monotonic())))
        lost |= set(late.dead)
        cut_off = {a: r for a, r in late.failed.items() if unreachable(r)}
        reasons.update(cut_off)
        still = late.pending_refs
        if cut_off and stop_if_unreachable:
            break
        if not still:
            break
        if time.monotonic() >= deadline or round_no % rounds == 0:  # (rounds: a clock standing still, tests)
            if not while_alive:
                break
            still = _alive_among(group, still, lost, wait_s)
            if not still:
                break
            deadline = time.monotonic() + wait_s
        group.call(sorted(set(still.values())), RankCalls.kick, kick_args, timeout_s=KICK_S)
    return lost | set(still.values())


def _alive_among(group: WorkerGroup, still: dict, lost: set[int], wait_s: float) -> dict:
    """The calls in ``still`` whose actors answer a liveness probe (the silent ones and the dead are
    added to ``lost``), logged as waited for."""
    polled, _ = probe(group, sorted(set(still.values())), time.monotonic)
    silent = set(polled.pending) | set(polled.dead)
    lost |= silent
    alive = {ref: a for ref, a in still.items() if a not in silent}
    if alive:
        logger.warning("actors %s still inside the broken join or load %.0f s after the kick, and alive: "
                       "waiting %.0f s more", sorted(set(alive.values())), wait_s, wait_s)
    return alive


def reason_line(reasons: dict[int, str]) -> str:
    """The distinct first lines of the reasons, for a ``failure`` event."""
    return "; ".join(sorted({v.splitlines()[0][:200] for v in reasons.values()}))


def unreachable_line(reasons: dict[int, str]) -> str:
    """The distinct lines of ranks the network kept apart, whole (they name the address and what to
    open) and without their kind: the run's one error line."""
    return "; ".join(sorted({v.splitlines()[0].split(":", 1)[-1].strip() for v in reasons.values()}))
