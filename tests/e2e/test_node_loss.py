"""Issue 17, as a user met it: a two-node `ray start` cluster on one machine (head 3 CPUs, worker 2),
the driver started by hand on the head with RAY_ADDRESS, dp=4 tp=1 with a rank on the worker node;
the worker node's `ray start` gets SIGTERM mid-run. The run must shrink and finish, and its losses
equal one process's.

Before the fix the rendezvous store's actor was placed with a *soft* affinity to the driver's node,
which Ray ignores for an actor that needs no resources (it picks a random node): in about half the
runs the store sat on the worker node, died with it, and the rebuild failed ("rebuild of generation 2
failed while joining: DistNetworkError", exit 1). So this test also asserts where the store is.
The worker node stops at once on SIGTERM (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0, as raycluster sets
it): a node loss, not a drain.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from tests.e2e.raycluster import RayCluster
from tests.ray.harness import TEST_LR, assert_matches_reference

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

STEPS = 80
OVERRIDES = [TEST_LR, "model.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
             f"train.steps={STEPS}", "mesh.dp=4", "mesh.tp=1", "checkpoint.every=4",
             "elastic.grow_check_s=1e6"]

PLACEMENT = (
    "import ray\nray.init(log_to_driver=False)\nfrom ray.util.state import list_actors, list_nodes\n"
    "for n in list_nodes(): print('NODE', n.node_id, n.is_head_node)\n"
    "for a in list_actors(filters=[('state', '=', 'ALIVE')]): print('ACTOR', a.class_name, a.node_id)\n"
)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.fixture
def cluster():
    root = Path(tempfile.mkdtemp(prefix="em-nl-", dir="/tmp"))
    c = RayCluster(root, num_cpus=3)
    try:
        c.start()
        yield c
    finally:
        c.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def placement(cluster: RayCluster) -> tuple[str, dict[str, list[str]]]:
    """(head node id, class name -> node ids of its live actors)."""
    head, actors = "", {}
    for line in cluster.python(PLACEMENT).splitlines():
        kind, *rest = line.split()
        if kind == "NODE" and rest[1] == "True":
            head = rest[0]
        elif kind == "ACTOR":
            actors.setdefault(rest[0], []).append(rest[1])
    return head, actors


@pytest.mark.timeout(1200)
def test_worker_node_lost_mid_run_the_run_shrinks_and_finishes(cluster, tmp_path):
    worker = cluster.add_node(2)
    metrics = tmp_path / "m.jsonl"
    overrides = OVERRIDES + [f"checkpoint.dir={tmp_path / 'ckpt'}", f"metrics.path={metrics}"]
    args = [a for o in overrides for a in ("--set", o)]
    driver = cluster.driver(args, tmp_path / "driver.log")
    try:
        deadline = time.monotonic() + 600
        while not any(r.get("step", 0) >= 2 and "loss" in r for r in records(metrics)):
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no step 2 in time"
            time.sleep(0.5)
        head, actors = placement(cluster)
        # The store lives beside the driver (the head); at least one rank lives on the worker node.
        assert actors["StoreHost"] == [head], actors
        assert any(node != head for node in actors["RankActor"]), actors
        worker.send_signal(signal.SIGTERM)
        lost_at = max(r["step"] for r in records(metrics) if "loss" in r)
        rc = driver.wait(timeout=900)
    finally:
        if driver.poll() is None:
            driver.kill()
    log = (tmp_path / "driver.log").read_text()
    assert rc == 0, log[-4000:]
    recs = records(metrics)
    failure, = [r for r in recs if r.get("event") == "failure"]
    assert failure["step"] >= lost_at and failure["ranks"]
    rebuild, = [r for r in recs if r.get("event") == "rebuild"]
    assert rebuild["dp"] < 4
    assert [r["step"] for r in recs if r.get("event") == "done"] == [STEPS]
    losses = {r["step"]: r["loss"] for r in recs if "loss" in r}  # a re-run step: the last one wins
    assert_matches_reference(losses, None, overrides, STEPS)
    print(f"node loss after step {lost_at}: failure at step {failure['step']}, rebuilt at "
          f"dp={rebuild['dp']} from step {rebuild['resumed_from_step']} in {rebuild['recovery_s']:.1f}s")
