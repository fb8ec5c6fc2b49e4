"""Failure decisions as data: what the controller does after something broke (pure, no Ray).

One failure path serves every phase: a training step, joining a new generation, loading the
checkpoint into it. The Recovering state's handler (orchestrator/control/handlers/recovering.py)
first frees the survivors (``orchestrator.recovery.settle``), then ``diagnose`` turns what it found
into a ``Failure`` (who is blamed, one reason line for the ``failure`` event), and
``FailurePolicy.decide`` returns the decision, which the handler answers as the next state:

* ``Rebuild``: form a new generation from the live actors (the controller goes to REBUILDING; the
  scaling policy picks its dp there). A loss of actors that were all on nodes announced as draining
  (``preempted``: a preemption whose deadline was too short for a save) is not counted.
* ``Raise``: stop the run (``Errored``) with the error it carries:
  - ``TrainingFailed`` when a step failure would exceed ``elastic.max_restarts``;
  - ``RebuildTimeoutError`` when a generation could not be formed within ``elastic.max_restarts``;
  - ``TrainingFailed`` at once when forming a generation broke although no actor was lost: that is no
    elastic business (a bug, bad state), and rebuilding again would only repeat it — unless the
    rendezvous store itself was lost (``store_lost``): the next formation re-hosts it;
  - ``ClusterNetworkError`` (exit 2) at once when the network kept live ranks from the store or from
    each other (``Casualties.unreachable``: one line naming the address and what to open), never a
    rebuild onto fewer hosts.

There is no "retry the step in the same generation": a failed step leaves the survivors' groups
broken (a collective was cut), so every recovery forms a new generation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from meshspeak.messages import StepResult
from orchestrator.errors import ClusterNetworkError, RebuildTimeoutError, TrainingFailed
from orchestrator.recovery.settle import Casualties, reason_line


class Phase(StrEnum):
    """Where a failure happened; the value is how the ``failure`` event's reason names it."""

    STEP = "step"
    JOINING = "joining"
    LOADING = "loading the checkpoint"

    @property
    def forming(self) -> bool:
        """A failure while a generation forms (not while it trains)."""
        return self is not Phase.STEP

    def hang_reason(self, broke_early: bool = False) -> str:
        """The reason recorded for a member that answers no status poll. ``broke_early``: the step's
        call broke before its timeout (a peer died or raised), so the member is silent, not timed out:
        stopped, wedged, or gone with a node that vanished (Ray reports such actors dead only later)."""
        if self is Phase.STEP:
            if broke_early:
                return "no answer to a liveness probe after the step broke (stopped, wedged, or its node gone)"
            return "no progress within elastic.step_timeout_s"
        return f"no answer within elastic.rebuild_timeout_s while {self.value}"


@dataclass(frozen=True)
class Failure:
    """What broke, as found after the survivors were freed."""

    phase: Phase
    step: int  # the step being trained, or while forming the next step to train
    generation: int
    lost: frozenset[int]  # actor ids killed (dead, hung, or never freed)
    ranks: tuple[int, ...]  # world ranks blamed in the event
    reason: str  # the event's reason line
    reasons: Mapping[int, str] = field(default_factory=dict)  # actor id (-1: nobody) -> reason
    store_lost: bool = False  # the rendezvous store's host was found dead (forming only)
    preempted: bool = False  # every lost actor was on a node announced as draining
    unreachable: str = ""  # the network kept live ranks apart (settle.Casualties.unreachable): the line


def diagnose(
    phase: Phase,
    *,
    step: int,
    generation: int,
    members: Mapping[int, int],
    found: Casualties,
    results: Iterable[StepResult] = (),
    step_timeout_s: float,
    store_lost: bool = False,
    preempted: frozenset[int] = frozenset(),
) -> Failure:
    """The ``Failure`` of generation ``generation`` (``members``: world rank -> actor id).

    A step failure blames the ranks that were lost; only when none was (a latched error, a timeout)
    the ones with a reason. Errors latched in ``results`` count as reasons; with no reason at all
    every rank was alive and error-free, just slower than ``elastic.step_timeout_s``. A failure while
    forming blames the lost ranks only.
    """
    rank_of = {actor: rank for rank, actor in members.items()}
    reasons = dict(found.reasons)
    if phase is Phase.STEP:
        for r in results:
            if not r.ok and r.error:
                reasons.setdefault(members.get(r.world_rank, -1), r.error)
        if not reasons:
            reasons[-1] = (f"step {step} exceeded elastic.step_timeout_s={step_timeout_s:g} "
                           "with every rank alive and none progressing for that long (wedged in a kernel "
                           "or a collective): raise it if one action legitimately takes this long")
        blamed = found.lost or set(reasons)
        reason = reason_line(reasons)
    else:
        blamed = found.lost
        reason = f"rebuild of generation {generation} failed while {phase.value}: {reason_line(reasons)}"
        if store_lost:
            reason += " (the rendezvous store was lost: re-hosting it)"
        if found.unreachable:
            reason = f"generation {generation} cannot form: {found.unreachable}"
    return Failure(phase=phase, step=step, generation=generation, lost=frozenset(found.lost),
                   ranks=tuple(sorted(rank_of[a] for a in blamed if a in rank_of)),
                   reason=reason, reasons=reasons, store_lost=store_lost,
                   preempted=bool(found.lost) and set(found.lost) <= preempted, unreachable=found.unreachable)


@dataclass(frozen=True, slots=True)
class Rebuild:
    """Form a new generation from the live actors; ``restarts`` counts this one."""

    restarts: int


@dataclass(frozen=True, slots=True)
class Raise:
    """Stop the run with ``error``."""

    error: TrainingFailed


class FailurePolicy:
    """Decides each failure against the restart budget (``elastic.max_restarts``), which it counts."""

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.restarts = 0

    def decide(self, failure: Failure) -> Rebuild | Raise:
        budget = f"elastic.max_restarts={self.max_restarts}"
        if failure.preempted:
            return Rebuild(self.restarts)  # a node the cloud took, with notice: not a fault
        if not failure.phase.forming:
            return self._restart(TrainingFailed, (
                f"giving up after {self.restarts} restarts ({budget}); last failure at step "
                f"{failure.step}: raise elastic.max_restarts or look at the failure events in the "
                "metrics file"))
        if failure.unreachable:
            return Raise(ClusterNetworkError(failure.reason))
        if not failure.lost and not failure.store_lost:
            return Raise(TrainingFailed(failure.reason))
        return self._restart(RebuildTimeoutError, (
            f"could not form generation {failure.generation} within {budget} tries ({failure.reason})"))

    def _restart(self, error: type[TrainingFailed], message: str) -> Rebuild | Raise:
        self.restarts += 1
        if self.restarts > self.max_restarts:
            return Raise(error(message))
        return Rebuild(self.restarts)
