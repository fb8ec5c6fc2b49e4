"""Faults a rank injects into itself on purpose (``RankActor.arm_fault``), so tests and the chaos bench
can prove recovery from each (worker side; no Ray).

Signals ("kill" = SIGKILL, "hang" = SIGSTOP), once, at one of five points: at (or a delay into) a
training step, right after the rank's first forward of a step (deterministically mid-step: its
peers are then blocked in that step's collectives), at the start of joining a generation, at the
start of loading a checkpoint or snapshot, and inside the background checkpoint write (of step ``at``
or the first save after it). And faults that leave the process running, in ``steps`` train steps from
``at``: "nan" puts a NaN into this rank's gradient (a bad step); "slow" burns ``delay_s`` CPU seconds
and "sleep" sleeps ``delay_s`` inside the first block's forward of the step (a straggler:
workers/compute_clock.py); "sleep" at ``where="microbatch"`` sleeps there in every microbatch's forward
(a slower device: bench/rebalance.py); "sleep" at ``where="ckpt_write"`` stalls every checkpoint write from step ``at`` on by ``delay_s`` (slow
storage: the save's collectives wait for this rank).

Two seams, and nothing else knows a fault by name: the actor tells ``Faults.reached`` where it is
(joining, loading, a step, a snapshot, an eval, a checkpoint write), and the runtime calls the
``StepHooks`` points inside a step (workers/step_hooks.py), which ``Faults`` implements: the step's
straggler sleep and CPU burn go to the compute clock, a "forward" signal hooks the first stage's
forward, and a "nan" poisons the gradient once the backward is done.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from workers.step_hooks import StepHooks
from workers.write_faults import dcp_write_function, die_inside_next_dcp_write, stall_inside_next_dcp_write

logger = logging.getLogger(__name__)

FAULT_SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}
STEP_FAULTS = ("nan", "slow", "sleep")
# Where a fault fires; ``at`` is a step number for "step"/"ckpt_write", a generation number otherwise.
FAULT_POINTS = ("step", "forward", "join", "load", "ckpt_write")
# Delays that widen a race on purpose (kind "sleep"; ``at`` is a step): "snapshot" sleeps ``delay_s``
# before the snapshot of step ``at`` is planned from the state; "eval" sleeps ``delay_s`` inside the
# first block's forward of the first eval batch after step ``at`` (its parameters unsharded by FSDP then);
# "tied" sleeps ``delay_s`` once step ``at``'s backward is done, before the pipeline's tied copies are
# summed (its tied partner then waits inside ``TiedGrads.sync``: tests/e2e/test_hosts_kick.py).
SLEEP_POINTS = ("snapshot", "eval", "tied")


class Faults(StepHooks):
    def __init__(self) -> None:
        self._armed: dict[str, tuple[int, str, float]] = {}  # point -> (at, kind, delay_s)
        self._step: dict[str, tuple[int, int, float]] = {}  # STEP_FAULTS kind -> (at, steps, delay_s)
        self._sleeps: dict[str, tuple[int, float]] = {}  # SLEEP_POINTS point -> (at, delay_s)
        self._slow_writes: tuple[int, float] | None = None  # every save from step ``at`` stalls delay_s

    def arm(self, at: int, kind: str, delay_s: float, where: str, steps: int) -> None:
        """See ``RankActor.arm_fault``; bad arguments raise, so a test never arms nothing."""
        if (kind in STEP_FAULTS and where == "step" or kind == "sleep" and where == "microbatch") and steps >= 1:
            self._step[kind if where == "step" else "sleep_each"] = (at, steps, delay_s)
            return
        if kind == "sleep" and where in SLEEP_POINTS:
            self._sleeps[where] = (at, delay_s)
            return
        if kind == "sleep" and where == "ckpt_write":  # slow storage, from the save of step ``at`` on
            dcp_write_function()  # fail now, not silently at the write, if torch moved it
            self._slow_writes = (at, delay_s)
            return
        if kind not in FAULT_SIGNALS or where not in FAULT_POINTS:
            raise ValueError(f"arm_fault: kind must be one of {list(FAULT_SIGNALS)}, "
                             f"where one of {list(FAULT_POINTS)}")
        if where == "ckpt_write":
            dcp_write_function()  # fail now, not silently at the write, if torch moved it
        self._armed[where] = (at, kind, delay_s)

    def disarm(self) -> None:
        """Drop every armed fault. A step fault is kept after it fired (it covers ``steps`` step
        numbers, and a re-run step is the same number), so an actor reused for another run, whose
        steps count from 1 again, would meet it there; the runtime holds this object, so it is
        emptied in place."""
        self._armed.clear()
        self._step.clear()
        self._sleeps.clear()
        self._slow_writes = None

    # -- the actor's seam -------------------------------------------------------------------------
    def reached(self, where: str, at: int, runtime=None) -> None:
        """The actor reached ``where`` ("join", "load", "step", "snapshot", "eval", "ckpt_write") at
        ``at``: whatever is armed there happens now. "eval" needs the ``runtime`` (its first block's
        forward sleeps)."""
        if where == "snapshot":
            time.sleep(self._take_sleep("snapshot", at))
        elif where == "eval":
            runtime.compute_clock.sleep_s = self._take_sleep("eval", at)  # slept in the first block's forward
        elif where == "ckpt_write":
            self._before_checkpoint_write(at)
        else:
            self._signal(where, at)

    def _take_sleep(self, where: str, at: int) -> float:
        """The armed ``SLEEP_POINTS`` delay at ``where`` for ``at`` (once), else 0."""
        armed = self._sleeps.get(where)
        if armed is None or armed[0] != at:
            return 0.0
        del self._sleeps[where]
        logger.warning("fault injection: sleep %.2fs at %s %d", armed[1], where, at)
        return armed[1]

    def _take(self, where: str, at: int) -> tuple[int, str, float] | None:
        fault = self._armed.get(where)
        # A checkpoint write's fault fires at the first save of step ``at`` or later: a save due while
        # another still writes is made a few steps late (``checkpoint.when_busy``).
        if fault is None or not (fault[0] == at or where == "ckpt_write" and at > fault[0]):
            return None
        del self._armed[where]
        return fault

    def _signal(self, where: str, at: int) -> None:
        """Signal this process now (or ``delay_s`` later) if a fault is armed at ``where``/``at``."""
        fault = self._take(where, at)
        if fault is None:
            return
        _, kind, delay = fault
        logger.warning("fault injection: %s at %s %d", kind, where, at)
        if delay <= 0:
            os.kill(os.getpid(), FAULT_SIGNALS[kind])  # right here, deterministically
        else:
            threading.Timer(delay, os.kill, (os.getpid(), FAULT_SIGNALS[kind])).start()

    def _before_checkpoint_write(self, step: int) -> None:
        fault = self._take("ckpt_write", step)
        if fault is not None:
            die_inside_next_dcp_write(FAULT_SIGNALS[fault[1]])
        elif self._slow_writes is not None and step >= self._slow_writes[0]:
            stall_inside_next_dcp_write(self._slow_writes[1])

    # -- the runtime's seam (StepHooks) -----------------------------------------------------------
    def _step_fault(self, kind: str, step: int) -> tuple[int, int, float] | None:
        fault = self._step.get(kind)
        return fault if fault is not None and fault[0] <= step < fault[0] + fault[1] else None

    def step_begins(self, runtime, step: int) -> None:
        """Give the compute clock this step's straggler faults ("slow" / "sleep": workers/compute_clock.py),
        and hook a "forward" fault (a one-shot forward hook on the rank's first stage signals the process
        when that forward returns: unlike a timer it cannot miss a fast step)."""
        slow, sleep = self._step_fault("slow", step), self._step_fault("sleep", step)
        each = self._step_fault("sleep_each", step)
        clock = runtime.compute_clock
        clock.busy_s = slow[2] if slow is not None else 0.0
        clock.sleep_s = sleep[2] if sleep is not None else 0.0
        clock.sleep_each_s = each[2] if each is not None else 0.0
        nan = self._step_fault("nan", step) is not None
        if nan or clock.busy_s or clock.sleep_s or each:
            logger.warning("fault injection at step %d: nan=%s busy=%.2fs sleep=%.2fs sleep/microbatch=%.3fs", step,
                           nan, clock.busy_s, clock.sleep_s, clock.sleep_each_s)
        fault = self._take("forward", step)
        if fault is None:
            return
        sig = FAULT_SIGNALS[fault[1]]
        module = runtime.stages[min(runtime.stages)].module

        def signal_after_forward(*_):
            handle.remove()  # one-shot: a SIGSTOPped rank that is continued runs on unhooked
            logger.warning("fault injection: %s after the first forward of step %d", fault[1], step)
            os.kill(os.getpid(), sig)

        handle = module.register_forward_hook(signal_after_forward)

    def backward_done(self, runtime, step: int) -> None:
        """"sleep" at "tied": sleep here, before the tied copies' sum (``SLEEP_POINTS``)."""
        time.sleep(self._take_sleep("tied", step))

    def gradients_ready(self, runtime, step: int) -> None:
        """"nan": a NaN in this rank's gradient, as a non-finite loss would leave (a bad step everywhere)."""
        if self._step_fault("nan", step) is not None:
            from workers.update_check import poison_grads

            poison_grads(runtime.params, runtime.tied.not_in_norm)
