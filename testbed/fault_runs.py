"""A controller run on Ray actors with faults armed on purpose, and what its recovery must show.

:func:`run_with_fault` trains ``FAULT_RUN_BASE`` (+ a mesh and extra keys) to the end with faults
armed on generation 1's ranks and checks that no survivor was restarted;
:func:`resumed_from_newest_committed` checks each rebuild resumed from the newest checkpoint committed
before its failure. Used by tests/ray/test_elastic.py, test_elastic_rebuild.py, test_snapshots_mesh.py.
"""

from __future__ import annotations

import json

from meshspeak.rank_calls import RankCalls
from orchestrator.config.load import load_config
from testbed.ray_cluster import make_group
from testbed.ray_harness import make_controller
from testbed.reference import TEST_LR

# Checkpoints every 2 steps and no in-memory snapshots: these runs recover from committed checkpoints
# (from snapshots: tests/ray/test_snapshots.py); growing back is off (grow_check_s).
FAULT_RUN_BASE = [TEST_LR, "model.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
                  "train.steps=8", "checkpoint.every=2", "elastic.collective_timeout_s=60",
                  "elastic.grow_check_s=1e6", "checkpoint.memory_every=0"]


def run_with_fault(tmp_path, store_address, mesh: list[str], kind: str, victim_rank: int, at_step: int,
                   extra: list[str] = (), *, delay_s: float = 0.2, more: list[tuple] = (),
                   where: str = "step", hooks: list = ()):
    """Run to the end with ``kind`` armed on generation 1's ``victim_rank`` at ``at_step`` (``where``).

    ``more`` arms further faults: (generation-1 rank, at, kind, delay_s, where) as ``arm_fault`` takes
    them; ``hooks`` run at every step boundary (``Controller.add_step_hook``). Asserts that every actor that was not a
    victim kept its process (no restart). Returns (controller, summary, overrides).
    """
    overrides = FAULT_RUN_BASE + mesh + list(extra) + [f"checkpoint.dir={tmp_path / 'ckpt'}",
                                                       f"metrics.path={tmp_path / 'm.jsonl'}"]
    cfg = load_config(None, overrides)
    group = make_group(cfg.mesh.world)
    try:
        controller = make_controller(cfg, group, store_address)
        controller.advance()  # FORMING -> RUNNING (generation 1 formed)
        members = controller.generation.members
        faults = [(victim_rank, at_step, kind, delay_s, where), *more]
        victims = {members[f[0]] for f in faults}
        survivors = {a: group.pids[a] for a in group.live_ids if a not in victims}
        for rank, at, fault_kind, delay, where in faults:
            group.call([members[rank]], RankCalls.arm_fault, (at, fault_kind, delay, where), timeout_s=10)
        for hook in hooks:
            controller.add_step_hook(hook)
        # A rank that dies as its step ``at`` starts may take the answer of step ``at - 1`` with it
        # when that step was still in flight (orchestrator/control/window.py): the window drains
        # before each armed step, so the failure is the armed step's, as the tests name it.
        drain_before = {at for _, at, _, _, point in faults if point in ("step", "forward")}
        if drain_before:
            controller.add_step_hook(_drain, steps=drain_before)
        summary = controller.run()
        for actor, pid in survivors.items():  # no survivor was restarted
            assert group.pids[actor] == pid
        assert not victims & set(group.live_ids)
        return controller, summary, overrides
    finally:
        group.shutdown()


def _drain(controller, step: int) -> None:
    pass  # a hook due at a step stops the window short of it: that is all it is for


def resumed_from_newest_committed(metrics_path) -> list[int]:
    """Each rebuild resumed from the newest checkpoint committed before its failure; returns those steps."""
    resumed, committed, newest_at_failure = [], set(), 0
    for record in map(json.loads, open(metrics_path)):
        if record.get("event") == "checkpoint":
            committed.add(record["step"])
        if record.get("event") == "failure":
            newest_at_failure = max(committed, default=0)
        if record.get("event") == "rebuild":
            assert record["resumed_from_step"] == newest_at_failure, record
            resumed.append(record["resumed_from_step"])
    return resumed
