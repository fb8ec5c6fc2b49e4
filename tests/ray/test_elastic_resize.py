"""Shrink -> grow -> shrink in the same processes: parameters and losses still equal one process.

The grow re-forms a world of the same size as generation 1 with the ranks *permuted* (actor 1 died,
so actor 2 is rank 1 instead of 2, actor 3 rank 2 instead of 3, and a replacement is rank 3). That is
the case where DTensor's process-wide caches, keyed by a DeviceMesh whose equality ignores the
process group and this rank's coordinate, hand a rank the plans it made for its *old* coordinate
(docs/design.md, Generations, and "DTensor caches outlive a re-form"). What prevents it is the
generation-unique mesh axis names (workers/groups.py ``_axis_names``); clearing the caches alone does
not reach every thread's caches.
"""

from __future__ import annotations

import pytest

from meshspeak.rank_calls import RankCalls
from orchestrator.config.load import load_config
from testbed.ray_cluster import make_group
from testbed.ray_harness import events, last_losses, make_controller, mesh_params
from testbed.reference import CONTROLLER_FP32, TEST_LR, assert_matches_reference, reference

pytestmark = pytest.mark.ray

STEPS = 8
OVERRIDES = [TEST_LR, "model.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
             f"train.steps={STEPS}", "mesh.dp=4", "mesh.pp=1", "mesh.tp=1", "checkpoint.every=2",
             "elastic.collective_timeout_s=60", "elastic.grow_check_s=1e6"]


@pytest.mark.timeout(600)
def test_shrink_grow_shrink_same_processes_matches_reference(ray_local, store_address, tmp_path):
    overrides = OVERRIDES + [f"checkpoint.dir={tmp_path / 'ckpt'}", f"metrics.path={tmp_path / 'm.jsonl'}"]
    cfg = load_config(None, overrides)
    group = make_group(4)
    try:
        controller = make_controller(cfg, group, store_address)
        controller.advance()  # generation 1: dp=4, actors 0..3 are ranks 0..3
        first = dict(group.pids)
        # Shrink: actor 1 dies at the start of step 3 -> dp=2 (actors 0, 2; actor 3 a spare).
        group.call([controller.generation.members[1]], RankCalls.arm_fault, (3, "kill", 0.0), timeout_s=10)
        # Grow at step 5 (a replacement actor is started), shrink again at step 7.
        controller.resize_requests = {5: 4, 7: 2}
        shapes: dict[int, tuple[int, dict[int, int]]] = {}  # generation -> (dp, rank -> actor)

        def record(c, step):
            shapes.setdefault(c.generation.number, (c.generation.shape.dp, dict(c.generation.members)))

        controller.add_step_hook(record)
        summary = controller.run()

        assert summary.final_step == STEPS and summary.restarts == 1
        assert [shapes[g][0] for g in sorted(shapes)] == [4, 2, 4, 2]
        # Generation 3 has generation 1's world size with permuted ranks (the case that corrupts).
        assert shapes[3][1] != shapes[1][1] and len(shapes[3][1]) == len(shapes[1][1])
        survivors = {a: pid for a, pid in first.items() if a != 1}
        assert {a: group.pids[a] for a in survivors} == survivors  # same processes throughout
        assert len(group.pids) == 4  # 3 survivors + the replacement
        # All training work of an actor ran on one thread, across four generations (full speed from
        # step 2: per-thread caches are warm; workers/actor.py TRAIN_GROUP).
        threads = group.call(list(group.actors), RankCalls.train_threads, timeout_s=30)
        assert threads.ok and set(threads.results.values()) == {1}
        assert [e["dp"] for e in events(tmp_path / "m.jsonl", "rebuild")] == [2, 4, 2]
        assert_matches_reference(last_losses(tmp_path / "m.jsonl"), mesh_params(controller),
                                 reference(overrides, STEPS), CONTROLLER_FP32)
    finally:
        group.shutdown()
