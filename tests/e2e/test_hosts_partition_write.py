"""Issue 35 item 3 (with #36's fence): a checkpoint write kept going across a partition never lands in a
committed checkpoint nor in a later attempt's directory.

Three hosts on this machine (testbed.netns_hosts): a 0-CPU head on the bridge address (the driver and
the store), two worker hosts of 2 CPUs; dp=2 pp=2 tp=1 in float64, checkpoints every 10 steps. The
driver (``partition_write_driver.py``, started by hand on the head) arms the ranks of one worker host so
that, from step ``SAVE_AT``'s save on, each of their checkpoint writes stalls ``STALL_S`` before its
first byte (slow storage). When their shard files of step ``SAVE_AT`` exist (DCP opens a shard file,
then writes its items) the host's link goes down for ``CUT_S`` > ``STALL_S``: their write goes on while
the host is cut off (the ranks' logs date the stall's start before the cut and the write's end after
the stall ran out). The rest of the cluster finds the host lost, abandons that save and trains on; its
step directory is usually purged as a leftover before the stall runs out, so the late bytes go to
files already unlinked (measured here: the rebuilt run committed step 21-22 within ~5 s of the cut).

The run must exit 0 at its last step and equal one process; every committed checkpoint must be valid,
none may be the cut-off attempt's directory, and each committed attempt directory must hold exactly its
manifest's files (nothing a stale rank wrote).
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from checkpoints.catalog import list_checkpoints
from checkpoints.layout import step_dir_name
from testbed.ray_harness import last_losses
from testbed.reference import CONTROLLER_FP32, TEST_LR, assert_matches_reference, reference
from tests.e2e.hosts import armed_driver, hosts_cluster, rank_log

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

STEPS, EVERY, SAVE_AT = 120, 10, 20
STALL_S, CUT_S = 8.0, 15.0


def watch_sizes(paths: list[Path], stop: threading.Event) -> list[tuple[float, Path, int]]:
    """A thread recording (time, path, size) whenever a watched file's size changes (every 50 ms)."""
    seen: list[tuple[float, Path, int]] = []
    last: dict[Path, int] = {}

    def run():
        while not stop.wait(0.05):
            for path in paths:
                size = path.stat().st_size if path.exists() else -1
                if last.get(path) != size:
                    last[path] = size
                    seen.append((time.time(), path, size))

    threading.Thread(target=run, daemon=True).start()
    return seen


