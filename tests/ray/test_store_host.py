"""The rendezvous store's host dies mid-run: the next generation gets a new store, and the run still
equals one process (issue 17: "kill the store host mid-run -> the run finishes, losses equal")."""

from __future__ import annotations

import pytest

from meshspeak.rank_calls import RankCalls
from orchestrator.cluster.store_provider import StoreProvider
from orchestrator.config.load import load_config
from testbed.ray_cluster import make_group
from testbed.ray_harness import events, last_losses, make_controller
from testbed.reference import CONTROLLER_FP32, TEST_LR, assert_matches_reference, reference

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

STEPS = 8
OVERRIDES = [TEST_LR, "model.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
             f"train.steps={STEPS}", "mesh.dp=2", "mesh.tp=1", "checkpoint.every=2",
             "elastic.collective_timeout_s=60", "elastic.grow_check_s=1e6"]


@pytest.mark.timeout(400)
def test_store_host_killed_mid_run_then_a_rank_dies(ray_local, tmp_path):
    """The store's actor is killed after step 3; a rank dies in step 5. The rebuild re-hosts the store
    (a new address) and the shrunk mesh forms through it; losses equal the single-process run."""
    overrides = OVERRIDES + [f"checkpoint.dir={tmp_path / 'ckpt'}", f"metrics.path={tmp_path / 'm.jsonl'}"]
    cfg = load_config(None, overrides)
    provider = StoreProvider()
    group = None
    try:
        provider.begin()  # as launch.py: the store's start overlaps the ranks'
        begun = provider._begun[0]
        group = make_group(2)
        controller = make_controller(cfg, group, provider)
        controller.advance()  # generation 1 formed through the first store
        first = provider.address()
        assert provider.hosted == 1 and first[0] == "127.0.0.1"  # one machine: loopback only
        assert provider.handle._actor_id == begun._actor_id  # the begun host, no second start
        assert provider.standbys_taken == 0  # the begun host is the first store, not a standby taking over
        killed = []

        def kill_store(c, step):
            if step == 4 and not killed:
                killed.append(provider.handle)
                ray.kill(provider.handle, no_restart=True)

        controller.add_step_hook(kill_store)
        victim = controller.generation.members[1]
        survivor = controller.generation.members[0]
        pid = group.pids[survivor]
        group.call([victim], RankCalls.arm_fault, (5, "kill", 0.0, "forward"), timeout_s=10)
        summary = controller.run()

        assert killed and summary.final_step == STEPS and summary.restarts == 1
        assert provider.hosted == 2 and provider.address() != first  # re-hosted, new address
        assert provider.standbys_taken == 1  # by the standby that was waiting (not a new actor's start-up)
        assert group.pids[survivor] == pid  # the survivor was not restarted
        failure, = events(tmp_path / "m.jsonl", "failure")
        assert failure["step"] == 5 and failure["ranks"] == [1]
        rebuild, = events(tmp_path / "m.jsonl", "rebuild")
        assert rebuild["dp"] == 1
        assert_matches_reference(last_losses(tmp_path / "m.jsonl"), None, reference(overrides, STEPS), CONTROLLER_FP32)
    finally:
        if group is not None:
            group.shutdown()
        provider.close()


@pytest.mark.timeout(180)
def test_the_standby_starts_after_a_step_and_takes_over_when_the_store_dies(ray_local):
    """``begin`` starts the store alone (a standby importing torch beside the ranks slowed their start);
    the standby starts at the first ``step_read`` after the store was taken, and when the store dies
    the next ``address()`` takes the standby (no start waited for) and asks for a new one, again
    started only at the next ``step_read``."""
    provider = StoreProvider(ping_timeout_s=60)  # the standby may still be importing torch
    try:
        provider.begin()
        begun = provider._begun[0]
        assert provider._standby is None
        first = provider.address()
        assert provider.handle._actor_id == begun._actor_id and provider._standby is None
        provider.step_read()
        standby = provider._standby[0]
        provider.step_read()  # one standby, not one per step
        assert provider._standby[0]._actor_id == standby._actor_id
        ray.kill(provider.handle, no_restart=True)
        address = provider.address()
        assert provider.handle._actor_id == standby._actor_id and (provider.hosted, provider.standbys_taken) == (2, 1)
        assert provider.healthy() and address != first and address[0] == "127.0.0.1"
        assert provider._standby is None
        provider.step_read()
        assert provider._standby is not None and provider._standby[0]._actor_id != standby._actor_id
    finally:
        provider.close()


@pytest.mark.timeout(180)
def test_a_begun_store_that_died_before_it_was_taken_is_replaced_by_a_new_host(ray_local):
    """No standby waits before the first step: a begun store that died before ``address()`` took it
    is replaced by a new host (its start waited for), and a standby is due at the next step."""
    provider = StoreProvider()
    try:
        provider.begin()
        begun = provider._begun[0]
        ray.kill(begun, no_restart=True)
        address = provider.address()
        assert provider.handle._actor_id != begun._actor_id and (provider.hosted, provider.standbys_taken) == (1, 0)
        assert provider.healthy() and address[0] == "127.0.0.1" and provider._standby is None
        provider.step_read()
        assert provider._standby is not None
    finally:
        provider.close()
