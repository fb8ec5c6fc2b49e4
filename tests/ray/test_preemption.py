"""Preemption notices on a multi-node Ray (``ray.cluster_utils.Cluster``): a node hosting ranks is
drained the way a cloud's notice drains it (``DRAIN_NODE_REASON_PREEMPTION`` with a deadline) and
removed at the deadline.

* 20 s of notice: at the next boundary the driver re-forms the mesh without the node's ranks before
  it goes — from the in-memory snapshots (the default) when their copies on the staying node hold
  every shard, the step's save owed (made at the next boundary), else (snapshots off) after saving
  the step — and trains on: no step trained twice, no failure, no restart counted, the survivors
  keep their processes, losses equal one process's; a ``preemption`` event.
* 1 s of notice: too short for a save; with in-memory snapshots (the default) whose copies are on
  the staying node, the mesh re-forms from them at once (no failure, no step re-run) and the save is
  owed (made at the next boundary); without snapshots the event says so and the node's loss takes
  the failure path (not counted against ``elastic.max_restarts``); losses equal one process's.

Its own Ray cluster: a CPU-less head (driver, store host), a 2-CPU node that stays, and per test a
2-CPU node that is drained, so the dp=4 mesh has 2 ranks on each.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from orchestrator.cluster.store_provider import StoreProvider
from orchestrator.config.load import load_config
from testbed.ray_cluster import make_group, multinode_ray
from testbed.ray_harness import events, last_losses, make_controller
from testbed.reference import CONTROLLER_FP32, TEST_LR, assert_matches_reference, reference

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 10
DRAIN_AT = 3  # the step during which the notice arrives
OVERRIDES = [TEST_LR, "model.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
             f"train.steps={STEPS}", "mesh.dp=4", "mesh.pp=1", "mesh.tp=1", "checkpoint.every=2",
             "elastic.collective_timeout_s=60", "elastic.grow_check_s=1e6",
             "elastic.drain_poll_s=0.001"]  # look at every step boundary: the test knows when


@pytest.fixture(scope="module")
def cluster():
    with multinode_ray(1) as (nodes, _):  # a 2-CPU node that stays; each test adds its victim
        provider = StoreProvider()  # on the driver's node: the head
        provider.address()
        yield nodes, provider
        provider.close()


def drain(nodes, node_id: str, deadline_s: float) -> None:
    """What a cloud's preemption notice does to a Ray node (as ray/_private/test_utils.py drains)."""
    import time

    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=nodes.address)
    accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   "preempted by the test", int((time.time() + deadline_s) * 1000))
    assert accepted, why


def _run_with_drain(nodes, provider, tmp_path, deadline_s: float, extra: tuple[str, ...] = ()):
    """dp=4 over the staying node and a fresh victim node; the victim is drained during step
    ``DRAIN_AT`` and removed at its deadline (its remaining worker processes killed with it, as a
    real node's would be). Returns (controller, summary, overrides, survivors' pids before)."""
    victim = nodes.add_node(num_cpus=2)
    overrides = OVERRIDES + [*extra, f"checkpoint.dir={tmp_path / 'ckpt'}", f"metrics.path={tmp_path / 'm.jsonl'}"]
    cfg = load_config(None, overrides)
    group = make_group(4)
    removal: list[threading.Timer] = []
    try:
        on_victim = {a for a, n in group.node_ids.items() if n == victim.node_id}
        assert len(on_victim) == 2, group.node_ids  # PACK: two ranks on each 2-CPU node
        survivors = {a: group.pids[a] for a in group.live_ids if a not in on_victim}
        controller = make_controller(cfg, group, provider)

        victim_pids = [group.pids[a] for a in on_victim]  # taken now: the controller drops killed ones

        def remove_victim():
            for pid in victim_pids:
                assert pid > 0  # never os.kill(-1 or 0, ...): that signals every process we may signal
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            nodes.remove_node(victim, allow_graceful=False)

        def notice(c, step):
            if step == DRAIN_AT and not removal:
                drain(nodes, victim.node_id, deadline_s)
                removal.append(threading.Timer(deadline_s, remove_victim))
                removal[0].start()

        controller.add_step_hook(notice)
        summary = controller.run()
        return controller, summary, overrides, survivors, on_victim
    finally:
        for timer in removal:
            timer.join()
        group.shutdown()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshots", "no-snapshots"])
