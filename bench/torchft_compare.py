"""Side by side with torchft: one replica SIGKILLed every K steps and brought back, elastimesh at dp=4
(ZeRO-0 and ZeRO-3) vs torchft 0.2.0's FT-DDP over 4 replica groups (goal: elastimesh's throughput
retained >= torchft's).

    python bench/torchft_compare.py [--steps N] [--every K] [--repeats R] [--sides a,b,c] [--quick] [--out PATH]

Same model (the default ``[model]`` at ``model.seq_len=32``), samples and global batch (8 sequences, 2 per
microbatch) on every side, on this machine, one torch thread per replica:

* **torchft**: 4 replica processes (``bench/torchft_replica.py``: gloo, group world size 1, the Manager
  and ``torchft.DistributedDataParallel`` as torchft's ``train_ddp.py``) and the Lighthouse from the
  wheel, its CLI ``torchft_lighthouse --min_replicas 1`` (heartbeat timeout 1 s instead of 5 s, so a
  dead group leaves the quorum sooner: torchft at its quicker setting). A killed group is started
  again at once and heals from a live peer.
* **elastimesh**: ``python -m orchestrator train --set ...`` at ``mesh.dp=4``, ``mesh.zero`` 0 or 3,
  in-memory snapshots every step (``checkpoint.memory_every=1``), ``elastic.grow_check_s=1``: the
  driver re-forms without the dead rank, then grows back to dp=4 on a new actor when Ray has the slot.

The fault: from step K on, every K steps (never in the last K), the bench SIGKILLs one replica as soon
as the run's log shows step K done: a torchft replica process it started, or one ``RankActor`` process
among the descendants of the CLI process it started (found with psutil; never any other pid).

Per side, per repeat, a fault-free run and a run with faults; the repeats interleave the sides
(A B C, then C B A, ...). Figures per run:

* ``steps_wall_s``: step 1 done -> step N done (start-up left out: Ray's ~30 s vs a process's ~5 s is
  not what is compared); ``total_wall_s``: launch -> exit;
* ``retained``: fault-free ``steps_wall_s`` / faulty ``steps_wall_s`` of the same repeat;
* ``samples_lost``: samples of the committed steps that no replica trained (torchft: a step
  committed by p < 4 groups drops (4 - p) x 2 samples; elastimesh: 0 when every step ran on the full
  global batch, which the run's ``tokens`` per step record checks); ``steps_rerun`` (elastimesh: a
  step logged again after a failure) / ``steps_dropped`` (torchft: a step whose commit failed);
* ``final_loss``: mean training loss of the last 5 steps, and its relative difference from the same
  side's fault-free run. torchft drops a dead group's contribution to a step (its gradient is the mean
  over the groups left), so its losses depart from the fault-free run; elastimesh re-runs the step on
  the full global batch, so its math is the fault-free math (any difference is float reduction order
  at dp=3).

Headlines are medians over the repeats with their spread (min, max); the load average is recorded
before and after every run. Writes ``bench/results/torchft_compare.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, load_average, machine, parser, write_result
from stats import spread

GROUPS, SEQ_LEN = 4, 32
MODEL = [f"model.seq_len={SEQ_LEN}", "train.global_batch_size=8", "train.micro_batch_size=2"]
SAMPLES_PER_GROUP = 2  # global batch 8 over 4 groups
SIDES = ("torchft", "elastimesh_zero0", "elastimesh_zero3")
HEARTBEAT_TIMEOUT_MS = 1000
LAST_STEPS = 5
# Every injected kill is a restart, and on a loaded machine a liveness probe can time out too (a
# failure of its own): the default 3 would end a run that is only being measured.
MAX_RESTARTS = 20
RUN_TIMEOUT_S = 900


def fault_steps(steps: int, every: int) -> list[int]:
    return list(range(every, steps - every + 1, every)) if every else []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a half-written last line
            pass
    return records


def signal_started(pid: int, started: set[int]) -> None:
    """SIGKILL ``pid``, only if this bench started it (or it descends from a process it started)."""
    if pid <= 1 or pid not in started:
        raise RuntimeError(f"refusing to signal pid {pid}: not one this bench started")
    os.kill(pid, signal.SIGKILL)


def child_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")


# -- torchft ---------------------------------------------------------------------------------------
def _spawn_replica(group: int, attempt: int, port: int, steps: int, logdir: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "bench" / "torchft_replica.py"), "--group", str(group), "--groups",
           str(GROUPS), "--lighthouse", f"http://127.0.0.1:{port}", "--steps", str(steps), "--logdir",
           str(logdir), "--attempt", str(attempt)]
    for override in MODEL:
        cmd += ["--set", override]
    out = open(logdir / f"stdout_g{group}_a{attempt}.txt", "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT)


def run_torchft(steps: int, every: int, workdir: Path) -> dict:
    """4 replica groups under the Lighthouse CLI; one group SIGKILLed and restarted every ``every`` steps."""
    logdir = workdir / "ft"
    logdir.mkdir(parents=True)
    port = free_port()
    lighthouse_bin = Path(sys.executable).parent / "torchft_lighthouse"
    t0 = time.time()
    lighthouse = subprocess.Popen([str(lighthouse_bin), "--bind", f"127.0.0.1:{port}", "--min_replicas", "1",
                                   "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS)],
                                  stdout=open(logdir / "lighthouse.txt", "w"), stderr=subprocess.STDOUT)
    procs = {g: _spawn_replica(g, 1, port, steps, logdir) for g in range(GROUPS)}
    attempts = dict.fromkeys(procs, 1)
    kills = []
    try:
        plan = fault_steps(steps, every)
        while any(p.poll() is None for p in procs.values()):
            if time.time() - t0 > RUN_TIMEOUT_S:
                raise RuntimeError(f"torchft run past {RUN_TIMEOUT_S} s; logs in {logdir}")
            done = _ft_done_step(logdir)
            if done >= steps:
                (logdir / "done").touch()
                break
            if plan and done >= plan[0]:
                victim = 1 + len(kills) % (GROUPS - 1)  # groups 1..3 in turn (group 0 is as good as any)
                signal_started(procs[victim].pid, {p.pid for p in procs.values()})
                procs[victim].wait()
                kills.append({"at_step_done": done, "group": victim, "time": time.time()})
                attempts[victim] += 1
                procs[victim] = _spawn_replica(victim, attempts[victim], port, steps, logdir)
                plan.pop(0)
            time.sleep(0.05)
        codes = _ft_wind_down(procs)
    finally:
        for p in list(procs.values()) + [lighthouse]:
            if p.poll() is None:
                signal_started(p.pid, {p.pid})
                p.wait()
    if any(codes.values()):
        raise RuntimeError(f"torchft replicas exited {codes}; logs in {logdir}")
    late = sorted(g for g, code in codes.items() if code is None)
    return {**_ft_figures(logdir, steps), "kills": kills, "late_groups_stopped": late,
            "total_wall_s": time.time() - t0}


def _ft_wind_down(procs: dict[int, subprocess.Popen]) -> dict[int, int | None]:
    """Step N is committed: the groups finish it and exit. A group restarted so late that it is still
    starting is SIGKILLed (it would have nothing to join); its exit code is then not a failure."""
    deadline = time.time() + 60
    while any(p.poll() is None for p in procs.values()) and time.time() < deadline:
        time.sleep(0.1)
    codes = {}
    for g, p in procs.items():
        if p.poll() is None:
            signal_started(p.pid, {p.pid})
            p.wait()
            codes[g] = None  # "late": recorded as such in the figures
        else:
            codes[g] = p.returncode
    return codes


def _ft_done_step(logdir: Path) -> int:
    steps = [r["step"] for g in range(GROUPS) for r in read_jsonl(logdir / f"ft_g{g}.jsonl")
             if r.get("committed")]
    return max(steps, default=0)


def _ft_figures(logdir: Path, steps: int) -> dict:
    """Per committed step: the first commit's time, the participants, the global-mean loss."""
    records = [r for g in range(GROUPS) for r in read_jsonl(logdir / f"ft_g{g}.jsonl") if "step" in r]
    committed = [r for r in records if r["committed"]]
    end = min(r["time"] for r in committed if r["step"] == steps)
    by_step: dict[int, list[dict]] = {}
    for r in (r for r in committed if r["time"] <= end):  # not a late group training alone after the end
        by_step.setdefault(r["step"], []).append(r)
    missing = [s for s in range(1, steps + 1) if s not in by_step]
    if missing:
        raise RuntimeError(f"torchft never committed steps {missing}")
    participants = {s: max(r["participants"] for r in rs) for s, rs in by_step.items()}
    losses = {}
    for s, rs in by_step.items():  # the mean over the samples trained: shares x groups / participants
        shares = [r["loss_share"] for r in rs if r["participating"]]
        losses[s] = sum(shares) * GROUPS / len(shares)
    done_at = {s: min(r["time"] for r in rs) for s, rs in by_step.items()}
    dropped = sorted({r["step"] for r in records if not r["committed"]})
    return {
        "steps_wall_s": done_at[steps] - done_at[1],
        "samples_lost": sum((GROUPS - p) * SAMPLES_PER_GROUP for p in participants.values()),
        "steps_short_of_groups": sum(p < GROUPS for p in participants.values()),
        "steps_dropped": len(dropped),
        "final_loss": statistics.mean(losses[s] for s in range(steps - LAST_STEPS + 1, steps + 1)),
        "losses": [losses[s] for s in range(1, steps + 1)],
    }


