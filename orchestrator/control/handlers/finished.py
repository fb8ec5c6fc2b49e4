"""The run's end: the Finishing state's handler, and what a Finished run answers (driver side; no Ray,
no torch).

``Finishing(step)`` comes from a step boundary with nothing in flight: ``train.steps`` done (the
Running handler's boundary, control/step_loop.py) or a stop signal (``stopped``: `ray job stop`,
Ctrl-C; control/boundary.py's ``decide_stop``). Its handler commits the last step — the save in flight
first, then ``step`` itself unless it is committed already — and logs ``done`` or ``stopped``; the run
is then ``Finished``. A save that fails with every rank alive is checkpoint storage failing: the
answer is ``Errored`` instead (handlers/errored.py), as anywhere else in the loop.

Once the run is Finished (or Errored) nothing more is saved: the controller gives the checkpoint
directory's run lease back as it enters either (control/controller.py, ``_set_state``). ``outcome``
is what a finished run answers its caller (``Controller.run``; launch.py then shuts the actors and
the store down).
"""

from __future__ import annotations

from orchestrator.control.context import DriverContext
from orchestrator.control.generation import RunSummary
from orchestrator.control.states import Errored, Finished, Finishing
from orchestrator.errors import TrainingFailed


def handle(state: Finishing, ctx: DriverContext) -> Finished | Errored:
    try:
        if state.stopped:
            _stop(ctx, state.step)
        else:
            _finish(ctx, state.step)
    except TrainingFailed as exc:  # checkpoint storage failing with every rank alive
        return Errored(exc)
    return Finished(state.step)


def _finish(ctx: DriverContext, step: int) -> None:
    """``train.steps`` done: the run ends on a committed checkpoint of its last step (a rerun resumes
    at the end, not ``checkpoint.every`` steps back)."""
    ctx.checkpoints.finish_run(ctx.group, ctx.generation, step)
    ctx.metrics.event("done", step=step)


def _stop(ctx: DriverContext, step: int) -> None:
    """Stopped by a signal: commit ``step`` so a rerun re-runs no step."""
    saved = bool(ctx.checkpoints.user_dir)  # without it nothing outlives the run: a rerun starts over
    (ctx.checkpoints.save_now if saved else ctx.checkpoints.finish)(ctx.group, ctx.generation, step)
    ctx.progress.resume_step = (ctx.checkpoints.last_committed if saved else 0) + 1
    ctx.metrics.event("stopped", step=step, resume_step=ctx.progress.resume_step)


def outcome(state: Finished, ctx: DriverContext) -> RunSummary:
    """What the run answers: its last step, generations, restarts, losses, the actors' pids and the
    step a rerun resumes at."""
    return RunSummary(
        final_step=ctx.progress.next_step - 1,
        generations=ctx.generation.number if ctx.generation else 0,
        restarts=ctx.failures.restarts,
        losses=dict(ctx.progress.losses),
        pids=dict(ctx.group.pids),
        resume_step=ctx.progress.resume_step,
    )
