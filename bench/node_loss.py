"""After a node is gone, the run stays fast and the GCS idle (issue 29; goal: median step after the loss
<= 1.2x the median before, head gcs_server CPU over the 60 s after the loss <= 10% of a core).

The set-up the issue describes, on this machine: a two-node `ray start` cluster (``bench/ray_nodes.py``:
head 3 CPUs, worker 2 CPUs, token auth), ``elastimesh train`` started by hand on the head (RAY_ADDRESS),
dp=2 pp=2 tp=1, the built-in model and data, an unbounded ``train.steps``. Once ``--warmup`` steps trained
the worker node is lost, one of two ways (``--variant``, both by default):

* ``drain``: ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds 15``,
  then SIGTERM to the worker's ``ray start`` at the deadline (the run evacuates the node before it goes);
* ``kill``: SIGKILL to the worker's ``ray start``, no notice (the run takes the failure path).

Figures per variant (step records carry no time, so a thread tails the metrics file every 20 ms and
stamps each record as it appears):

The node is *gone* when the GCS declares it dead (the GCS probe, below, polls the node list from the
signal on; ``signal_to_dead_s``): only then does Ray re-place (or give up) the bundles it held.

* ``median_step_before_s``: median interval between consecutive step records over the ``--window`` s
  before the drain (or the kill); ``median_step_time_*_s``: the same windows' median ``step_time_s``
  (the slowest rank's own wall time for the step, without the driver's time between steps);
* ``median_step_after_s``: the same over the steps the re-formed mesh trained from 5 s after the node
  is gone to 60 s after it; ``step_ratio`` = after / before (goal <= 1.2);
* ``gcs_cpu_before`` / ``gcs_cpu_after``: the head's ``gcs_server`` CPU (user + system, psutil on its
  pid) over the ``--window`` s before the drain and the 60 s after the node is gone, in cores
  (goal after <= 0.1); ``gcs_cpu_signal_to_dead``: from the SIGTERM/SIGKILL to the node declared
  dead; ``head_cpu_after``: every process under the head's ``ray start`` by name, over the 60 s
  after (the DashboardAgent was the other hot one in the issue);
* ``placement_groups_after``: every placement group the cluster holds 60 s after the node is gone,
  with its state and bundle nodes.

    python bench/node_loss.py [--variant drain|kill|both] [--window S] [--warmup N] [--out PATH]

Writes ``bench/results/node_loss.json`` unless ``--out`` says otherwise.

The GCS probe is this script again, run as a subprocess with ``--gcs-probe`` and the cluster's
RAY_ADDRESS and token: it connects once (seconds on a loaded box, so not per question), then answers
one line ``PROBE <json>`` on stdout per command line on stdin (Ray prints its own cluster messages,
e.g. a node marked dead, on the same stdout):

* ``dead NODE_ID``: polls the GCS's node list every 0.2 s until NODE_ID is no longer alive, then
  answers ``{"dead_at": time.time()}`` (``null`` after 300 s). Ray re-places (or not) a lost node's
  bundles only once the GCS declared it dead, which comes some seconds after a SIGTERM'd ``ray start``
  stops its processes or after its raylet was killed.
* ``groups``: every placement group the cluster holds (not removed): ``state`` and bundle ``nodes``.

Between questions it makes no calls, so it adds nothing to the GCS CPU being measured.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from common import load_average, machine, parser, write_result
from ray_nodes import REPO, RayStartCluster

GOAL_STEP_RATIO = 1.2
GOAL_GCS_CPU = 0.10
LOSS_WINDOW_S = 60.0
DEAD_POLL_S = 0.2  # the GCS probe's node-list poll
DEAD_TIMEOUT_S = 300.0
DRAIN_DEADLINE_S = 15
SETTLE_S = 5.0  # after the node is gone: the failure path's rebuild is done by then
# checkpoint.every: a save is measured before the drain, so the 15 s notice is long enough to evacuate
# (with no save measured the driver guesses 16 s and takes the failure path when the node goes).
OVERRIDES = ["mesh.dp=2", "mesh.pp=2", "mesh.tp=1", "train.steps=1000000", "train.warmup_steps=2",
             "elastic.grow_check_s=5", "checkpoint.every=50"]


class Tail(threading.Thread):
    """Reads the metrics file as it grows and stamps each step record with the time it appeared."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.stamped, self.stop = path, [], threading.Event()

    def run(self) -> None:
        offset, partial = 0, ""
        while not self.stop.wait(0.02):
            if not self.path.exists():
                continue
            with open(self.path) as f:
                f.seek(offset)
                chunk = f.read()
                offset = f.tell()
            now = time.time()
            *lines, partial = (partial + chunk).split("\n")
            for line in lines:
                rec = json.loads(line) if line.strip() else {}
                if "loss" in rec:
                    self.stamped.append({**rec, "time": now})


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def steps(path: Path) -> list[dict]:
    return [r for r in records(path) if "loss" in r]


