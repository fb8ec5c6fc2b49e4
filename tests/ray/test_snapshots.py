"""In-memory snapshots on real ranks (checkpoint.memory_every; orchestrator/saves/snapshots.py) on a local
multi-node Ray cluster: a rank killed in a step is restored from its peers' copies, one step re-run,
resharded into the smaller mesh by copies of the old shards' overlaps, the losses the single-process reference's, the survivors never
restarted; with a hot spare promoted into the lost rank's mesh slot every rank's shard keeps its
layout, so each copies it in place (checkpoints/direct_load.py) and the losses are the reference's
still; a rank killed together with the holder of its snapshot falls back to storage, and the rebuild
event says which.

Its own cluster, as tests/ray/test_elastic_nodes.py: a CPU-less head (driver, store host) and two
2-CPU worker nodes, so the ring puts every snapshot's holder on the other node.
"""

from __future__ import annotations

import json

import pytest

from meshspeak.rank_calls import RankCalls
from orchestrator.config.load import load_config
from testbed.ray_cluster import make_group, multinode_ray
from testbed.ray_harness import events, last_losses, make_controller, mesh_params
from testbed.reference import CONTROLLER_FP32, TEST_LR, assert_matches_reference, reference

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

STEPS = 6
OVERRIDES = [TEST_LR, "model.seq_len=32", "model.n_layers=2", "train.global_batch_size=8",
             "train.micro_batch_size=2", f"train.steps={STEPS}", "mesh.dp=4", "mesh.pp=1", "mesh.tp=1",
             "checkpoint.every=2", "checkpoint.memory_every=1", "elastic.collective_timeout_s=60",
             "elastic.grow_check_s=3600"]  # no growing back onto the freed slots: one rebuild to look at


@pytest.fixture(scope="module")
def cluster():
    with multinode_ray(2) as (nodes, _):
        yield nodes


@pytest.fixture(scope="module")
def head_store(cluster):
    from orchestrator.cluster.store_provider import StoreProvider

    provider = StoreProvider()
    provider.address()
    yield provider
    provider.close()


def _run(tmp_path, head_store, victims_of, at: int, dp: int = 4, spares: int = 0, extra: tuple = ()):
    """Train at ``dp`` with a SIGKILL of the actors ``victims_of(controller)`` names, right after their
    first forward of step ``at`` (the snapshot of ``at - 1`` settled first); ``spares``: hot spares;
    ``extra``: more overrides."""
    overrides = OVERRIDES + [f"checkpoint.dir={tmp_path / 'ckpt'}", f"metrics.path={tmp_path / 'm.jsonl'}",
                             f"mesh.dp={dp}", f"elastic.spares={spares}", *extra]
    group = make_group(dp + spares)
    try:
        controller = make_controller(load_config(None, overrides), group, head_store)
        controller.advance()
        armed = []

        def kill(c, step):
            if step == at - 1:
                c.snapshots.settle(c.group)  # so that step at - 1 is snapshot (never skipped)
            if step == at and not armed:
                c.snapshots.settle(c.group)  # the snapshot of step at - 1 reached its holders
                c.ckpt.finish(c.group, c.generation, step - 1)  # and the checkpoint in flight committed
                armed.extend(victims_of(c))
                for actor in armed:
                    c.group.call([actor], RankCalls.arm_fault, (at, "kill", 0.0, "forward"), timeout_s=10)

        controller.add_step_hook(kill)
        pids = dict(group.pids)
        summary = controller.run()
        assert summary.final_step == STEPS and summary.restarts == 1
        survivors = {a: p for a, p in pids.items() if a not in armed}
        assert {a: group.pids[a] for a in survivors} == survivors  # never restarted
        path = tmp_path / "m.jsonl"
        assert_matches_reference(last_losses(path), mesh_params(controller),
                                 reference(overrides, STEPS), CONTROLLER_FP32)
        trained = [r["step"] for r in map(json.loads, open(path)) if "loss" in r and "event" not in r]
        rebuilds = events(path, "rebuild")
        assert len(rebuilds) == 1, [e for e in map(json.loads, open(path)) if "event" in e]
        rebuild = rebuilds[0]
        return rebuild, trained, controller
    finally:
        group.shutdown()


