"""Where an armed fault fires (``workers.faults.Faults``), without firing it: which save a checkpoint
write's kill waits for. The chaos campaign arms it at the next periodic save's step; since a save due
while another still writes is made a few steps late (``checkpoint.when_busy``), it fires at the first
save of that step or later, never at an earlier one, and once."""

from __future__ import annotations

from workers.faults import Faults


def test_a_checkpoint_write_fault_fires_at_the_first_save_at_or_after_its_step():
    faults = Faults()
    faults.arm(70, "kill", 0.0, "ckpt_write", 1)
    assert faults._take("ckpt_write", 65) is None  # an earlier save
    assert faults._take("ckpt_write", 73) == (70, "kill", 0.0)  # 70's save was deferred to 73
    assert faults._take("ckpt_write", 75) is None  # once


def test_other_points_fire_at_their_step_only():
    faults = Faults()
    faults.arm(10, "kill", 0.0, "forward", 1)
    assert faults._take("forward", 11) is None
    assert faults._take("forward", 10) == (10, "kill", 0.0)


def test_disarm_drops_every_armed_fault_including_spent_step_faults():
    # A step fault stays armed after it fired (a re-run step has the same number): an actor reused for
    # another run, whose steps count from 1 again, must be disarmed first (RankActor.disarm_faults).
    faults = Faults()
    faults.arm(3, "nan", 0.0, "step", 1)
    faults.arm(2, "sleep", 0.5, "microbatch", 2)
    faults.arm(5, "sleep", 1.0, "eval", 1)
    faults.arm(4, "kill", 0.0, "forward", 1)
    faults.arm(6, "sleep", 12.0, "ckpt_write", 1)
    assert faults._step_fault("nan", 3) is not None and faults._step_fault("sleep_each", 3) is not None
    faults.disarm()
    assert faults._step_fault("nan", 3) is None and faults._step_fault("sleep_each", 3) is None
    assert faults._take_sleep("eval", 5) == 0.0
    assert faults._take("forward", 4) is None
    assert faults._slow_writes is None