# -- elastimesh ------------------------------------------------------------------------------------
def _rank_actor_pids(cli: subprocess.Popen) -> list[int]:
    """The RankActor worker processes under the CLI process this bench started (its local Ray)."""
    import psutil

    found = []
    for proc in psutil.Process(cli.pid).children(recursive=True):
        try:
            if "RankActor" in " ".join(proc.cmdline()):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return sorted(found)


def run_elastimesh(zero: int, steps: int, every: int, workdir: Path) -> dict:
    """``_run_elastimesh_once``, again (up to twice more) when the run never got past Ray's start: on a
    2-core machine loaded by others, Ray's raylet can miss its fixed 30 s registration wait
    (``ray/_private/node.py``: "The current node timed out during startup"), which is not what is measured."""
    for attempt in range(3):
        try:
            return {**_run_elastimesh_once(zero, steps, every, workdir / f"try{attempt}"), "ray_start_retries": attempt}
        except RayStartTimeout:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class RayStartTimeout(RuntimeError):
    pass


def _run_elastimesh_once(zero: int, steps: int, every: int, workdir: Path) -> dict:
    """The CLI at dp=4; a RankActor SIGKILLed every ``every`` steps, grown back by the driver."""
    rundir = workdir / f"em_zero{zero}"
    rundir.mkdir(parents=True)
    metrics = rundir / "metrics.jsonl"
    sets = MODEL + ["mesh.dp=4", "mesh.pp=1", "mesh.tp=1", f"mesh.zero={zero}", f"train.steps={steps}",
                    f"metrics.path={metrics}", f"checkpoint.dir={rundir / 'ckpt'}", "checkpoint.memory_every=1",
                    "elastic.grow_check_s=1", "resources.cpus_per_worker=0.25",
                    "resources.placement_timeout_s=600", f"elastic.max_restarts={MAX_RESTARTS}"]
    cmd = [sys.executable, "-m", "orchestrator", "train", "--no-progress"]
    for override in sets:
        cmd += ["--set", override]
    t0 = time.time()
    cli = subprocess.Popen(cmd, cwd=rundir, env=child_env(), stdout=open(rundir / "stdout.txt", "w"),
                           stderr=subprocess.STDOUT)
    kills = []
    try:
        plan = fault_steps(steps, every)
        while cli.poll() is None:
            if time.time() - t0 > RUN_TIMEOUT_S:
                raise RuntimeError(f"elastimesh run past {RUN_TIMEOUT_S} s; logs in {rundir}")
            done = max((r["step"] for r in read_jsonl(metrics) if "loss" in r), default=0)
            pids = _rank_actor_pids(cli) if plan and done >= plan[0] else []
            if pids:
                victim = pids[len(kills) % len(pids)]
                signal_started(victim, set(pids))
                kills.append({"at_step_done": done, "pid": victim, "time": time.time()})
                plan.pop(0)
            time.sleep(0.05)
    finally:
        if cli.poll() is None:
            signal_started(cli.pid, {cli.pid})
            cli.wait()
    if cli.returncode:
        if not read_jsonl(metrics) and "timed out during startup" in (rundir / "stdout.txt").read_text():
            raise RayStartTimeout(f"Ray did not start; logs in {rundir}")
        raise RuntimeError(f"elastimesh exited {cli.returncode}; logs in {rundir}")
    return {**_em_figures(metrics, steps), "kills": kills, "total_wall_s": time.time() - t0}