def wait_for_shards(step_dir: Path, ranks: list[int], driver: subprocess.Popen, timeout_s: float) -> list[Path]:
    """The victim ranks' shard files of ``step_dir``'s attempt, once every one of them exists."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [p for r in ranks for p in step_dir.glob(f"g*/__{r}_*.distcp")]
        if len(found) >= len(ranks):
            return found
        assert driver.poll() is None and time.monotonic() < deadline, f"no shards of ranks {ranks} in {step_dir}"
        time.sleep(0.02)


def write_span(log: list[tuple[float, str]], actor: int, attempt: Path) -> tuple[float | None, float | None]:
    """When ``actor``'s stalled write began (its "stalls" line) and when its write to ``attempt`` ended
    (the writer's line about it: done or failed), from the rank log."""
    tag = f"[actor={actor}]"
    began = [t for t, x in log if tag in x and "the checkpoint write stalls" in x]
    ended = [t for t, x in log if tag in x and f"background checkpoint write to {attempt}" in x]
    return (began[0] if began else None), (ended[-1] if ended else None)


def wait_for_write_ends(root: Path, actors: list[int], attempts: set[Path], deadline: float) -> None:
    """Until every one of ``actors`` logged the end of its write to the one attempt in ``attempts``
    (``write_span``), or ``deadline`` (``time.time()``); the test judges what it finds either way."""
    attempt = next(iter(attempts))
    while time.time() < deadline:
        lines = rank_log(root)
        if all(write_span(lines, a, attempt)[1] is not None for a in actors):
            return
        time.sleep(0.5)


def committed_attempts(ckpt: Path) -> list:
    committed = [c for c in list_checkpoints(str(ckpt)) if c.committed]
    assert committed and all(c.valid for c in committed), [(c.step, c.reason) for c in committed]
    return committed


@pytest.mark.timeout(1500)
def test_a_write_kept_going_across_a_partition_never_lands_in_a_committed_or_later_attempt(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    overrides = [TEST_LR, "model.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2",
                 "mesh.dp=2", "mesh.pp=2", "mesh.tp=1", f"train.steps={STEPS}", f"checkpoint.every={EVERY}",
                 "checkpoint.keep=100", f"checkpoint.dir={ckpt}", f"metrics.path={metrics}",
                 "elastic.grow_check_s=1e6", "train.dtype=float64"]
    with hosts_cluster("em-hw-", workers=2, cpus=2) as (cluster, net):
        victim = net.hosts[1]
        spec = {"overrides": overrides, "victim_ip": victim.ip, "save_at": SAVE_AT, "stall_s": STALL_S,
                "armed": str(tmp_path / "armed.json"), "params": str(tmp_path / "params.npz"),
                "release": str(tmp_path / "release")}
        log = tmp_path / "driver.log"
        with armed_driver(cluster, "tests.e2e.partition_write_driver", spec, log) as (driver, armed):
            shards = wait_for_shards(ckpt / step_dir_name(SAVE_AT), armed["ranks"], driver, 600)
            stop = threading.Event()
            sizes = watch_sizes(shards, stop)
            time.sleep(0.2)  # the watcher's first look: the files are still empty (the stall)
            cut_at = time.time()
            net.cut_for(victim, CUT_S)
            time.sleep(CUT_S - 1)
            alive_before_heal = len(net.pids(victim))  # the cut-off host's processes live on
            # The run may end before the partition heals (its 120 steps took ~11 s on a fast machine): the
            # driver then holds its actors until the victims' writes ended (or 120 s), so that what is
            # judged below is the write, not a driver that exited first (spec "release").
            wait_for_write_ends(cluster.root, armed["actors"], {p.parent for p in shards}, cut_at + CUT_S + 120)
            Path(spec["release"]).touch()
            rc = driver.wait(timeout=1200)
            stop.set()
            rank_lines = rank_log(cluster.root)
    out = log.read_text()
    print("\n".join(x for x in out.splitlines() if any(k in x for k in ("failure", "rebuild", "abandon", "final step",
                                                                          "commit", "owed")))[-4000:])
    assert rc == 0, out[-5000:]
    healed_at = cut_at + CUT_S
    # The write was in flight at the cut (each victim shard opened and still empty: the stall) and went on
    # across the partition: each victim rank's stall began before the cut, and its write to that attempt
    # ended (its finishing collective failing, its peers kicked) after the stall ran out, with its
    # processes alive all through the partition. Its bytes went wherever that attempt's files are.
    before = {p: s for t, p, s in sizes if t < cut_at}
    assert all(before.get(p) == 0 for p in shards), (before, sizes)
    assert alive_before_heal > 0
    stale_dirs = {p.parent for p in shards}  # the attempt directory of the cut-off save
    assert len(stale_dirs) == 1, stale_dirs
    spans = {a: write_span(rank_lines, a, next(iter(stale_dirs))) for a in armed["actors"]}
    for actor, (began, ended) in spans.items():
        assert began is not None and ended is not None, [x for _, x in rank_lines if f"[actor={actor}]" in x][-20:]
        assert began < cut_at < began + STALL_S < ended, (actor, began - cut_at, ended - cut_at)
    # Nothing of it is in a committed checkpoint: no committed attempt is that directory, every committed
    # one is valid and holds exactly its manifest's files (a late file would be an extra or a wrong size).
    committed = committed_attempts(ckpt)
    for info in committed:
        dcp_dir = Path(info.dcp_path)
        assert dcp_dir not in stale_dirs, (info.step, dcp_dir)
        on_disk = {p.name: p.stat().st_size for p in dcp_dir.iterdir() if p.suffix == ".distcp"}
        assert on_disk == {Path(f).name: size for f, size in info.manifest.files.items()
                           if f.endswith(".distcp")}, (info.step, on_disk, info.manifest.files)
    assert any(c.step > SAVE_AT for c in committed)
    params = dict(np.load(spec["params"]))
    assert_matches_reference(last_losses(metrics), params, reference(overrides, STEPS), CONTROLLER_FP32)
    print(f"victim shards {sorted(p.name for p in shards)} in {sorted(map(str, stale_dirs))}: empty at the cut; "
          f"their writes (stall began, write ended) relative to the cut: "
          f"{[(round(b - cut_at, 1), round(e - cut_at, 1)) for b, e in spans.values()]} s (partition {CUT_S:.0f} s, "
          f"healed at +{healed_at - cut_at:.0f} s); sizes seen: {[(round(t - cut_at, 1), p.name, n) for t, p, n in sizes]}; "
          f"committed: {[(c.step, Path(c.dcp_path).name) for c in committed]}")
