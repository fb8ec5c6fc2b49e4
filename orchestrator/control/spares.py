"""Hot spares and actors started in the background (driver side; docs/design.md, Hot spares).

``elastic.spares`` actors beyond the mesh are kept; a re-formed mesh that takes one in reports
``spare_promoted``, and missing spares are requested (``spare_requested``) once each generation's
first step was read (the first generation's too: ``launch.py`` does not wait for them) and at every
grow check, as far as the cluster has
room for them now (``free_slots``), started in the background (``WorkerGroup.start_background``) so
training never stalls on them, and taken in at a step boundary
once they answered (``actors_ready``). ``SparePool`` owns the list of live actors outside the mesh;
the controller tells it when a generation formed and asks it at each boundary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from meshspeak.rank_calls import RankCalls
from orchestrator.errors import WorkerGroupStartupError

START_POLL_S = 0.2  # how often a wait for background-started actors looks for ones that answered

logger = logging.getLogger(__name__)


class SparePool:
    def __init__(self, wanted: int, group, metrics, family: str = "") -> None:
        self.wanted = wanted  # elastic.spares
        self.group, self.metrics = group, metrics
        self.family = family  # model.family's reference: a spare imports its module while it waits
        self.ids: list[int] = []  # live actors outside the current mesh
        self._after_first_step: tuple | None = None  # (world, scaling or None): see ask_after_first_step

    def formed(self, number: int, members: dict[int, int], spares: list[int]) -> None:
        """Generation ``number`` was assigned: report spares it took in, then remember the new spares."""
        promoted = {rank: actor for rank, actor in members.items() if actor in self.ids}
        if promoted:
            self.metrics.event("spare_promoted", generation=number, ranks=sorted(promoted),
                               actors=sorted(promoted.values()))
        self.warm([a for a in spares if a not in self.ids])
        self.ids = list(spares)

    def ask_after_first_step(self, world: int, scaling=None) -> None:
        """What a formation asks for — the spares missing beyond a mesh of ``world`` ranks
        (``refill``) and, after a failure, actors for what it took (``adopt_new_capacity`` with
        ``scaling``) — asked for once the new generation's first step was read (``step_read``), not
        now: an actor's start (a process importing torch, seconds of CPU) competed for the cores with
        the generation's first step, which the recovery's time counts, while the actor answers
        seconds later either way (and minutes, where the autoscaler brings a node)."""
        self._after_first_step = (world, scaling)

    def refill(self, world: int) -> None:
        """Ask for the spares missing beyond a mesh of ``world`` ranks, without waiting: they are
        started in the background and taken in by ``adopt_started`` once they answer."""
        wanted = self.wanted
        if not wanted:
            return
        missing = wanted - (len(self.group.live_ids) - world) - self.group.starting
        if missing <= 0:
            return
        # Only what the cluster holds now: the rest is the autoscaler's to provide (launch.py asked for
        # it), never a placement group left pending (orchestrator/cluster/bundles.py).
        missing = min(missing, self.group.free_slots())
        if missing <= 0:
            return
        try:
            self.group.start_background(missing, strategy="SPREAD")
        except WorkerGroupStartupError as exc:  # e.g. a placement group could not even be created
            logger.info("spares: could not ask for %d yet (%s)", missing, exc)
            return
        self.metrics.event("spare_requested", count=missing)

    def adopt_started(self) -> bool:
        """At each step boundary: actors started in the background that answered become live, outside
        the mesh (spares, or capacity for a grow: True, so the grow check runs now). Spares found on a
        node that died are dropped now (members are found by the next step's call)."""
        ready = self.group.adopt_started()
        lost = [a for a in self.group.lost_ids if a in self.ids]
        if lost:
            logger.info("spares %s were lost with their node", lost)
            self.group.kill(lost)
            self.ids = [a for a in self.ids if a not in lost]
        if ready:
            self.ids += ready
            self.warm(ready)
            self.metrics.event("actors_ready", actors=ready)
        return bool(ready)

    def drop_lost(self, reasons: dict[int, str]) -> None:
        """Spares the failure path found gone with a lost member's node (already killed:
        ``recovery.settle.silent_spares``): no longer spares, reported (``spares_lost``)."""
        if not reasons:
            return
        self.ids = [a for a in self.ids if a not in reasons]
        self.metrics.event("spares_lost", actors=sorted(reasons), reason="; ".join(sorted(set(reasons.values()))))

    def step_read(self) -> None:
        """A step of the generation was read: what its formation asked for (``ask_after_first_step``)
        is started now, once."""
        if self._after_first_step is not None:
            (world, scaling), self._after_first_step = self._after_first_step, None
            self.refill(world)
            if scaling is not None:
                self.adopt_new_capacity(scaling)

    def await_started(self, enough: Callable[[], bool], deadline: float | None = None) -> None:
        """Take in background-started actors as they answer (``adopt_started``) until ``enough()``,
        nothing is starting any more, or ``deadline`` (time.monotonic()) passed."""
        while not enough() and self.group.starting and (deadline is None or time.monotonic() < deadline):
            if not self.adopt_started():
                time.sleep(START_POLL_S)

    def adopt_new_capacity(self, scaling) -> None:
        """Start actors on resources that appeared (autoscaler, replacement node), never blocking."""
        count = scaling.actors_to_adopt(len(self.group.live_ids) + self.group.starting, self.group.free_slots)
        if count:
            try:  # taken in by adopt_started once they answer: the next grow check uses them
                self.group.start_background(count)
            except Exception as exc:  # resources vanished again: try at the next check
                logger.info("grow: could not start actors yet (%s)", exc)

    def warm(self, actors: list[int]) -> None:
        """Have new spares import the training code and the model's family now (``RankActor.warm``);
        not waited for."""
        if actors and self.wanted:
            self.group.submit(actors, RankCalls.warm, (self.family,))