def medians(stamped: list[dict], start: float, end: float) -> tuple[float | None, float | None, int]:
    """Over the step records stamped in [start, end]: the median interval between consecutive ones,
    the median ``step_time_s``, and how many intervals."""
    inside = [r for r in stamped if start <= r["time"] <= end]
    times = [r["time"] for r in inside]
    gaps = [b - a for a, b in zip(times, times[1:])]
    own = [r["step_time_s"] for r in inside]
    return (statistics.median(gaps) if gaps else None), (statistics.median(own) if own else None), len(gaps)


def cpu_seconds(procs: list[psutil.Process]) -> dict[int, tuple[str, float]]:
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = (p.name(), t.user + t.system)
        except psutil.NoSuchProcess:
            pass
    return out


def head_processes(cluster: RayStartCluster) -> list[psutil.Process]:
    head = psutil.Process(cluster.nodes[0].pid)
    return [head, *head.children(recursive=True)]


def cpu_by_name(before: dict, after: dict, seconds: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for pid, (name, t1) in after.items():
        if pid in before:
            out[name] = out.get(name, 0.0) + (t1 - before[pid][1]) / seconds
    return dict(sorted(((k, round(v, 3)) for k, v in out.items()), key=lambda kv: -kv[1])[:6])


class Probe:
    """The GCS probe (``--gcs-probe``, module docstring) as a subprocess: one connection to the cluster,
    questions on stdin."""

    def __init__(self, cluster: RayStartCluster, log: Path) -> None:
        self.log = log
        with open(log, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), "--gcs-probe"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                         env={**cluster.env, "RAY_ADDRESS": cluster.gcs_address})
        self._answer()  # connected

    def ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def _answer(self) -> dict:
        while True:  # Ray's own messages share the probe's stdout: skip them
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"gcs_probe exited: {self.log.read_text(errors='replace')[-2000:]}")
            if line.startswith("PROBE "):
                return json.loads(line.removeprefix("PROBE "))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def serve_gcs_probe() -> None:
    """The probe's side (``--gcs-probe``): connect once, then answer each command line on stdin."""
    import ray

    ray.init(log_to_driver=False)
    print("PROBE", json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "dead":
            answer = {"dead_at": _dead_at(args[0])}
        elif command == "groups":
            answer = {"groups": _placement_groups()}
        else:
            answer = {"error": f"unknown command {command!r}"}
        print("PROBE", json.dumps(answer), flush=True)


def _dead_at(node_id: str) -> float | None:
    import ray

    deadline = time.monotonic() + DEAD_TIMEOUT_S
    while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
        if time.monotonic() > deadline:
            return None
        time.sleep(DEAD_POLL_S)
    return time.time()


def _placement_groups() -> list[dict]:
    from ray.util.placement_group import placement_group_table

    return [{"state": t["state"], "nodes": sorted(set(t["bundles_to_node_id"].values()))}
            for t in placement_group_table().values() if t["state"] != "REMOVED"]


def wait_steps(metrics: Path, driver: subprocess.Popen, count: int, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while len(steps(metrics)) < count:
        if driver.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the driver stopped or stalled before step {count}")
        time.sleep(0.5)


def run_variant(variant: str, window_s: float, warmup: int, work: Path) -> dict:
    cluster = RayStartCluster(head_cpus=3)
    driver = probe = None
    try:
        worker = cluster.add_node(2)
        worker_node = cluster.node_id_of(worker)
        gcs = psutil.Process(cluster.gcs_pid())
        metrics, log = work / f"{variant}.jsonl", work / f"{variant}-driver.log"
        sets = OVERRIDES + [f"checkpoint.dir={work / (variant + '-ckpt')}", f"metrics.path={metrics}"]
        driver = cluster.driver([a for o in sets for a in ("--set", o)], log)
        tail = Tail(metrics)
        tail.start()
        probe = Probe(cluster, work / f"{variant}-probe.log")
        wait_steps(metrics, driver, warmup)
        marks = _measure_node_loss(cluster, gcs, probe, worker, worker_node, variant, window_s)
        pgs = probe.ask("groups")["groups"]
        recs = records(metrics)
        tail.stop.set()
        return _variant_figures(variant, marks, tail.stamped, recs, gcs.pid, pgs)
    finally:
        _stop_run(driver, probe, cluster)


def _measure_node_loss(cluster, gcs, probe, worker, worker_node: str, variant: str, window_s: float) -> dict:
    """A window of steps with the node, its loss (drained then stopped, or killed), the GCS declaring
    it dead, and LOSS_WINDOW_S after: each moment's wall time and the GCS's (and the head's) CPU seconds."""
    t0, gcs0 = time.time(), cpu_seconds([gcs])
    time.sleep(window_s)
    t_notice, gcs1 = time.time(), cpu_seconds([gcs])
    _lose_node(cluster, worker, worker_node, variant, t_notice)
    t_signal, gcs_signal = time.time(), cpu_seconds([gcs])
    t_gone = probe.ask(f"dead {worker_node}")["dead_at"]
    if t_gone is None:
        raise RuntimeError("the GCS did not declare the worker node dead within 300 s")
    head0 = cpu_seconds(head_processes(cluster))
    gcs2 = cpu_seconds([gcs])
    time.sleep(max(0.0, t_gone + LOSS_WINDOW_S - time.time()))
    gcs3, head1 = cpu_seconds([gcs]), cpu_seconds(head_processes(cluster))
    t_end = time.time()
    return {"t0": t0, "gcs0": gcs0, "t_notice": t_notice, "gcs1": gcs1, "t_signal": t_signal,
            "gcs_signal": gcs_signal, "t_gone": t_gone, "head0": head0, "gcs2": gcs2, "gcs3": gcs3,
            "head1": head1, "t_end": t_end}


def _lose_node(cluster, worker, worker_node: str, variant: str, t_notice: float) -> None:
    """``drain``: a preemption notice, then SIGTERM at its deadline; otherwise SIGKILL at once."""
    if variant == "drain":
        drained = cluster.ray("drain-node", f"--address={cluster.gcs_address}", f"--node-id={worker_node}",
                              "--reason=DRAIN_NODE_REASON_PREEMPTION", "--reason-message=bench preemption",
                              f"--deadline-remaining-seconds={DRAIN_DEADLINE_S}")
        if drained.returncode != 0:
            raise RuntimeError(f"ray drain-node failed: {drained.stderr[-2000:]}")
        time.sleep(max(0.0, t_notice + DRAIN_DEADLINE_S - time.time()))
        worker.send_signal(signal.SIGTERM)
    else:
        worker.send_signal(signal.SIGKILL)


def _variant_figures(variant: str, marks: dict, stamped: list[dict], recs: list[dict], gcs_pid: int,
                     pgs) -> dict:
    """Steps before the notice and after the loss (on the mesh without the node), the GCS's CPU share
    in each phase, what the run logged."""
    t0, t_notice, t_signal, t_gone, t_end = (marks[k] for k in ("t0", "t_notice", "t_signal", "t_gone", "t_end"))
    before, own_before, n_before = medians(stamped, t0, t_notice)
    gen_before = max(r["generation"] for r in stamped if r["time"] <= t_notice)
    later = [r for r in stamped if r["generation"] > gen_before]  # the mesh without the node
    after, own_after, n_after = medians(later, t_gone + SETTLE_S, t_end)
    cpu = lambda a, b, s: round((b[gcs_pid][1] - a[gcs_pid][1]) / s, 4)  # noqa: E731
    events = [{k: v for k, v in r.items() if k in ("event", "step", "dp", "action", "reason", "recovery_s")}
              for r in recs if r.get("event") in ("preemption", "failure", "rebuild")]
    return {
        "variant": variant,
        "signal_to_dead_s": round(t_gone - t_signal, 2),
        "median_step_before_s": before and round(before, 4), "steps_before": n_before,
        "median_step_after_s": after and round(after, 4), "steps_after": n_after,
        "step_ratio": round(after / before, 3) if before and after else None,
        "median_step_time_before_s": own_before and round(own_before, 4),
        "median_step_time_after_s": own_after and round(own_after, 4),
        "gcs_cpu_before": cpu(marks["gcs0"], marks["gcs1"], t_notice - t0),
        "gcs_cpu_signal_to_dead": cpu(marks["gcs_signal"], marks["gcs2"], max(1e-3, t_gone - t_signal)),
        "gcs_cpu_after": cpu(marks["gcs2"], marks["gcs3"], t_end - t_gone),
        "head_cpu_after": cpu_by_name(marks["head0"], marks["head1"], t_end - t_gone),
        "placement_groups_after": pgs,
        "events": events,
        "load_average_end": load_average(),
    }


def _stop_run(driver, probe, cluster) -> None:
    if driver is not None and driver.poll() is None:
        driver.send_signal(signal.SIGTERM)  # saves at the next step boundary and exits 0
        try:
            driver.wait(timeout=120)
        except subprocess.TimeoutExpired:
            driver.kill()
    if probe is not None:
        probe.close()
    cluster.shutdown()


def main() -> None:
    p = parser(__doc__, "node_loss", "a 20 s window and 10 warm-up steps")
    p.add_argument("--variant", choices=("drain", "kill", "both"), default="both")
    p.add_argument("--window", type=float, default=30.0, help="seconds of steps measured before and after")
    p.add_argument("--warmup", type=int, default=20, help="steps trained before measuring")
    p.add_argument("--work", type=Path, default=None, help="where metrics and logs go (default: a temp dir)")
    args = p.parse_args()
    if args.quick:
        args.window, args.warmup = 20.0, 10
    import tempfile

    work = args.work or Path(tempfile.mkdtemp(prefix="em-nl-"))
    work.mkdir(parents=True, exist_ok=True)
    variants = ["drain", "kill"] if args.variant == "both" else [args.variant]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    results = {"config": {"overrides": OVERRIDES, "window_s": args.window, "warmup_steps": args.warmup,
                          "nodes": "ray start: head 3 CPUs + worker 2 CPUs", "drain_deadline_s": DRAIN_DEADLINE_S,
                          "loss_window_s": LOSS_WINDOW_S, "work": str(work), "code_commit": commit},
               "machine": machine(load_average_start=load_average()),
               "goal": {"step_ratio_max": GOAL_STEP_RATIO, "gcs_cpu_after_max": GOAL_GCS_CPU},
               "variants": []}
    for variant in variants:  # written after each, so a later failure keeps what was measured
        v = run_variant(variant, args.window, args.warmup, work)
        results["variants"].append(v)
        results["goal_met"] = len(results["variants"]) == len(variants) and all(
            x["step_ratio"] is not None and x["step_ratio"] <= GOAL_STEP_RATIO
            and x["gcs_cpu_after"] <= GOAL_GCS_CPU for x in results["variants"])
        write_result(args.out, results)
        print(f"{v['variant']}: node dead {v['signal_to_dead_s']} s after the signal; median step "
              f"{v['median_step_before_s']} -> {v['median_step_after_s']} s (x{v['step_ratio']}), gcs_server "
              f"{v['gcs_cpu_before']} -> {v['gcs_cpu_after']} cores; groups after: {v['placement_groups_after']}",
              flush=True)
    print(f"goal met: {results['goal_met']} -> {args.out}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--gcs-probe"]:
        serve_gcs_probe()
    else:
        main()