@pytest.mark.timeout(420)
def test_a_killed_rank_is_restored_from_snapshots_with_one_step_rerun(cluster, head_store, tmp_path):
    rebuild, trained, controller = _run(tmp_path, head_store, lambda c: [c.generation.members[1]], at=4)
    assert (rebuild["restored_from"], rebuild["resumed_from_step"]) == ("snapshot", 3)
    assert trained == [1, 2, 3, 4, 5, 6]  # only step 4 (failed, never logged) re-run; storage: 3 too
    assert rebuild["dp"] == 2  # 3 survivors: dp=4's snapshots resharded into dp=2
    # by copies of the old shards' overlaps (checkpoints.direct_load.plan_assembled), not DCP's load
    assert rebuild["restored_in_place"] is True
    assert rebuild["fetched_bytes"] > 0 and rebuild["fetched_ahead_bytes"] == 0  # a new size: pieces of many


@pytest.mark.timeout(420)
def test_a_spare_promoted_into_the_mesh_restores_in_place(cluster, head_store, tmp_path):
    # dp=2 and a spare: the two worker nodes' 4 slots hold 3 actors (ZeRO-3: each rank a half shard)
    rebuild, trained, controller = _run(tmp_path, head_store, lambda c: [c.generation.members[1]], at=4,
                                        dp=2, spares=1)
    assert (rebuild["restored_from"], rebuild["resumed_from_step"], rebuild["dp"]) == ("snapshot", 3, 2)
    assert rebuild["restored_in_place"] is True  # every rank copied an old rank's shard: no DCP load
    # The lost rank's shard, left with one copy, got its second on the spare that loads it
    # (saves/snapshots.py second_homes) while the members joined: no rank read another actor's store
    # in the load, nor fetched it a second time as it joined (workers.snapshot_push.keep_asked).
    assert "given" in rebuild["phases_s"] and rebuild["fetched_bytes"] == 0
    assert trained == [1, 2, 3, 4, 5, 6]


@pytest.mark.timeout(420)
# slow (~18 s): the fall back is decided by the driver, tested on the fake group in the default run
# (tests/unit/test_controller_snapshots.py::test_a_rank_and_its_holder_lost_fall_back_to_storage)
@pytest.mark.slow
def test_a_rank_and_its_snapshots_holder_killed_fall_back_to_storage(cluster, head_store, tmp_path):
    def rank_and_holder(c):
        holders = c.snapshots._holders
        return [c.generation.members[1], c.generation.members[holders[1]]]

    rebuild, trained, controller = _run(tmp_path, head_store, rank_and_holder, at=4)
    assert (rebuild["restored_from"], rebuild["resumed_from_step"]) == ("storage", 2)
    assert trained == [1, 2, 3, 3, 4, 5, 6]  # step 3 trained twice


@pytest.mark.timeout(420)
def test_a_shard_whose_copies_died_heals_from_the_live_hsdp_replica(cluster, head_store, tmp_path):
    """HSDP, 2 replicas of 2 shards: a rank and its snapshot's holder die, the holder in the other
    shard, so both copies of the rank's snapshot are gone (plain FSDP falls back to storage: the test
    above). The other replica's rank of that shard holds the same state: the run resumes from the
    snapshots at dp=2 (the shard group kept), each survivor copying an old rank's shard in place."""
    from meshspeak.mesh import same_shard_ranks

    def rank_and_holder_in_another_shard(c):
        holders, same = c.snapshots._holders, same_shard_ranks(c.generation.shape, 2)
        rank = next(r for r in sorted(holders) if same[holders[r]] != same[r])
        return [c.generation.members[rank], c.generation.members[holders[rank]]]

    rebuild, trained, controller = _run(tmp_path, head_store, rank_and_holder_in_another_shard, at=4,
                                        extra=("mesh.dp_replicate=2",))
    assert (rebuild["restored_from"], rebuild["resumed_from_step"], rebuild["dp"]) == ("snapshot", 3, 2)
    assert rebuild["restored_in_place"] is True
    assert trained == [1, 2, 3, 4, 5, 6]