def test_drain_with_20s_notice_reforms_without_the_node(cluster, tmp_path, snapshots):
    nodes, provider = cluster
    extra = () if snapshots else ("checkpoint.memory_every=0",)
    controller, summary, overrides, survivors, on_victim = _run_with_drain(nodes, provider, tmp_path, 20.0, extra)
    m = tmp_path / "m.jsonl"
    preemption, = events(m, "preemption")
    assert preemption["action"] == "evacuate" and len(preemption["ranks"]) == 2
    assert 0 < preemption["deadline_s"] <= 20.0 and preemption["step"] == DRAIN_AT
    assert preemption["from_snapshots"] is snapshots
    assert not events(m, "failure") and summary.restarts == 0
    rebuild, = events(m, "rebuild")
    assert (rebuild["reason"], rebuild["dp"]) == ("preemption", 2)
    assert rebuild["resumed_from_step"] == preemption["step"] - 1  # the step just trained
    saved = [e["step"] for e in events(m, "checkpoint") if e["step"] >= DRAIN_AT - 1][:1]
    if snapshots:  # re-formed at once; the save owed is the first step trained after it
        assert rebuild["restored_from"] == "snapshot" and saved == [DRAIN_AT]
        deferred, = events(m, "checkpoint_deferred")
        assert (deferred["step"], deferred["reason"]) == (DRAIN_AT - 1, "drain")
    else:  # saved before the re-form, and resumed from that save
        assert rebuild["restored_from"] == "storage" and saved == [DRAIN_AT - 1]
    trained = [r["step"] for r in map(json.loads, open(m)) if "loss" in r]
    assert trained == list(range(1, STEPS + 1))  # no step logged twice
    assert {a: summary.pids[a] for a in survivors} == survivors  # the survivors kept their processes
    assert not on_victim & set(summary.pids)
    assert_matches_reference(last_losses(m), None, reference(overrides, STEPS), CONTROLLER_FP32)


@pytest.mark.timeout(600)
def test_drain_with_1s_notice_reforms_from_the_snapshots_and_owes_the_save(cluster, tmp_path):
    """Too short for a save, but each rank's in-memory snapshot has its copy on the other node (the
    default checkpoint.memory_every = 1): the mesh re-forms from them at once, before the node goes."""
    nodes, provider = cluster
    controller, summary, overrides, survivors, on_victim = _run_with_drain(nodes, provider, tmp_path, 1.0)
    m = tmp_path / "m.jsonl"
    preemption, = events(m, "preemption")
    assert (preemption["action"], preemption["from_snapshots"]) == ("evacuate", True)
    assert "shorter than" in preemption["reason"] and len(preemption["ranks"]) == 2
    deferred, = events(m, "checkpoint_deferred")
    assert (deferred["step"], deferred["reason"]) == (DRAIN_AT - 1, "drain")
    assert not events(m, "failure") and summary.restarts == 0
    rebuild, = events(m, "rebuild")
    assert (rebuild["reason"], rebuild["restored_from"], rebuild["dp"]) == ("preemption", "snapshot", 2)
    assert rebuild["resumed_from_step"] == DRAIN_AT - 1
    assert [e["step"] for e in events(m, "checkpoint") if e["step"] >= DRAIN_AT][:1] == [DRAIN_AT]  # the owed save
    trained = [r["step"] for r in map(json.loads, open(m)) if "loss" in r]
    assert trained == list(range(1, STEPS + 1))  # no step logged twice
    assert {a: summary.pids[a] for a in survivors} == survivors and not on_victim & set(summary.pids)
    assert_matches_reference(last_losses(m), None, reference(overrides, STEPS), CONTROLLER_FP32)


@pytest.mark.timeout(600)
def test_drain_with_1s_notice_and_no_snapshots_falls_back_to_the_failure_path(cluster, tmp_path):
    nodes, provider = cluster
    controller, summary, overrides, survivors, _ = _run_with_drain(nodes, provider, tmp_path, 1.0,
                                                                   ("checkpoint.memory_every=0",))
    m = tmp_path / "m.jsonl"
    preemption, = events(m, "preemption")
    assert preemption["action"] == "fallback" and "shorter than" in preemption["reason"]
    failure, = events(m, "failure")
    assert len(failure["ranks"]) == 2
    assert summary.final_step == STEPS and summary.restarts == 0  # a preemption is not a fault
    assert {a: summary.pids[a] for a in survivors} == survivors
    assert_matches_reference(last_losses(m), None, reference(overrides, STEPS), CONTROLLER_FP32)
