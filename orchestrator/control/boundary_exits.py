"""The controller's step-boundary exits that are no failure (driver side): a drain notice and a stop.

``Controller`` inherits these methods (split out to keep orchestrator/control/controller.py small, as
``orchestrator.control.rank_health`` is); they use its state (``cfg``, ``group``, ``generation``, ``ckpt``,
``metrics``, ``preemptions``, ``scaling``) and its transitions (``_form``, ``_fail``,
``_recovery_begins``). docs/design.md, Preemption and stopping.

* A drain notice (``orchestrator.recovery.preemption``) with time for a save: the step is committed, the
  draining node's actors are dropped before it goes and the mesh re-forms without them; no failure,
  no restart counted, no step re-run. Too short for a save: an event says so and the node's loss later
  takes the failure path (not counted against the budget).
* A stop (`ray job stop`, Ctrl-C): the step is committed so a rerun re-runs none, then FINISHED.
"""

from __future__ import annotations

from orchestrator.control.generation import State
from orchestrator.control.scaling import carry_out
from orchestrator.errors import TrainingFailed
from orchestrator.recovery.failure_policy import Phase


class BoundaryExits:
    def _stop(self, step: int) -> None:
        """Stopped by a signal (`ray job stop`, Ctrl-C): commit ``step`` so a rerun re-runs no step."""
        saved = bool(self.ckpt.user_dir)  # without it nothing outlives the run: a rerun starts over
        (self.ckpt.save_now if saved else self.ckpt.finish)(self.group, self.generation, step)
        self.resume_step = (self.ckpt.last_committed if saved else 0) + 1
        self.metrics.event("stopped", step=step, resume_step=self.resume_step)
        self.state = State.FINISHED

    def _preempted_at(self, step: int) -> bool:
        """Act on drain notices at the step boundary; True when the mesh was re-formed."""
        if not self.preemptions.due(self.clock()):
            return False
        notice = self.preemptions.check(
            self.group.draining_nodes(), actor_nodes=self.group.node_ids, members=self.generation.members,
            step=step, save_measured_s=self.ckpt.save_measured_s)
        if notice is None:
            return False
        self._preempted |= notice.actors
        self.metrics.event("preemption", **notice.event())
        if notice.action != "evacuate":
            return False  # too short for a save: the node's loss takes the failure path
        if notice.ranks:
            self._recovery_begins()
            try:
                self.ckpt.save_now(self.group, self.generation, step - 1)
            except TrainingFailed:
                # A rank died mid-save (the node went early): the failure path, if someone was lost.
                polled = self.group.call(list(self.generation.members.values()), "status", timeout_s=3.0)
                if polled.ok:
                    raise  # everyone alive: storage failed, which stops the run
                self._fail(Phase.STEP, polled)
                return True
        self.group.kill(sorted(notice.actors))  # before the node goes: nothing left to fail there
        if not notice.ranks:
            return False  # only spares were there: the mesh stays
        self._form(carry_out(self.scaling.after_preemption(len(self.group.live_ids))))
        return True