def _em_figures(metrics: Path, steps: int) -> dict:
    records = read_jsonl(metrics)
    step_records = [r for r in records if "loss" in r]
    last = {r["step"]: r for r in step_records}  # the record that counted: a re-run step's last
    missing = [s for s in range(1, steps + 1) if s not in last]
    if missing:
        raise RuntimeError(f"elastimesh never logged steps {missing}")
    full_tokens = last[1]["tokens"]
    events = [r["event"] for r in records if "event" in r]
    return {
        "steps_wall_s": last[steps]["time"] - last[1]["time"],
        "samples_lost": sum(full_tokens - r["tokens"] for r in last.values()) // SEQ_LEN,
        "steps_rerun": len(step_records) - len(last),
        "failures": events.count("failure"), "grows": events.count("grow"),
        "final_dp": last[steps]["dp"],
        "final_loss": statistics.mean(last[s]["loss"] for s in range(steps - LAST_STEPS + 1, steps + 1)),
        "losses": [last[s]["loss"] for s in range(1, steps + 1)],
    }


# -- the comparison --------------------------------------------------------------------------------
def run_side(side: str, steps: int, every: int, workdir: Path) -> dict:
    load_before = load_average()
    if side == "torchft":
        figures = run_torchft(steps, every, workdir)
    else:
        figures = run_elastimesh(int(side[-1]), steps, every, workdir)
    return {**figures, "loadavg_before": load_before, "loadavg_after": load_average()}


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per side: retained, wall, samples lost, final-loss gap, each a median over the repeats with its spread."""
    out = {}
    for side, pairs in runs.items():
        retained = [p["clean"]["steps_wall_s"] / p["faults"]["steps_wall_s"] for p in pairs]
        gap = [abs(p["faults"]["final_loss"] - p["clean"]["final_loss"]) / p["clean"]["final_loss"] for p in pairs]
        out[side] = {
            "retained": spread(retained),
            "steps_wall_s_clean": spread([p["clean"]["steps_wall_s"] for p in pairs]),
            "steps_wall_s_faults": spread([p["faults"]["steps_wall_s"] for p in pairs]),
            "total_wall_s_faults": spread([p["faults"]["total_wall_s"] for p in pairs]),
            "samples_lost": spread([p["faults"]["samples_lost"] for p in pairs]),
            "final_loss_rel_diff": spread(gap),
            "faults_injected": spread([len(p["faults"]["kills"]) for p in pairs]),
        }
    return out


def goal(summary: dict) -> dict:
    """elastimesh's retained >= torchft's, at the median and in how many repeats, per ZeRO level."""
    if "torchft" not in summary:
        return {"met": None, "why": "torchft not run"}
    ft = summary["torchft"]["retained"]["median"]
    verdicts = {}
    for side in (s for s in summary if s != "torchft"):
        verdicts[side] = summary[side]["retained"]["median"] >= ft
    return {"met": all(verdicts.values()) if verdicts else None, "by_side": verdicts}


def repeats_meeting(runs: dict[str, list[dict]]) -> dict:
    """In how many repeats each elastimesh side's retained met torchft's of the same repeat."""
    if "torchft" not in runs:
        return {}
    ft = [p["clean"]["steps_wall_s"] / p["faults"]["steps_wall_s"] for p in runs["torchft"]]
    counts = {}
    for side in (s for s in runs if s != "torchft"):
        ours = [p["clean"]["steps_wall_s"] / p["faults"]["steps_wall_s"] for p in runs[side]]
        counts[side] = f"{sum(o >= t for o, t in zip(ours, ft))} of {len(ours)}"
    return counts


def build_result(runs: dict[str, list[dict]], quick: bool, steps: int, every: int, repeats: int,
                 sides: list[str]) -> dict:
    summary = summarize(runs)
    verdict = goal(summary)
    done = len(next(iter(runs.values())))
    return {
        "benchmark": "torchft_compare", "quick": quick,
        "goal": "elastimesh's throughput retained (fault-free steps wall / faulty) >= torchft's, median of "
                "interleaved repeats",
        "math": "torchft drops a dead group's contribution to a step (its gradient is the mean over the groups "
                "left: samples_lost); elastimesh re-runs the step on the full global batch (exact: 0 samples "
                "lost, the fault-free math)",
        "config": {"overrides": MODEL, "groups_or_dp": GROUPS, "steps": steps, "every": every,
                   "fault_steps": fault_steps(steps, every), "repeats": repeats, "repeats_done": done,
                   "sides": sides,
                   "torchft_lighthouse": {"min_replicas": 1, "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS},
                   "elastimesh_sets": ["checkpoint.memory_every=1", "elastic.grow_check_s=1",
                                       "resources.cpus_per_worker=0.25", f"elastic.max_restarts={MAX_RESTARTS}"]},
        "summary": summary,
        # A run cut short claims no goal; nor does a full one of fewer than 3 repeats (except the smoke run).
        "goal_met": verdict["met"] if done == repeats and (repeats >= 3 or quick) else False,
        "goal_by_side": verdict.get("by_side"),
        "repeats_meeting_goal": repeats_meeting(runs),
        "runs": runs,
        "machine": machine(loadavg_at_end=load_average()),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, "torchft_compare", "12 steps, a fault every 5, one repeat: a smoke run")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 40)")
    ap.add_argument("--every", type=int, default=None, help="a fault every K steps (default 10)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3)")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {','.join(SIDES)}")
    ap.add_argument("--keep", type=Path, default=None, help="keep every run's logs under this directory")
    args = ap.parse_args(argv)
    steps = args.steps or (12 if args.quick else 40)
    every = args.every or (5 if args.quick else 10)
    repeats = args.repeats or (1 if args.quick else 3)
    sides = [s for s in args.sides.split(",") if s]
    if unknown := [s for s in sides if s not in SIDES]:
        ap.error(f"--sides: unknown {unknown}; choose from {','.join(SIDES)}")
    if steps < 2 * every or steps < LAST_STEPS + 1:
        ap.error("--steps must be at least 2 x --every (and > 5): no fault in the last K steps")
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    with tempfile.TemporaryDirectory(prefix="em_torchft_") as scratch:
        tmp = args.keep or scratch
        for r in range(repeats):
            order = sides if r % 2 == 0 else sides[::-1]  # A B C, C B A, ...
            pair = {s: {} for s in sides}
            for kind, k in (("clean", 0), ("faults", every)):
                for side in order:
                    pair[side][kind] = run_side(side, steps, k, Path(tmp) / f"r{r}_{side}_{kind}")
                    print(f"repeat {r + 1} {side} {kind}: {pair[side][kind]['steps_wall_s']:.1f} s for steps "
                          f"1..{steps}, load {pair[side][kind]['loadavg_after']}", flush=True)
            for side in sides:
                runs[side].append(pair[side])
            # Rewritten after every repeat: a run cut short keeps what it measured (repeats_done).
            result = build_result(runs, args.quick, steps, every, repeats, sides)
            write_result(args.out, result)
    summary, verdict = result["summary"], {"met": result["goal_met"]}
    line = ", ".join(f"{s} retained {v['retained']['median']:.3f} [{v['retained']['min']:.3f}, "
                     f"{v['retained']['max']:.3f}] lost {v['samples_lost']['median']:.0f} samples"
                     for s, v in summary.items())
    print(f"torchft_compare ({steps} steps, fault every {every}, {repeats} repeats): {line} -> goal "
          f"{'met' if verdict['met'] else 'NOT met' if verdict['met'] is False else 'n/a'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
