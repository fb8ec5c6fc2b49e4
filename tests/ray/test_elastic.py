"""Faults injected on purpose: the run shrinks in place (same survivor pids) and still equals one process."""

from __future__ import annotations

import json

import pytest

from meshspeak.rank_calls import RankCalls
from orchestrator.config.load import load_config
from testbed.ray_cluster import make_group
from testbed.ray_harness import (
    TEST_LR,
    assert_matches_reference,
    events,
    last_losses,
    make_controller,
)

pytestmark = pytest.mark.ray

# These (and tests/ray/test_elastic_rebuild.py) prove recovery from committed checkpoints; from
# in-memory snapshots: tests/ray/test_snapshots.py.
BASE = [TEST_LR, "model.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=8",
        "checkpoint.every=2", "elastic.collective_timeout_s=60", "elastic.grow_check_s=1e6",
        "checkpoint.memory_every=0"]


def _run_with_fault(tmp_path, store_address, mesh: list[str], kind: str, victim_rank: int, at_step: int,
                    extra: list[str] = (), *, delay_s: float = 0.2, more: list[tuple] = (),
                    where: str = "step", hooks: list = ()):
    """Run to the end with ``kind`` armed on generation 1's ``victim_rank`` at ``at_step`` (``where``).

    ``more`` arms further faults: (generation-1 rank, at, kind, delay_s, where) as ``arm_fault`` takes
    them; ``hooks`` are added to ``controller.step_hooks``. Asserts that every actor that was not a
    victim kept its process (no restart).
    """
    overrides = BASE + mesh + list(extra) + [f"checkpoint.dir={tmp_path / 'ckpt'}",
                                             f"metrics.path={tmp_path / 'm.jsonl'}"]
    cfg = load_config(None, overrides)
    group = make_group(cfg.mesh.world)
    try:
        controller = make_controller(cfg, group, store_address)
        controller.step()  # FORMING -> RUNNING (generation 1 formed)
        members = controller.generation.members
        faults = [(victim_rank, at_step, kind, delay_s, where), *more]
        victims = {members[f[0]] for f in faults}
        survivors = {a: group.pids[a] for a in group.live_ids if a not in victims}
        for rank, at, fault_kind, delay, where in faults:
            group.call([members[rank]], RankCalls.arm_fault, (at, fault_kind, delay, where), timeout_s=10)
        controller.step_hooks.extend(hooks)
        summary = controller.run()
        for actor, pid in survivors.items():  # no survivor was restarted
            assert group.pids[actor] == pid
        assert not victims & set(group.live_ids)
        return controller, summary, overrides
    finally:
        group.shutdown()


def _resumed_from_newest_committed(metrics_path) -> list[int]:
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


@pytest.mark.timeout(400)
def test_kill_one_actor_of_dp4_shrinks_and_matches(ray_local, store_address, tmp_path):
    # Killed right after its first forward of step 5 (not on a timer, which a fast step can outrun):
    # the survivors are then blocked in step 5's backward collectives.
    controller, summary, overrides = _run_with_fault(
        tmp_path, store_address, ["mesh.dp=4", "mesh.tp=1"], "kill", victim_rank=1, at_step=5,
        where="forward")
    assert summary.restarts == 1 and summary.final_step == 8
    # 3 live actors; dp=3 does not divide the 8-sample batch into 2-sample microbatches -> dp=2 + a spare
    assert controller.generation.shape.dp == 2
    failure, = events(tmp_path / "m.jsonl", "failure")
    assert failure["step"] == 5 and failure["ranks"] == [1]
    rebuild, = events(tmp_path / "m.jsonl", "rebuild")
    # Step 4's shards may still be in flight when the rank dies at step 5: then step 4 is never
    # committed and the run resumes from step 2. Either way only a committed step is used.
    assert rebuild["resumed_from_step"] in (2, 4) and rebuild["recovery_s"] > 0
    records = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    failed_at = next(i for i, r in enumerate(records) if r.get("event") == "failure")
    committed_before = {r["step"] for r in records[:failed_at] if r.get("event") == "checkpoint"}
    assert rebuild["resumed_from_step"] == max(committed_before)
    assert_matches_reference(last_losses(tmp_path / "m.jsonl"), None, overrides, 8)


@pytest.mark.timeout(400)
def test_sigstopped_rank_is_detected_and_dropped(ray_local, store_address, tmp_path):
    controller, summary, overrides = _run_with_fault(
        tmp_path, store_address, ["mesh.dp=2", "mesh.tp=1"], "hang", victim_rank=0, at_step=3,
        extra=["elastic.step_timeout_s=20"], where="forward")
    assert summary.restarts == 1 and controller.generation.shape.dp == 1
    failure, = events(tmp_path / "m.jsonl", "failure")
    assert failure["step"] == 3 and failure["ranks"] == [0]  # stopped after its first forward of step 3
    assert_matches_reference(last_losses(tmp_path / "m.jsonl"), None, overrides, 8)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("dp,pp,tp,victim", [(2, 2, 1, 1), (2, 2, 2, 5)])
def test_kill_drops_the_whole_replica_keeps_pp_tp(ray_local, store_address, tmp_path, dp, pp, tp, victim):
    """A rank of a (2,2,1) / (2,2,2) mesh dies mid-step: one whole replica goes, pp x tp stays."""
    controller, summary, overrides = _run_with_fault(
        tmp_path, store_address, [f"mesh.dp={dp}", f"mesh.pp={pp}", f"mesh.tp={tp}"], "kill",
        victim_rank=victim, at_step=5, delay_s=0.0)
    assert summary.restarts == 1 and summary.final_step == 8
    shape = controller.generation.shape
    assert (shape.dp, shape.pp, shape.tp) == (1, pp, tp)
    # The survivors not in the new mesh stay as spares, alive.
    assert len(summary.pids) == dp * pp * tp - 1  # live actors at the end
    failure, = events(tmp_path / "m.jsonl", "failure")
    assert failure["step"] == 5 and failure["ranks"] == [victim]
    rebuild, = events(tmp_path / "m.jsonl", "rebuild")
    assert (rebuild["dp"], rebuild["pp"], rebuild["tp"]) == (1, pp, tp)
    assert _resumed_from_newest_committed(tmp_path / "m.jsonl") == [rebuild["resumed_from_step"]]
    assert_matches_reference(last_losses(tmp_path / "m.jsonl"), None, overrides, 8)


@pytest.mark.timeout(400)
def test_two_failures_in_a_row(ray_local, store_address, tmp_path):
    """Rank 1 dies in step 3; after that rebuild (dp=2 + a spare) rank 2 dies in step 6: the spare
    takes its place (dp=2 again) and the run still equals one process."""
    controller, summary, overrides = _run_with_fault(
        tmp_path, store_address, ["mesh.dp=4", "mesh.tp=1"], "kill", victim_rank=1, at_step=3,
        delay_s=0.0, more=[(2, 6, "kill", 0.0, "step")])
    assert summary.restarts == 2 and summary.final_step == 8
    assert [f["step"] for f in events(tmp_path / "m.jsonl", "failure")] == [3, 6]
    rebuilds = events(tmp_path / "m.jsonl", "rebuild")
    assert [(r["generation"], r["dp"], r["spares"]) for r in rebuilds] == [(2, 2, 1), (3, 2, 0)]
    # Generation 1's rank 3 was the spare of generation 2 and is a member of generation 3.
    assert sorted(controller.generation.members.values()) == [0, 3]
    assert len(_resumed_from_newest_committed(tmp_path / "m.jsonl")) == 2
    assert_matches_reference(last_losses(tmp_path / "m.jsonl"), None, overrides, 8)
