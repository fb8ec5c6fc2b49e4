"""A join slowed past elastic.rebuild_timeout_s through the real controller and actors (#36, item 1's
acceptance): every rank reads its ``checkpoint.init_from`` weights through the throttled storage
(testbed/slow_storage.py, a Ray worker setup hook) for ``READ_S``, three times the bound.

* Everyone alive: the run completes, no failure, no restart, nothing killed (the driver probes the
  joining ranks each ``rebuild_timeout_s`` and, all answering, waits).
* A rank SIGKILLed while its read is under way is found dead (its join call dies with it: no probe,
  no deadline); the survivor, still reading then, is waited for and kept, and the run completes on
  it. Measured here: the failure is recorded only once the survivor's read ended (the settle waits
  for a kicked rank's call to return, and a join cannot return mid-read): 7 s after the kill with
  READ_S = 6 and rebuild_timeout_s = 2.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from meshspeak.rank_calls import RankCalls  # noqa: E402
from orchestrator.config.load import load_config  # noqa: E402
from testbed.family_cases import HF_BATCH  # noqa: E402
from testbed.hf_models import save_tiny_llama  # noqa: E402
from testbed.ray_cluster import make_group  # noqa: E402
from testbed.ray_harness import events, make_controller  # noqa: E402
from testbed.slow_storage import MARKS_ENV, THROTTLE_ENV  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

REBUILD_TIMEOUT_S, READ_S = 2.0, 6.0
ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def slow_reads(tmp_path_factory):
    """A local Ray whose workers read init_from at size / READ_S bytes a second; (hf dir, marks dir,
    store address)."""
    hf = tmp_path_factory.mktemp("hf")
    save_tiny_llama(str(hf))
    size = sum(p.stat().st_size for p in hf.iterdir() if p.is_file())
    marks = tmp_path_factory.mktemp("marks")
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "testbed.slow_storage.slow_init_from",
                          # The hook is imported before Ray puts the driver's directory on the path.
                          "env_vars": {THROTTLE_ENV: str(size / READ_S), MARKS_ENV: str(marks),
                                       "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}})
    from workers.store import StoreHost

    host = StoreHost.remote()
    try:
        yield hf, marks, ray.get(host.address.remote(), timeout=120)
    finally:
        ray.kill(host)
        ray.shutdown()


def _cfg(hf, tmp_path, steps):
    return load_config(None, [f"model.from_hf={hf}", f"checkpoint.init_from={hf}", *HF_BATCH,
                              f"train.steps={steps}", "mesh.dp=2", "mesh.tp=1", "elastic.min_dp=1",
                              f"elastic.rebuild_timeout_s={REBUILD_TIMEOUT_S}", "elastic.grow_check_s=1e6",
                              f"metrics.path={tmp_path / 'm.jsonl'}"])


def _reads(marks: Path, pid: int, n: int = 1) -> tuple[float, float]:
    """When process ``pid``'s ``n``th init_from read started and ended (time.time())."""
    return tuple(float((marks / f"read-{what}-{pid}-{n}").read_text()) for what in ("started", "done"))


def test_a_join_slower_than_the_rebuild_timeout_completes_while_everyone_lives(slow_reads, tmp_path):
    hf, marks, store = slow_reads
    group = make_group(2)
    try:
        pids = {a: p for a, (p, *_) in group.call(group.live_ids, RankCalls.ping, timeout_s=60).results.items()}
        summary = make_controller(_cfg(hf, tmp_path, 3), group, store).run()
        alive = group.call(group.live_ids, RankCalls.ping, timeout_s=60).results
    finally:
        group.shutdown()
    assert summary.final_step == 3 and summary.restarts == 0
    assert not events(tmp_path / "m.jsonl", "failure")
    assert {a: p for a, (p, *_) in alive.items()} == pids  # nobody killed, nobody restarted
    for pid in pids.values():
        started, done = _reads(marks, pid)
        assert done - started >= 2 * REBUILD_TIMEOUT_S  # the join really outlasted the bound, twice


def test_a_rank_that_dies_during_a_slow_join_is_found_dead_and_the_reading_survivor_kept(slow_reads, tmp_path):
    hf, marks, store = slow_reads
    group = make_group(2)
    controller = make_controller(_cfg(hf, tmp_path, 3), group, store)
    pids = {a: p for a, (p, *_) in group.call(group.live_ids, RankCalls.ping, timeout_s=60).results.items()}
    victim, survivor = sorted(pids)
    ran: dict = {}
    runner = threading.Thread(target=lambda: ran.update(summary=controller.run()), daemon=True)
    try:
        runner.start()
        # Both reads under way (the survivor's may begin a little after the victim's): then the kill.
        started = [marks / f"read-started-{pids[actor]}-1" for actor in (victim, survivor)]
        while not all(mark.exists() for mark in started) and runner.is_alive():
            time.sleep(0.05)
        assert all(mark.exists() for mark in started) and pids[victim] > 1
        os.kill(pids[victim], signal.SIGKILL)  # our own actor's process, mid-read
        killed_at = time.time()
        runner.join(timeout=400)
        assert not runner.is_alive()
        after = group.call(group.live_ids, RankCalls.ping, timeout_s=60).results
    finally:
        group.shutdown()
    assert ran["summary"].final_step == 3 and ran["summary"].restarts == 1
    failure, *_ = events(tmp_path / "m.jsonl", "failure")
    survivor_read = _reads(marks, pids[survivor])  # its generation-1 read
    print(f"killed {killed_at:.2f}, failure recorded {failure['time']:.2f}, survivor's read {survivor_read}")
    assert survivor_read[0] < killed_at < survivor_read[1]  # the death came while the survivor was reading
    # Found as dead (the join call died with it), not as a rank that answered no probe or ran out of time:
    assert "ActorDiedError" in failure["reason"] and "probe" not in failure["reason"], failure
    # The survivor, still reading when the failure came, was waited for and kept (not killed by the
    # settle), and trained generation 2 alone.
    assert {a: p for a, (p, *_) in after.items()} == {survivor: pids[survivor]}
    assert _reads(marks, pids[survivor], 2)[1] > survivor_read[1]  # it joined (and read) again
