"""Issue 35 item 3: every survivor is freed when a host is cut off, also one that dialled the lost host
and one inside the pipeline-tied embedding's sync (``TiedGrads.sync``, workers/tied.py).

Three hosts on this machine (testbed.netns_hosts): a 0-CPU head on the bridge address (the driver and
the store); the victim host, the lower address, with 1 CPU, and a host of 3 CPUs. A tiny llama with
tied embeddings at dp=2 pp=2 tp=1 in float64, so exactly one rank lives on the victim host and its
tied partner (the other end of its pipeline) on the other host. The driver (``hosts_kick_driver.py``,
started by hand on the head) arms that one rank to sleep once step ``SLEEP_AT``'s backward is done,
before the tied copies are summed; its partner then waits inside ``TiedGrads.sync`` on a connection to
the victim, and the other replica's ranks wait for it in the step's next collective. Once the victim
sleeps, the test records (an outside look: ``py-spy dump`` and ``ss``) that the partner is inside the
sync, and each survivor's gloo connections with the victim: dialled to a victim's listener, or accepted
on its own. The partner's must all be dialled (gloo: the pair's higher address connects), so its sync
is blocked on a connection it dialled to the lost host, which no FIN will end and which its own
listeners do not name. Then the victim host's link goes down for good.

The run must: exit 0 at its last step; lose only the victim's rank (one ``failure`` event naming it, no
survivor killed as "did not return after the kick"); keep every survivor's actor alive to the end;
equal one process within 1e-5 (losses and parameters); leave every committed checkpoint valid.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from checkpoints.catalog import list_checkpoints
from testbed.family_cases import HF_BATCH
from testbed.ray_harness import events, last_losses
from testbed.reference import CONTROLLER_FP32, TEST_LR, assert_matches_reference, reference
from tests.e2e.hosts import armed_driver, hosts_cluster, rank_log
from tests.e2e.raycluster import VENV_BIN

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

STEPS, EVERY, SLEEP_AT = 30, 10, 6
SLEEP_S = 90.0  # the victim's sleep: longer than finding the host lost and freeing the survivors takes
SETTLE_S = 3.0  # after the victim began its sleep: its partner has reached the sync well within this


def stack(pid: int) -> str:
    """The Python stacks of process ``pid`` now (``py-spy dump``: an outside look, the process runs on)."""
    out = subprocess.run([str(VENV_BIN / "py-spy"), "dump", "--pid", str(pid)], capture_output=True, text=True,
                         timeout=60)
    return out.stdout + out.stderr


def connections(ns: str) -> list[tuple[int, tuple[str, int], tuple[str, int]]]:
    """(pid, local, peer) of every established TCP connection in network namespace ``ns`` (``ss``)."""
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-tnpH", "state", "established"], capture_output=True,
                         text=True, timeout=60).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        local, peer = (_endpoint(x) for x in parts[2:4])
        found += [(int(pid), local, peer) for pid in re.findall(r"pid=(\d+)", line)]
    return found


def _endpoint(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    host = host.strip("[]")
    return (host[7:] if host.startswith("::ffff:") else host), int(port)


def wait_for_log(root: Path, needle: str, driver: subprocess.Popen, timeout_s: float) -> float:
    """When a rank first logged a line containing ``needle`` (every node's worker logs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        hits = [t for t, line in rank_log(root) if needle in line]
        if hits:
            return hits[0]
        assert driver.poll() is None and time.monotonic() < deadline, f"no rank logged {needle!r}"
        time.sleep(0.2)


def look_before_the_cut(armed: dict, survivor_ns: str) -> tuple[str, dict[int, tuple[int, int]]]:
    """The partner's stacks, and per survivor world rank its gloo connections with the victim: (how many
    it dialled (to one of the victim's gloo listeners), how many it accepted (on one of its own))."""
    members = {int(r): m for r, m in armed["members"].items()}
    victim = members[armed["victim"]]
    victim_listeners = {tuple(ep) for ep in victim["listeners"]}
    survivors = {m["pid"]: (r, {port for _, port in m["listeners"]}) for r, m in members.items()
                 if r != armed["victim"]}
    counts = {r: [0, 0] for r, _ in survivors.values()}
    for pid, local, peer in connections(survivor_ns):
        if pid not in survivors or peer[0] != victim["ip"]:
            continue
        rank, own_ports = survivors[pid]
        counts[rank][0] += peer in victim_listeners
        counts[rank][1] += local[1] in own_ports
    return stack(members[armed["partner"]]["pid"]), {r: tuple(c) for r, c in counts.items()}


def run_and_cut_the_victims_host(spec: dict, log: Path) -> tuple:
    """Run the driver (tests/e2e/hosts_kick_driver.py) on two namespace hosts; once the victim sleeps in the
    tied sync and its partner has reached it, look at the survivors (``look_before_the_cut``), then cut the
    victim's host for good. Returns (the driver's exit code, what it armed, the partner's stack, the gloo
    connections per survivor, when the victim began its sleep, when its host was cut)."""
    with hosts_cluster("em-hk-", workers=2, cpus=[1, 3]) as (cluster, net):
        victim_host, survivor_host = net.hosts
        spec = {**spec, "victim_ip": victim_host.ip}
        with armed_driver(cluster, "tests.e2e.hosts_kick_driver", spec, log) as (driver, armed):
            victim_actor = armed["members"][str(armed["victim"])]["actor"]
            slept_at = wait_for_log(cluster.root, f"[actor={victim_actor}] workers.faults: fault injection: "
                                    f"sleep {SLEEP_S:.2f}s at tied {SLEEP_AT}", driver, 600)
            time.sleep(SETTLE_S)
            partner_stack, dialled = look_before_the_cut(armed, survivor_host.ns)
            cut_at = time.time()
            net.cut(victim_host)  # for good: the host is lost
            rc = driver.wait(timeout=1200)
    return rc, armed, partner_stack, dialled, slept_at, cut_at


@pytest.mark.timeout(1500)
def test_a_survivor_in_the_tied_sync_and_one_that_dialled_the_cut_host_are_freed(tmp_path):
    pytest.importorskip("transformers")
    from testbed.hf_models import save_tiny_llama

    hf_dir = tmp_path / "llama"
    save_tiny_llama(str(hf_dir), tie=True, bias=True, layers=2)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    overrides = [TEST_LR, f"model.from_hf={hf_dir}", f"checkpoint.init_from={hf_dir}", *HF_BATCH,
                 "mesh.dp=2", "mesh.pp=2", "mesh.tp=1", f"train.steps={STEPS}", f"checkpoint.every={EVERY}",
                 f"checkpoint.dir={ckpt}", f"metrics.path={metrics}", "elastic.grow_check_s=1e6",
                 "train.dtype=float64"]
    spec = {"overrides": overrides, "sleep_at": SLEEP_AT, "sleep_s": SLEEP_S,
            "armed": str(tmp_path / "armed.json"), "result": str(tmp_path / "result.json"),
            "params": str(tmp_path / "params.npz")}
    log = tmp_path / "driver.log"
    rc, armed, partner_stack, dialled, slept_at, cut_at = run_and_cut_the_victims_host(spec, log)
    victim_actor = armed["members"][str(armed["victim"])]["actor"]
    out = log.read_text()
    print("\n".join(x for x in out.splitlines() if any(k in x for k in ("failure", "rebuild", "kick", "final step",
                                                                          "did not")))[-4000:])
    assert rc == 0, out[-5000:]
    # Before the cut: the partner inside the tied sync, and survivors that dialled the victim, the partner among
    # them (its sync can only be blocked on a connection it dialled).
    assert re.search(r"\bsync \(\S*/tied\.py:\d+\)", partner_stack), partner_stack
    assert dialled[armed["partner"]][0] >= 1 and dialled[armed["partner"]][1] == 0, dialled
    # Only the victim's rank was lost: no survivor was killed as "did not return after the kick".
    failures = events(metrics, "failure")
    assert [f["ranks"] for f in failures] == [[armed["victim"]]], failures
    assert "did not come back after the kick" not in out and "did not return" not in json.dumps(failures)
    result = json.loads(Path(spec["result"]).read_text())
    survivors = {m["actor"] for r, m in armed["members"].items() if int(r) != armed["victim"]}
    assert survivors <= set(result["live"]), (survivors, result)
    assert victim_actor not in result["live"], result
    assert_matches_reference(last_losses(metrics), dict(np.load(spec["params"])), reference(overrides, STEPS),
                             CONTROLLER_FP32)
    committed = [c for c in list_checkpoints(str(ckpt)) if c.committed]
    assert committed and all(c.valid for c in committed), [(c.step, c.reason) for c in committed]
    print(f"victim rank {armed['victim']} slept at step {SLEEP_AT} from +0.0 s, cut at +{cut_at - slept_at:.1f} s; "
          f"partner rank {armed['partner']} inside the tied sync; gloo connections with the victim per survivor "
          f"(dialled, accepted): "
          f"{dialled}; failures {[(f['step'], f['ranks'], f['reason'][:120]) for f in failures]}; "
          f"live at the end {result['live']}, last members {result['members']}")
