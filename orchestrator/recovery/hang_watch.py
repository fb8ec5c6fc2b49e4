"""Telling a hung rank from a slow step while the step runs (driver side; no Ray, no torch).

A rank that stops (SIGSTOP, a frozen VM, a wedged host) leaves its peers blocked in a collective, and
the driver used to learn of it only when ``elastic.step_timeout_s`` ran out and a status poll went
unanswered (the chaos campaign: 13 s per hang with a 10 s timeout, its costliest fault). A frozen
process answers nothing, but a live rank blocked in a collective still answers ``status()`` on its
second thread within milliseconds, as fast as its peers (workers/actor.py; ``probe`` gives a silent
rank 10 times its peers' slowest answer, 1-2 s). So once the oldest step in flight has run
``elastic.hang_probe_factor`` times the recent median step (at least ``PROBE_FLOOR_S``), the ranks
that have not answered it are probed, and again every such interval: one that does not answer the
probe is hung, and the step fails at once. A step that is merely slow is never cut short by
this (every rank answers), and ``elastic.step_timeout_s`` stays the bound for live ranks that make
no progress (e.g. a device kernel that never returns): once it ran out the ranks are asked how long
ago they last progressed (an action of the schedule, a phase of the update: ``WorkerStatus.stalled_s``),
and the step fails only when none did within it (``extended_bound``). As NVIDIA's resiliency extension derives its
hang timeouts from observed iteration times, the interval follows the run's own steps; unlike a
tighter timeout, a probe only ever adds a status call.

``probe`` is the driver's one definition of "this live rank is hung": besides a running step it
decides it while a join, a load or a save is waited for (``collect_while_alive``), when a broken
call's survivors are sorted from the hung (recovery/settle.py), and when a save before a planned
re-form failed (control/formation.py: storage failing with everyone alive, or a lost member).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable

from meshspeak.messages import CallOutcome
from meshspeak.rank_calls import RankCalls

logger = logging.getLogger(__name__)

PROBE_ANSWER_S = 2.0  # a live rank answers a probe in ms even on a loaded host; what a hang costs on top
# Once some ranks answered a probe, the silent ones get this many times the slowest answer (at least
# the floor, at most PROBE_ANSWER_S): a live rank answers on its second thread as fast as its peers.
PROBE_QUIET_FACTOR = 10.0
PROBE_QUIET_FLOOR_S = 1.0
PROBE_POLL_S = 0.1
PROBE_FLOOR_S = 1.0  # never probe sooner than this into a step (short steps: keep the calls rare)
HISTORY = 16  # recent step intervals the median is taken over (a checkpoint step is an outlier)
MIN_HISTORY = 3  # before this many, only elastic.step_timeout_s applies (a generation's first steps)


class HangWatch:
    def __init__(self, factor: float, clock: Callable[[], float]) -> None:
        self.factor = factor  # 0: no probes
        self.clock = clock
        self.intervals: deque[float] = deque(maxlen=HISTORY)
        self._last: float | None = None

    def step_read(self) -> None:
        """A step was read: the time since the one before is one interval of the run's pace."""
        now = self.clock()
        if self._last is not None:
            self.intervals.append(now - self._last)
        self._last = now

    def pause(self) -> None:
        """Something other than steps ran (a boundary, a recovery): the next interval starts later."""
        self._last = None

    def new_generation(self) -> None:
        """A generation formed: its pace is learned anew, so its first steps (one-time costs, another
        dp, actors starting beside it) are bounded by ``elastic.step_timeout_s`` alone until
        ``MIN_HISTORY`` of its intervals were read. Judged by the generation before's pace, live ranks
        a few seconds into their first dp=2 steps after dp=4 ones (load ~25, a replacement actor
        importing torch beside them) answered no probe in time and were killed as hung."""
        self.intervals.clear()
        self._last = None

    def pace_s(self) -> float | None:
        """The recent median step interval (None before ``MIN_HISTORY`` of them)."""
        if len(self.intervals) < MIN_HISTORY:
            return None
        return statistics.median(self.intervals)

    def probe_after_s(self) -> float | None:
        """How long into a step the ranks still in it are probed (None: not yet known, or off)."""
        pace = self.pace_s()
        if not self.factor or pace is None:
            return None
        return max(PROBE_FLOOR_S, self.factor * pace)


