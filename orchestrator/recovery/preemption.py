"""Preemption notices as decisions (pure, no Ray): which of the job's actors a node drain takes, and
whether a save fits before the deadline.

A cloud reclaims a spot/preemptible node with notice (AWS 120 s, GKE ~30 s); Ray marks the node as
*draining* with a deadline — the raylet on SIGTERM, the autoscaler before it terminates a node,
``ray drain-node`` — and keeps running the actors already there until the node goes. The controller
polls the draining nodes (``WorkerGroup.draining_nodes``: node id -> seconds left, None for no
deadline) at a step boundary and asks ``PreemptionWatcher.check``, which answers with a
``Preemption``:

* ``evacuate`` from snapshots (``Preemption.from_snapshots``): the in-memory snapshots of the newest
  step read have a copy of every shard on actors that stay (``covered``, asked of the driver's
  snapshot coordinator): the mesh re-forms from them at once, without the draining nodes' actors and
  without waiting for a save, which is owed and made at the new generation's first step boundary (by
  the actors that stay). The re-form needs of the draining actors only their pushes of that step's
  snapshots (waited for at the boundary), so any deadline that outlasts those is long enough. Asked
  whatever the deadline: with time for a save, saving first cost the chaos bench's drains 0.3-0.6 s
  each, and 4.2 s where a save of slow storage was still being written (a save waits for the one in
  flight); the grows, resizes and evictions already skip theirs when the snapshots cover the step.
* ``evacuate``: no snapshot covers the state without the draining nodes (snapshots off, or a shard
  and its copy both there) but the deadline leaves time for a save: save the current step, then
  re-form the mesh without the draining nodes' actors before they die.
  Either way: no failure, no step re-run, survivors keep their processes, and it does not count
  toward ``elastic.max_restarts``. A drain that takes only spares needs no save and no re-form.
* ``fallback``: the deadline is shorter than a save needs (``save_budget_s``, from the measured time
  of the last save) and no snapshot covers the state without the draining nodes, so nothing is
  started that the node's death would cut; the event says so and the node's loss takes the failure
  path (it still does not count toward the restart budget).

Each draining node is decided once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

SAVE_GUESS_S = 10.0  # a save's duration before any was measured in this run
SAVE_FACTOR = 1.5  # a synchronous save rarely takes longer than the last one measured by this much
SAVE_MARGIN_S = 1.0  # the step boundary's own calls (poll, commit) on top


def save_budget_s(measured_s: float | None) -> float:
    """Seconds a draining node must have left for a save of the current step to commit in time."""
    return SAVE_FACTOR * (SAVE_GUESS_S if measured_s is None else measured_s) + SAVE_MARGIN_S


@dataclass(frozen=True)
class Preemption:
    action: str  # "evacuate" | "fallback"
    nodes: tuple[str, ...]  # the draining nodes that hold actors of the job
    actors: frozenset[int]  # the job's actors on them (members and spares)
    ranks: tuple[int, ...]  # their world ranks in the current generation (spares have none)
    deadline_s: float | None  # seconds left until the earliest of their deadlines; None: no deadline
    step: int  # the step boundary it is handled at: the next step to train
    needed_s: float  # what a save was judged to need (0 when no rank is taken)
    reason: str
    from_snapshots: bool = False  # re-formed from the in-memory snapshots at once, the save owed

    def event(self) -> dict:
        """The ``preemption`` metrics event."""
        return {"nodes": list(self.nodes), "ranks": list(self.ranks),
                "deadline_s": None if self.deadline_s is None else round(self.deadline_s, 3),
                "step": self.step, "action": self.action, "needed_s": round(self.needed_s, 3),
                "from_snapshots": self.from_snapshots, "reason": self.reason}


class PreemptionWatcher:
    """Says when to look (every ``poll_s``; 0 = never) and remembers the drains already decided, so
    each node's notice is acted on once, and the actors they take (``doomed``: a loss of only those
    is no fault, ``failure_policy.diagnose``)."""

    def __init__(self, poll_s: float = 1.0) -> None:
        self.poll_s = poll_s
        self.seen: set[str] = set()
        self.doomed: set[int] = set()  # actors on nodes announced as draining
        self._last: float | None = None

    def due(self, now: float) -> bool:
        """Time to poll the draining nodes again (``now``: any monotonic clock)?"""
        if self.poll_s <= 0 or (self._last is not None and now - self._last < self.poll_s):
            return False
        self._last = now
        return True

    def check(
        self,
        draining: Mapping[str, float | None],
        *,
        actor_nodes: Mapping[int, str],
        members: Mapping[int, int],
        step: int,
        save_measured_s: float | None,
        covered: Callable[[frozenset[int]], bool] | None = None,
    ) -> Preemption | None:
        """Decide the drains not decided yet that take actors of the job.

        Args:
            draining: node id -> seconds until its drain deadline (None: no deadline).
            actor_nodes: live actor id -> the node id it runs on.
            members: world rank -> actor id of the current generation.
            step: the next step to train (we are at its boundary).
            save_measured_s: how long the last save took (stage + write), None before any.
            covered: whether the in-memory snapshots of the newest step read hold every shard on
                actors outside the given ones (every actor on a draining node); None: no snapshots.
        """
        ours = set(actor_nodes.values())
        new = {node: left for node, left in draining.items() if node in ours and node not in self.seen}
        if not new:
            return None
        self.seen |= set(new)
        actors = frozenset(a for a, node in actor_nodes.items() if node in new)
        self.doomed |= actors
        rank_of = {actor: rank for rank, actor in members.items()}
        ranks = tuple(sorted(rank_of[a] for a in actors if a in rank_of))
        lefts = [left for left in new.values() if left is not None]
        deadline = min(lefts) if lefts else None
        nodes = tuple(sorted(new))
        if not ranks:
            return Preemption("evacuate", nodes, actors, ranks, deadline, step, 0.0,
                              "only spare actors on the draining nodes: dropped, the mesh stays")
        needed = save_budget_s(save_measured_s)
        short = deadline is not None and deadline < needed
        if short:
            basis = "a guess, no save measured yet" if save_measured_s is None else \
                f"the last save took {save_measured_s:.1f}s"
            when = f"the drain deadline in {deadline:.1f}s is shorter than the {needed:.1f}s a save needs ({basis})"
        else:
            when = ("no deadline" if deadline is None else f"deadline in {deadline:.1f}s") + \
                f", a save needs {needed:.1f}s"
        # Without every actor on a draining node: one decided earlier (a fallback) goes too.
        if covered is not None and covered(frozenset(self.doomed & set(actor_nodes))):
            return Preemption("evacuate", nodes, actors, ranks, deadline, step, needed,
                              f"{when}; the in-memory snapshots hold every shard outside the draining nodes: "
                              f"re-forming from them now, the save of step {step - 1} owed is made after",
                              from_snapshots=True)
        if short:
            return Preemption("fallback", nodes, actors, ranks, deadline, step, needed,
                              f"{when}: falling back to the failure path when the node goes")
        return Preemption("evacuate", nodes, actors, ranks, deadline, step, needed,
                          f"{when}: saving step {step - 1} and re-forming without the draining nodes")
