"""Scale: the driver off the step's critical path and snapshots off the driver, at hundreds of ranks.

    python bench/scale.py [--sizes 16,64,128,256] [--step-s 1.0] [--steps 14] [--snapshot-mb 0.25]
                          [--sim 1024,4096] [--quick] [--out bench/results/scale.json]

Part 0, capacity: the memory of one minimal Ray actor on this machine (USS/PSS/RSS of 8 of them), and
how many the memory available now holds.

Part 1, real Ray with fake ranks (``testbed/fake_rank_actor.py``: the real calls and messages, no torch; a
step sleeps ``--step-s``, each rank snapshots ``--snapshot-mb`` every step and pushes it to its
holder) on a local multi-node Ray (``ray.cluster_utils.Cluster``: a CPU-less head for the driver,
four worker nodes of logical CPUs), the real ``Controller`` and ``WorkerGroup``. For each N: the
first generation forms at dp = N/2 with N + 1 actors (one hot spare) and grows to dp = N at the first
grow check; the steady steps give the driver overhead per step (the interval between two step
records minus the ranks' step time), the driver's CPU per step (this process, Ray's threads in it
included) and the bytes through the driver's node per step (objects created in the head node's
object store, plus the step results the driver reads); then one rank is SIGKILLed and the time to the
next step recorded is measured, with the formation (and restore) times of each generation.

Part 2, simulated: the real ``Controller`` on ``testbed/sim_group.py``'s in-process group at --sim
ranks, with part one's latencies: the driver CPU per step and per recovery (one rank killed, its
spare promoted, restored from snapshots), split into the controller's and the group's share.
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from common import load_average, machine, parser, write_result

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
NODES = 4
MINIMAL_ACTOR_SAMPLE = 8
START_BATCH = 32  # actors started at a time (memory is checked between batches)
ACTOR_MIB = 64  # a fake rank actor's private memory, about (part 0 measures it)
MEMORY_MARGIN_MIB = 4096  # left free for everything else on the machine (raylets, the driver, other users)


def overrides(n: int, steps: int, tmp: Path) -> list[str]:
    return [f"mesh.dp={max(1, n // 2)}", "mesh.pp=1", "mesh.tp=1", f"elastic.max_dp={n}",
            f"train.global_batch_size={n}", "train.micro_batch_size=1", f"train.steps={steps}",
            f"checkpoint.dir={tmp / 'ckpt'}", "checkpoint.every=100000", "checkpoint.memory_every=1",
            "elastic.spares=1", "elastic.min_dp=1", "elastic.max_restarts=10", "elastic.step_timeout_s=300",
            "elastic.rebuild_timeout_s=600", "elastic.grow_check_s=0.5", "elastic.drain_poll_s=0",
            f"metrics.path={tmp / 'metrics.jsonl'}"]


def capacity() -> dict:
    """Memory of a minimal actor (Ray worker + our fake rank's imports) and how many fit now."""
    import psutil
    import ray

    ray.init(num_cpus=MINIMAL_ACTOR_SAMPLE, include_dashboard=False, log_to_driver=False)
    try:
        from testbed.fake_rank_actor import FakeRankActor

        from orchestrator.cluster.worker_group import ActorResources, WorkerGroup

        group = WorkerGroup(ActorResources(cpus=1, gpus=0), placement_timeout_s=300, actor_class=FakeRankActor)
        group.add(MINIMAL_ACTOR_SAMPLE)
        time.sleep(2)
        info = [psutil.Process(pid).memory_full_info() for pid in group.pids.values()]
        group.shutdown()
    finally:
        ray.shutdown()
    mib = 2**20
    pss = statistics.mean(i.pss for i in info) / mib
    available = psutil.virtual_memory().available / mib
    return {"actor_rss_mib": round(statistics.mean(i.rss for i in info) / mib, 1),
            "actor_uss_mib": round(statistics.mean(i.uss for i in info) / mib, 1), "actor_pss_mib": round(pss, 1),
            "memory_total_mib": round(psutil.virtual_memory().total / mib), "memory_available_mib": round(available),
            "actors_that_fit_now": int(max(0, available - MEMORY_MARGIN_MIB) // statistics.mean(i.uss / mib for i in info))}


def _available_mib() -> int:
    import psutil

    return round(psutil.virtual_memory().available / 2**20)


def head_created_bytes(ray) -> int:
    """Bytes ever created in the head node's object store (the driver's node)."""
    from ray._private.internal_api import node_stats

    head = next(n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) == 0)
    return int(node_stats(head["NodeManagerAddress"], head["NodeManagerPort"], include_memory_info=False)
               .store_stats.cumulative_created_bytes)


def real(n: int, args) -> dict:
    import ray
    from testbed.fake_rank_actor import FakeRankActor

    from orchestrator.cluster.worker_group import ActorResources, WorkerGroup
    from orchestrator.config.load import load_config
    from orchestrator.control.controller import Controller
    from orchestrator.metrics import MetricsLog
    from testbed.driver_steps import last_restore

    tmp = Path(tempfile.mkdtemp(prefix=f"scale{n}-"))
    cluster = _start_cluster(n, args.snapshot_mb)
    group = None
    out: dict = {"ranks": n}
    try:
        group = WorkerGroup(ActorResources(cpus=1, gpus=0), placement_timeout_s=900, actor_class=FakeRankActor,
                            actor_kwargs={"step_s": args.step_s, "snapshot_bytes": int(args.snapshot_mb * 2**20)})
        t0 = time.perf_counter()
        if not _start_actors(group, n + 1, out):
            return out
        out["actors_start_s"] = round(time.perf_counter() - t0, 2)
        cfg = load_config(None, overrides(n, args.steps, tmp))
        metrics = MetricsLog(cfg.metrics, progress_total=None, ray_metrics=False)
        controller = Controller(cfg, group, metrics=metrics, store_address=("127.0.0.1", 1), use_gpu=False,
                                data_path="builtin")
        kill_after = args.steps - 4
        records, transitions, killed, created, before_kill = _run_killing_a_member(controller, group, metrics,
                                                                                   kill_after)
        out.update(_figures(records, transitions, killed, created, kill_after))
        out.update(_rank_idle(ray, group, before_kill, records, kill_after))
        out["restore"] = last_restore(controller)
        out["result_bytes_per_rank"] = _result_bytes()
        metrics.close()
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return out


def _start_cluster(n: int, snapshot_mb: float):
    """A local multi-node Ray (a head without CPUs, NODES nodes sharing n + 1 actors), connected."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 200 * 2**20, "_system_config": {"enable_metrics_collection": False}})
    per_node = -(-(n + 1) // NODES) + 1
    for _ in range(NODES):
        cluster.add_node(num_cpus=per_node, object_store_memory=max(200, 4 * per_node * snapshot_mb) * 2**20)
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def _start_actors(group, count: int, out: dict) -> bool:
    """Start ``count`` actors in batches; False (the reason in ``out["skipped"]``) when the shared
    machine would run short of memory first."""
    started = 0
    while started < count:  # in batches, stopping before the shared machine runs short of memory
        batch = min(START_BATCH, count - started)  # the check asks room for this batch only
        if _available_mib() < MEMORY_MARGIN_MIB + batch * ACTOR_MIB:
            out.update(skipped=f"memory: {_available_mib()} MiB available after {started} actors "
                               f"(a margin of {MEMORY_MARGIN_MIB} MiB is kept for the machine's other users)")
            return False
        group.add(batch)
        started += batch
    return True


def _run_killing_a_member(controller, group, metrics, kill_after: int) -> tuple:
    """Run the controller to its end, one transition at a time, SIGKILLing world rank 1's actor once
    step ``kill_after`` was read: (step records, transitions, the kill, head bytes per step, each rank's
    idle before each step as read before the kill)."""
    import ray

    from testbed.driver_steps import members, run_to_end

    records: list[tuple[int, float, float, float, int]] = []  # step, wall, cpu, step_time_s, generation
    metrics.step_listeners.append(lambda r: records.append(
        (r["step"], time.perf_counter(), time.process_time(), r["step_time_s"], r["generation"])))
    killed: list[float] = []
    created: list[tuple[int, int]] = []

    before_kill: dict[int, dict[int, float]] = {}  # actor -> step -> idle seconds, of the last generation

    def maybe_kill(record) -> None:  # after step kill_after was read: SIGKILL a member
        if record["step"] == kill_after and not killed:
            ranks = members(controller)
            # What each rank waited for the driver before each step, read before the kill.
            actors = list(ranks.values())
            before_kill.update(zip(actors, ray.get([group.handle(a).idle_before.remote() for a in actors])))
            victim = ranks[1]
            pid = group.pids[victim]
            if pid > 1:
                killed.append((time.perf_counter(), record["generation"]))
                os.kill(pid, signal.SIGKILL)

    metrics.step_listeners.append(lambda r: created.append((r["step"], head_created_bytes(ray))))
    metrics.step_listeners.append(maybe_kill)
    transitions = [(str(t.before), str(t.after), t.wall_s) for t in run_to_end(controller)]
    return records, transitions, killed, created, before_kill


def _figures(records, transitions, killed, created, kill_after) -> dict:
    final_gen = max(r[4] for r in records if r[0] <= kill_after)
    steady = [r for r in records if r[4] == final_gen and r[0] <= kill_after]
    steady = steady[2:]  # the new generation's first steps carry its start
    gaps = [(b[1] - a[1]) - b[3] for a, b in zip(steady, steady[1:])]
    cpu = [b[2] - a[2] for a, b in zip(steady, steady[1:])]
    steps_seen = {s for s, _ in created}
    by_step = dict(created)
    head = [by_step[b[0]] - by_step[a[0]] for a, b in zip(steady, steady[1:]) if a[0] in steps_seen and b[0] in steps_seen]
    # The next step the new generation completed (a step in flight may still complete in the old one).
    after_kill = [r[1] for r in records if killed and r[1] > killed[0][0] and r[4] > killed[0][1]]
    forming = [t for t in transitions if t[1] == "running" and t[0] in ("forming", "rebuilding")]
    return {
        "steady_steps": len(steady),
        "driver_overhead_per_step_s": round(statistics.mean(gaps), 4) if gaps else None,
        "driver_overhead_per_step_max_s": round(max(gaps), 4) if gaps else None,
        "driver_cpu_per_step_s": round(statistics.mean(cpu), 4) if cpu else None,
        "head_node_object_store_bytes_per_step": statistics.mean(head) if head else None,
        "kill_to_next_step_s": round(after_kill[0] - killed[0][0], 3) if after_kill else None,
        "formation_s": [{"from": f, "s": round(s, 3)} for f, _, s in forming],
        "grow_s": next((round(s, 3) for f, t, s in transitions if f == "forming" and t == "running"
                        and transitions.index((f, t, s)) > 0), None),
    }


def _rank_idle(ray, group, idle: dict, records, kill_after: int) -> dict:
    """The driver on the step's critical path, seen from the ranks. The fake ranks do not wait for
    each other as real ones do in their collectives, so a fast one runs ahead and then waits for the
    slowest: for each steady step, the wait of the rank that finished the step before *last* (the one
    a real, synchronised step waits for) for that step's call."""
    final_gen = max(r[4] for r in records if r[0] <= kill_after)
    steady = sorted(r[0] for r in records if r[4] == final_gen and r[0] <= kill_after)[2:]
    waits = []
    for step in steady:
        seen = [per[step] for per in idle.values() if step in per]
        if seen:
            waits.append(max(seen, key=lambda w: w[1])[0])  # the last to end the step before
    return {"rank_wait_for_driver_per_step_s": round(statistics.mean(waits), 4) if waits else None,
            "rank_wait_for_driver_per_step_max_s": round(max(waits), 4) if waits else None,
            "rank_wait_for_driver_median_s": round(statistics.median(waits), 4) if waits else None}


def _result_bytes() -> int:
    """The pickled size of one rank's step result as the fake ranks send it (16 action timings, one
    snapshot acknowledgement): what the driver reads per rank per step."""
    import pickle

    from meshspeak.messages import ActionTiming, SnapshotAck, StepResult

    timings = tuple(ActionTiming(f"{i % 2}F{i // 2}", 0.1 * i, 0.1 * i + 0.1) for i in range(16))
    return len(pickle.dumps(StepResult(step=1, world_rank=0, ok=True, loss=1.0, step_time_s=1.0, compute_s=0.9,
                                       timings=timings, snapshots=(SnapshotAck((1, 0, 1), 0.0, 1 << 20),))))


class _SimTally:
    """The driver's thread CPU per transition, sorted into steady steps (RUNNING -> RUNNING from step 3
    on, before any failure) and the recovery (from the transition that reached REBUILDING to the one
    back in RUNNING), each with the simulated group's share."""

    def __init__(self, group) -> None:
        self.group = group
        self.group_cpu = group.cpu_s
        self.per_step: list[float] = []
        self.group_share: list[float] = []
        self.recovery: list[tuple[float, float]] = []
        self.in_recovery = self.failed = False
        self.recovery_cpu = self.recovery_group = 0.0

    def add(self, t) -> None:
        from orchestrator.control.controller import State

        grp, self.group_cpu = self.group.cpu_s - self.group_cpu, self.group.cpu_s
        if t.after == State.REBUILDING or self.in_recovery:
            self.failed = True
            self.in_recovery = t.after != State.RUNNING or t.before != State.RUNNING
            self.recovery_cpu, self.recovery_group = self.recovery_cpu + t.cpu_s, self.recovery_group + grp
            if not self.in_recovery:
                self.recovery.append((self.recovery_cpu, self.recovery_group))
            return
        if t.before == t.after == State.RUNNING and not self.failed and t.next_step - 1 >= 3:
            self.per_step.append(t.cpu_s)
            self.group_share.append(grp)


def simulated(n: int, latency: dict[str, float], steps: int) -> dict:
    """The real controller on ``n`` in-process ranks: CPU per step (steady) and per recovery."""
    from testbed.sim_group import SimGroup

    from orchestrator.config.load import load_config
    from orchestrator.control.controller import Controller
    from orchestrator.metrics import MetricsLog
    from testbed.driver_steps import run_to_end

    tmp = Path(tempfile.mkdtemp(prefix=f"sim{n}-"))
    cfg = load_config(None, overrides(2 * n, steps, tmp) + [f"mesh.dp={n}", f"elastic.max_dp={n}",
                                                              "elastic.grow_check_s=1e9"])
    group = SimGroup(n + 1, latency_s=latency)
    metrics = MetricsLog(cfg.metrics, progress_total=None, ray_metrics=False)
    controller = Controller(cfg, group, metrics=metrics, store_address=("127.0.0.1", 1), use_gpu=False,
                            data_path="builtin")
    kill_step = steps - 4
    group.kill_at(kill_step, 1)
    tally = _SimTally(group)
    try:
        run_to_end(controller, tally.add)
    finally:
        metrics.close()
    per_step, recovery, group_share = tally.per_step, tally.recovery, tally.group_share
    step_cpu = statistics.median(per_step)
    return {"ranks": n, "steps_measured": len(per_step),
            "driver_cpu_per_step_s": round(step_cpu, 5),
            "driver_cpu_per_step_per_rank_us": round(step_cpu / n * 1e6, 3),
            "of_which_sim_group_us_per_rank": round(statistics.median(group_share) / n * 1e6, 3),
            "driver_cpu_per_recovery_s": round(recovery[0][0], 4) if recovery else None,
            "recovery_of_which_sim_group_s": round(recovery[0][1], 4) if recovery else None}


def main() -> None:
    p = parser(__doc__, "scale", "16 and 64 real actors, 256 and 1024 simulated, fewer steps")
    p.add_argument("--sizes", default="16,64,128,256")
    p.add_argument("--sim", default="256,1024,4096")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--step-s", type=float, default=1.0)
    p.add_argument("--snapshot-mb", type=float, default=0.25)
    p.add_argument("--skip-real", action="store_true")
    args = p.parse_args()
    if args.quick:  # smaller sizes unless given
        quick = {"sizes": "16,64", "sim": "256,1024", "steps": 12}
        for name, value in quick.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    result: dict = {"benchmark": "scale", "quick": args.quick, "step_s": args.step_s, "snapshot_mb": args.snapshot_mb,
                    "steps": args.steps, "machine_before": machine(load_average=load_average())}
    result["capacity"] = capacity() if not args.skip_real else None
    print("capacity:", result["capacity"], flush=True)
    real_runs = []
    if not args.skip_real:
        for n in map(int, args.sizes.split(",")):
            # What each more actor adds is its private memory (USS): the shared libraries are mapped once.
            need, free = (n + 1) * result["capacity"]["actor_uss_mib"], _available_mib()
            # The machine is shared: never push it into the OOM killer. The start itself checks again
            # between batches, keeping MEMORY_MARGIN_MIB free (``real``).
            if need > free - MEMORY_MARGIN_MIB / 2:
                real_runs.append({"ranks": n, "skipped": "not enough memory available for the actors",
                                  "memory_needed_mib": round(need), "memory_available_mib": free,
                                  "margin_mib": MEMORY_MARGIN_MIB})
                print(real_runs[-1], flush=True)
                continue
            real_runs.append({**real(n, args), "load_average": load_average()})
            print(real_runs[-1], flush=True)
            write_result(args.out, {**result, "real": real_runs})
    result["real"] = real_runs
    measured = [r for r in real_runs if r.get("kill_to_next_step_s") is not None]
    latency = {"train_step": args.step_s, "join_generation": 0.05, "load_snapshot": 0.05,
               "snapshot_inventory": 0.01, "status": 0.01, "kick": 0.01}
    if measured:  # the formation latency part one saw at its largest size: the median, never the fastest
        forms = [f["s"] for f in measured[-1]["formation_s"]]
        latency["join_generation"] = round(statistics.median(forms), 3)
    result["simulated_latency_s"] = latency
    sims = []
    for n in map(int, args.sim.split(",")):
        sims.append({**simulated(n, {**latency, "train_step": 0.02}, max(16, args.steps)), "load_average": load_average()})
        print(sims[-1], flush=True)
    result["simulated"] = sims
    result["machine_after"] = machine(load_average=load_average())
    write_result(args.out, result)


if __name__ == "__main__":
    main()