def collect_watching(group, refs: dict, timeout_s: float, stop_early, watch: HangWatch, step: int) -> CallOutcome:
    """``group.collect(refs, timeout_s, stop_early=...)``, probing the ranks still in the call every
    ``watch.probe_after_s()``: the actors that do not answer a probe come back in ``pending`` with the
    outcome's ``hung`` set (``settle.free_broken_call`` then kills them without polling again).

    ``timeout_s`` bounds a step without progress: once it ran out, the step goes on while a rank's
    answer to a probe says it progressed within the last ``timeout_s``, or compiled (``train.compile``:
    a first step, recompiles after a rebuild) for the seconds past it (``extended_bound``).
    """
    every = watch.probe_after_s()
    if every is not None and every >= timeout_s:
        every = None
    start = watch.clock()
    allowed_s = timeout_s
    merged = CallOutcome()
    rounds = int(timeout_s // every) + 1 if every else 1  # bounded also when the clock stands still (tests)
    while rounds > 0:
        rounds -= 1
        left = allowed_s - (watch.clock() - start)
        outcome = group.collect(refs, max(0.0, left if every is None else min(every, left)), stop_early=stop_early)
        merged.absorb(outcome)
        if not outcome.pending or outcome.dead or outcome.failed or (stop_early and stop_early(merged)):
            return merged
        refs = outcome.pending_refs
        timed_out = watch.clock() - start >= allowed_s
        if not timed_out and every is None:
            continue
        polled, given = probe(group, outcome.pending, watch.clock)
        if timed_out:
            extended_s = extended_bound(polled, timeout_s, watch.clock() - start, step)
            if extended_s is None:
                return merged
            rounds += int((extended_s - allowed_s) // every) + 1 if every else 1
            allowed_s = extended_s
            continue
        silent = set(polled.pending)
        merged.dead.update(polled.dead)
        if silent or polled.dead:
            ran = watch.clock() - start
            reason = (f"no answer within {given:.1f} s to a liveness probe while step {step} ran "
                      f"{ran:.1f} s (elastic.hang_probe_factor: stopped or wedged)")
            merged.hung = {actor: reason for actor in sorted(silent)}
            return merged
    return merged


def extended_bound(polled: CallOutcome, timeout_s: float, ran_s: float, step: int) -> float | None:
    """The step's new bound once it ran ``ran_s`` past ``timeout_s``, from the ranks' answers to a probe
    (``polled``) — time alone never fails a live run:

    * progress is liveness: ``timeout_s`` from the most recent progress any rank made
      (``WorkerStatus.stalled_s``: a step slowed by a loaded host or slow storage still completes
      actions; a rank wedged in a kernel, and its peers waiting for it in a collective, do not);
    * compiling is work: ``timeout_s`` plus the most seconds a rank compiled inside the step
      (``WorkerStatus.step_compile_s``: one compile can outlast any action).

    None when neither reaches past ``ran_s``: no rank progressed within ``timeout_s``."""
    statuses = list(polled.results.values())
    compile_s = max((getattr(status, "step_compile_s", 0.0) for status in statuses), default=0.0)
    stalled = [s.stalled_s for s in statuses if getattr(s, "stalled_s", None) is not None]
    bound = timeout_s + compile_s
    if stalled:
        bound = max(bound, ran_s + timeout_s - min(stalled))
    if bound <= ran_s:
        logger.warning("step %d ran %.0f s with no rank progressing for elastic.step_timeout_s=%g: %s", step, ran_s,
                       timeout_s, {actor: getattr(status, "stalled_s", None) for actor, status in polled.results.items()}
                       | {actor: "no answer" for actor in polled.pending})
        return None
    logger.warning("step %d ran %.0f s, past elastic.step_timeout_s=%g, but its ranks progressed %s ago%s: "
                   "waiting (a hang is no progress for that long)", step, ran_s, timeout_s,
                   f"{min(stalled):.1f} s" if stalled else "-",
                   f" and compiled {compile_s:.0f} s" if compile_s else "")
    return bound


def probe(group, actors: list[int], clock: Callable[[], float]) -> tuple[CallOutcome, float]:
    """Ask ``actors`` for their status: (what came back — the silent ones in ``pending`` —, the seconds
    the silent ones were given). Each gets up to ``PROBE_ANSWER_S``; once some answered, the rest get
    ``PROBE_QUIET_FACTOR`` times the slowest answer so far, at least ``PROBE_QUIET_FLOOR_S``. A live
    rank answers within milliseconds like its peers (measured in the chaos bench: ~10 ms), so one still
    silent after that is stopped; when none answers, all get the full wait (a host-wide stall)."""
    refs, start = group.submit(actors, RankCalls.status), clock()
    merged = CallOutcome(pending=list(actors), pending_refs=dict(refs))
    slowest: float | None = None
    bound = PROBE_ANSWER_S
    for _ in range(int(PROBE_ANSWER_S / PROBE_POLL_S) + 2):  # bounded also when the clock stands still
        if slowest is not None:
            bound = min(PROBE_ANSWER_S, max(PROBE_QUIET_FLOOR_S, PROBE_QUIET_FACTOR * slowest))
        waited = clock() - start
        # Read before judging the deadline (a zero wait once it has passed): when the driver itself
        # stalled (the GIL, a slow ray.nodes() in the placement watch), the answers that arrived
        # meanwhile are read, not taken for silence; judging first marked every live rank hung.
        out = group.collect(merged.pending_refs, max(0.0, min(PROBE_POLL_S, bound - waited)))
        if out.results or out.dead or out.failed:
            slowest = clock() - start
        merged.absorb(out)
        if not merged.pending_refs or clock() - start >= bound:
            break
    return merged, bound


def collect_while_alive(group, refs: dict, chunk_s: float, what: str, *, stop_early=None) -> CallOutcome:
    """``group.collect(refs)`` for as long as the actors still in the call are alive: time alone never
    fails a live run (a join that builds a large model, a load or a save from slow storage).

    Each ``chunk_s`` with answers missing, those actors get a liveness ``probe``; when all answer, the
    wait goes on and is logged as ``what`` (e.g. "generation 3: joining"). It ends with the answers, a
    death, an error, ``stop_early(outcome)``, or actors that answer no probe: those come back in
    ``pending`` with the outcome's ``hung`` set, as ``collect_watching`` returns them.
    """
    outcome = group.collect(dict(refs), chunk_s, stop_early=stop_early)
    waited_s = chunk_s
    while outcome.pending and not (outcome.dead or outcome.failed or (stop_early and stop_early(outcome))):
        polled, given_s = probe(group, list(outcome.pending), time.monotonic)
        if polled.pending or polled.dead:
            outcome.dead.update(polled.dead)
            reason = f"no answer within {given_s:.1f} s to a liveness probe after {waited_s:.0f} s of waiting"
            outcome.hung = {actor: reason for actor in sorted(polled.pending)}
            return outcome
        logger.warning("%s: actors %s still at it after %.0f s and alive: waiting", what, sorted(outcome.pending),
                       waited_s)
        outcome.absorb(group.collect(outcome.pending_refs, chunk_s, stop_early=stop_early))
        waited_s += chunk_s
    return outcome

