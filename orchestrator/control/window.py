"""The steps in flight: a bounded window of train steps the driver has sent and not yet collected
(driver side; no Ray, no torch; docs/design.md, The step loop).

Each rank runs its training calls one after another on its one training thread, so the driver can
send step k+1 (and a checkpoint save due after step k) before step k answered: the rank starts it the
moment step k ends, without waiting for the driver to read step k's result, decide and send the next
call. The controller keeps ``size`` steps queued that way and reads them oldest first, all of a
step's answers in one batch (``WorkerGroup.collect``). What must happen *between* two steps on every
rank in a given order is either done by the rank itself (in-memory snapshots) or known in advance, so
the window stops short of it and drains first (a checkpoint save, an eval, a requested resize, a step
hook, a step replayed as a recorded skip: ``handlers/running.py``, ``needs_empty_window``; a save that
must wait for a slow write under ``checkpoint.when_busy = "defer"`` does not): an ordinary step never
waits. Decisions that come up at a boundary unannounced (a stop, a drain notice, a straggler, a grow)
stop the window from growing: the controller is then ``Draining`` (handlers/draining.py), the steps in
flight finish and are recorded, and the decision is carried out at the boundary after the last one.

A broken step breaks every step queued behind it (the ranks refuse them once an error is latched,
and the kick frees the ones blocked in a collective): ``broken`` hands all of them to the failure
path, and none of them is recorded, so a failed generation's steps beyond its last complete one are
never counted. The new generation resumes from the newest snapshot or checkpoint, and each step's
batch is a function of its number: the data contract is the same as without a window.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from meshspeak.messages import CallOutcome
from meshspeak.rank_calls import RankCalls
from orchestrator.recovery.hang_watch import HangWatch, collect_watching

logger = logging.getLogger(__name__)

DEFAULT_SIZE = 2  # steps in flight: one running, one queued behind it (enough to hide the driver)


RESENDS = 3  # times a step answered early (``StepResult.early``) is sent again to those ranks


@dataclass
class InFlight:
    step: int
    refs: dict  # train_step call -> actor id
    args: dict = field(default_factory=dict)  # actor id -> the train_step arguments it was sent


class StepWindow:
    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        if size < 1:
            raise ValueError(f"steps in flight must be >= 1, not {size}")
        self.size = size
        self.flights: deque[InFlight] = deque()
        self.prev_step = 0  # the step the next one sent follows (the ranks check it)

    def __len__(self) -> int:
        return len(self.flights)

    @property
    def last(self) -> int:
        """The newest step sent (or the one the generation resumed after)."""
        return self.flights[-1].step if self.flights else self.prev_step

    def reset(self, prev_step: int) -> None:
        """A generation formed (or reloaded in place) at step ``prev_step``: nothing in flight. (A decision
        waiting for the steps in flight is the ``Draining`` state's, not the window's: a failure or
        rollback that ends those steps hands it on, control/states.py.)"""
        self.flights.clear()
        self.prev_step = prev_step

    def send(self, group, members: list[int], step: int, keep: tuple, split: dict | None = None) -> InFlight:
        """Send ``step`` to ``members``; ``split``: actor -> ``SplitOrders`` when a new microbatch
        split starts at this step (control/rebalance.py)."""
        if split is None:
            shared = (step, keep, self.prev_step)
            refs = group.submit(members, RankCalls.train_step, shared)
            args = dict.fromkeys(members, shared)
        else:
            args = {a: (step, keep, self.prev_step, split[a]) for a in members}
            refs = group.submit(members, RankCalls.train_step, args)
        flight = InFlight(step, refs, args)
        self.flights.append(flight)
        self.prev_step = step
        return flight

    def read_oldest(self, group, timeout_s: float, stop_early: Callable[[CallOutcome], bool],
                    watch: HangWatch | None = None) -> tuple[InFlight, CallOutcome]:
        """Wait for the oldest step's answers (all of them at once), probing the ranks still in it
        with ``watch`` (recovery/hang_watch.py). It stays in the window until ``done`` (a broken one
        is handed to ``broken`` with the rest)."""
        flight = self.flights[0]

        def early_or_stop(o: CallOutcome) -> bool:
            return stop_early(o) or any(r.early for r in o.results.values())

        def collect(refs: dict) -> CallOutcome:
            if watch is None:
                return group.collect(refs, timeout_s, stop_early=early_or_stop)
            return collect_watching(group, refs, timeout_s, early_or_stop, watch, flight.step)

        outcome = collect(flight.refs)
        for _ in range(RESENDS):
            # Ray does not promise the order of a threaded actor's calls: a rank that got this step
            # before the one it follows answered ``early`` without training it, while its peers wait
            # for it in the step's collectives. The step before was read from every rank, so it ran
            # there: send this one again to those ranks, and go on reading the rest. (Still early
            # after RESENDS: the caller fails the step with the ranks' reason.)
            early = sorted(a for a, r in outcome.results.items() if r.early)
            if not early or outcome.dead or outcome.failed or outcome.hung:
                break
            logger.warning("step %d reached actors %s before the step it follows: sent again", flight.step, early)
            refs = group.submit(early, RankCalls.train_step, {a: flight.args[a] for a in early})
            flight.refs = {r: a for r, a in flight.refs.items() if a not in early} | refs
            for actor in early:
                del outcome.results[actor]
            outcome.absorb(collect({**outcome.pending_refs, **refs}))
        return flight, outcome

    def done(self) -> InFlight:
        return self.flights.popleft()

    def broken(self, outcome: CallOutcome) -> CallOutcome:
        """The oldest step broke: its outcome with every younger call in flight added as still running,
        for the failure path to free and wait for (``orchestrator.recovery.settle``)."""
        merged = CallOutcome(results=dict(outcome.results), dead=dict(outcome.dead), failed=dict(outcome.failed),
                             pending=list(outcome.pending), pending_refs=dict(outcome.pending_refs),
                             hung=dict(outcome.hung))
        for refs in [f.refs for f in list(self.flights)[1:]]:
            for ref, actor in refs.items():
                merged.pending_refs[ref] = actor
                if actor not in merged.pending and actor not in merged.dead:
                    merged.pending.append(actor)
        self.flights.clear()
        return merged

    def drain(self, group, timeout_s: float, stop_early) -> CallOutcome | None:
        """Wait for every step in flight and drop them unrecorded (an in-place reload follows); the
        outcome of the first that broke (``broken``), else None."""
        while self.flights:
            _, outcome = self.read_oldest(group, timeout_s, stop_early)
            if not outcome.ok or stop_early(outcome):
                return self.broken(outcome)
            self.done()
        return None
