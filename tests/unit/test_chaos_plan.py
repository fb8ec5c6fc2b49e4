"""bench/chaos.py's plan and set-up, without running a campaign (tests/process/test_bench_scripts.py runs
one): which kinds each cluster gets, the follow-up steps the step hook must run at, the refusal of
"partition" without namespace hosts, and that the bench imports nothing of pytest (a plain install)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import chaos  # noqa: E402
import chaos_faults as cf  # noqa: E402


class _Local:
    kinds_left_out = cf.LocalNodes.kinds_left_out


class _Hosts:
    kinds_left_out = ()


def test_a_local_ray_gets_every_kind_but_partition_and_hosts_get_partition_too():
    local, hosts = chaos.kinds_for(_Local()), chaos.kinds_for(_Hosts())
    assert "partition" not in local and "slow_storage" in local
    assert set(hosts) == set(cf.KINDS) and set(hosts) - set(local) == {"partition"}
    # The quick campaign (60 steps, a fault every 5) holds every kind once, on either cluster.
    for kinds in (local, hosts):
        assert set(chaos.fault_plan(60, 5, 0, kinds).values()) == set(kinds)
    # The full one (200 steps, every 9: 21 slots) holds each local kind at least twice.
    counts = list(chaos.fault_plan(200, 9, 0, local).values())
    assert min(counts.count(k) for k in local) >= 2


def test_the_hook_also_runs_at_each_slow_storage_follow_up_and_injects_a_fault_once():
    plan = {5: "slow_storage", 10: "hang", 15: "slow_storage"}
    campaign = cf.Campaign(nodes=None, provider=None, ckpt_dir=Path("."))
    hook = chaos.fault_hook(plan, campaign, random.Random(0))
    after = cf.FOLLOW_UP_AFTER["slow_storage"]
    assert chaos.hook_steps(plan) == {5, 10, 15, 5 + after, 15 + after}
    ran = []
    campaign.follow_ups[11] = lambda controller, step: ran.append(step) or "done"
    hook(None, 11)  # a follow-up step with no fault of its own
    hook(None, 11)  # a re-run of it after a failure: the follow-up is not run twice
    assert ran == [11] and not campaign.injected


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO / "bench", capture_output=True, text=True, timeout=120)


def test_partition_without_namespace_hosts_is_refused_with_one_line():
    proc = _bench("chaos.py", "--only", "partition", "--out", "/dev/null")
    assert proc.returncode == 2 and "--only partition needs --hosts" in proc.stderr, proc.stderr


def test_the_bench_and_the_testbed_modules_it_imports_need_no_pytest():
    # pytest made unimportable, as on a plain install: every module chaos.py imports, eagerly or in
    # run_campaign / report, still imports.
    code = ("import sys; sys.modules['pytest'] = None\n"
            "import chaos, chaos_faults, chaos_hosts\n"
            "import testbed.ray_cluster, testbed.ray_harness, testbed.reference, testbed.netns_hosts\n")
    proc = _bench("-c", code)
    assert proc.returncode == 0, proc.stderr[-2000:]
