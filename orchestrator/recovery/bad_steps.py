"""Bad steps, driver side: which steps were skipped, and when a run of them calls for a rollback (pure).

A rank skips a step's update when the step's loss or global grad norm is not finite; the decision is
the all-reduced grad norm, so every rank takes the same one (``workers/runtime.py``) and reports it as
``StepResult.bad``. The driver logs a ``bad_step`` event, records the step as skipped and, after
``train.max_bad_steps`` in a row, rolls back to the newest checkpoint. Steps stay numbered and each
step's batch is a function of its number, so a skipped step passes its batch over and the next step
trains the next one; the LR schedule goes by step number too (the skipped step's LR is never used),
and AdamW's own step count (bias correction) counts updates made. The skipped steps go into every
checkpoint manifest (``skipped_steps``), so a rollback or a resume replays them as skips without
training them: the same choice as the first time (docs/design.md, Bad steps).
"""

from __future__ import annotations

from meshspeak.messages import StepResult
from orchestrator.errors import TrainingFailed


def bad_reason(step: int, results: list[StepResult]) -> str:
    """"" for a good step; else why it was skipped ("loss" if some rank's loss was not finite, else
    "grad_norm"). Ranks disagreeing means their states diverged: the run cannot go on."""
    flags = {bool(r.bad) for r in results}
    if flags == {False}:
        return ""
    if len(flags) > 1:
        ranks = sorted(r.world_rank for r in results if r.bad)
        raise TrainingFailed(f"step {step}: only ranks {ranks} of {len(results)} skipped the update; the ranks' "
                             "states diverged (a bug: the skip decision is global)")
    return "loss" if any(r.bad == "loss" for r in results) else "grad_norm"


class BadSteps:
    """The skipped steps of a run and the current run of bad steps."""

    def __init__(self, max_in_row: int, skipped: set[int] | None = None) -> None:
        self.max_in_row = max_in_row
        self.skipped: set[int] = set() if skipped is None else skipped  # shared with the checkpoint coordinator
        self.in_row = 0

    def is_skipped(self, step: int) -> bool:
        """A step recorded as bad earlier (before a rollback or a resume): skip it again, untrained."""
        return step in self.skipped

    def bad(self, step: int) -> bool:
        """Record a bad step; True when ``max_in_row`` in a row call for a rollback."""
        self.skipped.add(step)
        self.in_row += 1
        if self.in_row >= self.max_in_row:
            self.in_row = 0
            return True
        return False

    def good(self) -> None:
        self.in_row = 0
