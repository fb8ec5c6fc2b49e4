"""Points inside one rank's training step where something outside the runtime may act; nothing by default.

``RankRuntime`` calls them and knows nothing of who listens or why. The one listener is fault
injection on purpose (``workers.faults.Faults``, armed by ``RankActor.arm_fault``): tests and the
chaos bench make a rank slow, stop it mid-step or put a NaN into its gradient there, to prove that
the run recovers. No torch here: the driver imports the actor module, which imports this.
"""

from __future__ import annotations


class StepHooks:
    def step_begins(self, runtime, step: int) -> None:
        """Train step ``step`` is about to run its first forward (``runtime``: the ``RankRuntime``)."""

    def backward_done(self, runtime, step: int) -> None:
        """Step ``step``'s backward is done; the pipeline's tied copies are not summed yet (workers/tied.py)."""

    def gradients_ready(self, runtime, step: int) -> None:
        """Step ``step``'s backward is done (tied copies summed); its update is not decided yet."""
