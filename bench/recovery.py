"""Recovery after one worker is killed: elastimesh vs Ray Train 2.60 elastic ``TorchTrainer`` (goal <= 0.25x
restoring from storage, <= 0.05x from in-memory snapshots).

Same model, data and math on both sides (``meshmodels.gpt_model.build_stage``, ``meshdata.order.replica_microbatches``,
AdamW + clip + ``lr_at``), dp=4 workers, one torch thread each, checkpoints every 2 steps, and one worker
killed at step 5:

* **elastimesh**, twice: restoring from in-memory snapshots (``checkpoint.memory_every=1``, the default
  with a checkpoint directory: the rebuild loads the peers' copies of step 4) and from storage only
  (``checkpoint.memory_every=0``: the newest committed checkpoint). Each run: embedded local Ray (``num_cpus=8``), a ``StoreHost``, 4 ``RankActor``s
  (``testbed.ray_cluster.make_group``) and the real ``Controller`` (``testbed.ray_harness.make_controller``),
  ``mesh.dp=4, tp=1, checkpoint.every=2``. The victim (rank 1) is armed with ``arm_fault(5, "kill", 0.2)``,
  i.e. it SIGKILLs itself 0.2 s into step 5. The driver polls the victim's pid every 5 ms to timestamp the
  death. Figures: ``recovery_s`` of the ``rebuild`` event (failure detected -> first step done in the new
  generation) and the wall-clock "kill -> next step done" = time of the ``rebuild`` event (written right
  after the new generation's first step record) minus the observed death time.
* **elastimesh with a hot spare** (``spare``): as the snapshot run, with a fifth actor and
  ``elastic.spares=1``: the spare is promoted into the victim's mesh slot, so the mesh stays dp=4 and
  every new rank's shard has the layout of an old one (the restore's ``restore_s`` and the event's
  ``phases_s``: where the recovery's time went).
* **Ray Train**: ``TorchTrainer`` with elastic ``ScalingConfig(num_workers=(2, 4))`` and
  ``RunConfig(failure_config=FailureConfig(max_failures=2))``; DDP via ``prepare_model``. Rank 0 reports a
  checkpoint (model + optimizer + step) every 2 steps; the loop resumes from ``ray.train.get_checkpoint()``.
  At step 5, after 0.2 s, rank 1 of the first attempt writes ``time.time()`` and calls ``os._exit(1)``.
  Every worker appends (attempt, rank, step, time) per completed step. Figure: first step completed by the
  restarted group minus the exit time.

Work lost on both sides = (failure step - 1) - step the run resumed from (steps that had completed and
were re-run). The ratio is elastimesh kill->next-step / Ray Train kill->next-step (goal <= 0.25 from
storage, <= 0.05 from snapshots). The snapshot run also reports the snapshots' per-step stall (the
slowest rank's copy to host, from the ``snapshot`` events).

Repeats (``--repeats``, default 3) run the sides interleaved, the order reversed every other repeat
(A B C / C B A); every figure is the median of the repeats with its spread [min, max], and a ratio is
the median of per-repeat ratios (each elastimesh run over the Ray Train run of the same repeat).

    python bench/recovery.py [--steps N] [--repeats R] [--sides snapshots,spare,storage,ray_train] [--quick] [--out PATH]

Writes ``bench/results/recovery.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time

# bench/ is on sys.path; importing common puts the repository root there too.
from common import ROOT, load_average, local_ray, machine, parser, retry_ray_start, write_result
from stats import paired_ratios, repeats_meeting, spread

os.environ.setdefault("RAY_DEDUP_LOGS", "0")

GOAL_RATIO = 0.25
GOAL_RATIO_SNAPSHOT = 0.05
DP, FAIL_STEP, VICTIM, DELAY_S, CKPT_EVERY = 4, 5, 1, 0.2, 2

MODEL = ["model.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2"]


def _pid_dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


# -- elastimesh ------------------------------------------------------------------------------------
def run_elastimesh(steps: int, workdir: str, memory_every: int, spares: int = 0) -> dict:
    """One elastimesh run with rank VICTIM killed at FAIL_STEP: its figures (see the module docstring).
    ``spares``: hot spares beside the dp=4 mesh (``elastic.spares``)."""
    from orchestrator.config.load import load_config

    tag = f"{memory_every}_{spares}_{time.monotonic_ns()}"
    mpath = os.path.join(workdir, f"em{tag}.jsonl")
    cfg = load_config(None, MODEL + [
        f"mesh.dp={DP}", "mesh.tp=1", f"train.steps={steps}", f"checkpoint.every={CKPT_EVERY}",
        f"checkpoint.dir={os.path.join(workdir, f'em_ckpt{tag}')}", f"metrics.path={mpath}",
        f"checkpoint.memory_every={memory_every}", f"elastic.spares={spares}",
        "elastic.collective_timeout_s=60", "elastic.grow_check_s=1e6"])
    t0 = time.time()
    summary, death, t_loop, t_done = _train_killing_the_victim(cfg, spares)
    records = [json.loads(line) for line in open(mpath)]
    failure = next(r for r in records if r.get("event") == "failure")
    rebuild = next(r for r in records if r.get("event") == "rebuild")
    fail_idx = records.index(failure)
    rebuild_idx = records.index(rebuild)
    first_new = next(r for r in records[fail_idx:rebuild_idx] if "step" in r and "loss" in r)
    resumed = rebuild["resumed_from_step"]
    kill_t = death[0] if death else None
    stalls = [r["stall_s"] for r in records if r.get("event") == "snapshot"]
    # Steady: the first generation's steps after its first (its warm-up), before the fault.
    steady = sorted(r["step_time_s"] for r in records[:fail_idx] if "loss" in r and r.get("step", 0) > 1)
    return {
        "checkpoint_memory_every": memory_every, "spares": spares, "restored_from": rebuild.get("restored_from"),
        "restore_s": rebuild.get("restore_s"), "phases_s": rebuild.get("phases_s"),
        "snapshot_stall_s_max": max(stalls) if stalls else None,
        "snapshot_stall_s_median": sorted(stalls)[len(stalls) // 2] if stalls else None,
        "failure_step": failure["step"], "failed_ranks": failure["ranks"], "reason": failure.get("reason"),
        "resumed_from_step": resumed, "new_dp": rebuild["dp"], "first_step_after": first_new["step"],
        "first_step_after_time_s": first_new["step_time_s"],
        "steady_step_s_median": steady[len(steady) // 2] if steady else None,
        "recovery_s_event": rebuild["recovery_s"],
        "kill_to_detect_s": failure["time"] - kill_t if kill_t else None,
        "kill_to_next_step_done_s": rebuild["time"] - kill_t if kill_t else None,
        "work_lost_steps": (failure["step"] - 1) - resumed,
        "restarts": summary.restarts, "final_step": summary.final_step,
        "loop_wall_s": t_done - t_loop, "total_wall_s": t_done - t0,
        "kill_time_source": "driver polled /proc/<victim pid>/stat every 5 ms",
    }


def _train_killing_the_victim(cfg, spares: int = 0) -> tuple:
    """Train ``cfg`` on a local Ray with rank VICTIM's actor armed to die at FAIL_STEP, its death
    timed by polling its pid: (the run's summary, [the death's time] or [], the loop's start and end)."""
    import ray

    from meshspeak.rank_calls import RankCalls
    from testbed.ray_cluster import make_group
    from testbed.driver_steps import form_first_generation
    from testbed.ray_harness import make_controller
    from workers.store import StoreHost

    with local_ray():
        host = StoreHost.remote()
        store_address = ray.get(host.address.remote(), timeout=60)
        group = make_group(cfg.mesh.world + spares)
        try:
            controller = make_controller(cfg, group, store_address)
            victim = form_first_generation(controller)[VICTIM]
            death, stop = _watch_death(group.pids[victim])
            group.call([victim], RankCalls.arm_fault, (FAIL_STEP, "kill", DELAY_S), timeout_s=10)
            t_loop = time.time()
            summary = controller.run()
            t_done = time.time()
            stop.set()
            controller.metrics.close()
        finally:
            group.shutdown()
    return summary, death, t_loop, t_done


def _watch_death(pid: int) -> tuple[list[float], threading.Event]:
    """A thread that notes when ``pid`` dies (polled every 5 ms) until the event it returns is set."""
    death: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if _pid_dead(pid):
                death.append(time.time())
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return death, stop


# -- Ray Train -------------------------------------------------------------------------------------
def _train_loop(config: dict) -> None:
    import ray.train
    import torch

    sys.path.insert(0, config["root"])
    from bench.ddp_loop import DDPLoop

    loop = DDPLoop(config["overrides"])
    rank, world = loop.rank, loop.world
    logdir = config["logdir"]
    attempt = 2 if os.path.exists(os.path.join(logdir, "killed")) else 1
    start = 1
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=False)
        loop.inner.load_state_dict(state["model"])
        loop.optimizer.load_state_dict(state["optimizer"])
        start = state["step"] + 1
    with open(os.path.join(logdir, "starts.jsonl"), "a") as f:
        f.write(json.dumps({"attempt": attempt, "rank": rank, "world": world, "start": start,
                            "time": time.time()}) + "\n")

    def maybe_die(step: int, microbatch: int) -> None:
        if step == config["fail_step"] and rank == config["victim"] and attempt == 1 and microbatch == 0:
            time.sleep(config["delay_s"])
            with open(os.path.join(logdir, "killed"), "w") as f:
                f.write(repr(time.time()))
            os._exit(1)

    for step in range(start, config["steps"] + 1):
        loop.step(step, before_microbatch=lambda i: maybe_die(step, i))  # noqa: B023 - called right away
        with open(os.path.join(logdir, "steps.jsonl"), "a") as f:
            f.write(json.dumps({"attempt": attempt, "rank": rank, "world": world, "step": step,
                                "time": time.time()}) + "\n")
        if step % config["ckpt_every"] == 0:
            loop.report_checkpoint(step)


def run_ray_train(steps: int, workdir: str) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    logdir = os.path.join(workdir, "rt_logs")
    os.makedirs(logdir, exist_ok=True)
    t0 = time.time()
    error = None
    with local_ray():
        try:
            trainer = TorchTrainer(
                _train_loop,
                train_loop_config={"overrides": MODEL + [f"train.steps={steps}"], "steps": steps, "logdir": logdir,
                                   "root": str(ROOT), "fail_step": FAIL_STEP, "victim": VICTIM,
                                   "delay_s": DELAY_S, "ckpt_every": CKPT_EVERY},
                scaling_config=ScalingConfig(num_workers=(2, DP), use_gpu=False),
                run_config=RunConfig(name="rt_recovery", storage_path=os.path.join(workdir, "rt_storage"),
                                     failure_config=FailureConfig(max_failures=2)),
            )
            trainer.fit()
        except Exception as exc:  # recorded; the figures below may still be there
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    t_end = time.time()
    kill_t = float(open(os.path.join(logdir, "killed")).read())
    steps_log = [json.loads(line) for line in open(os.path.join(logdir, "steps.jsonl"))]
    starts = [json.loads(line) for line in open(os.path.join(logdir, "starts.jsonl"))]
    after = [r for r in steps_log if r["attempt"] == 2]
    first_step_after = min(r["step"] for r in after) if after else None
    # "next step done": every worker of the new group has finished its first step (slowest one).
    t_first = max(r["time"] for r in after if r["step"] == first_step_after) if after else None
    restart = [s for s in starts if s["attempt"] == 2]
    resumed = (restart[0]["start"] - 1) if restart else None
    done_before = max((r["step"] for r in steps_log if r["attempt"] == 1), default=0)
    return {
        "failure_step": FAIL_STEP, "resumed_from_step": resumed,
        "steps_completed_before_kill": done_before,
        "new_world": restart[0]["world"] if restart else None,
        "first_step_after": first_step_after,
        "kill_to_restart_loop_entry_s": (min(s["time"] for s in restart) - kill_t) if restart else None,
        "kill_to_next_step_done_s": (t_first - kill_t) if t_first else None,
        "work_lost_steps": (FAIL_STEP - 1) - resumed if resumed is not None else None,
        "final_step": max(r["step"] for r in steps_log), "fit_error": error,
        "total_wall_s": t_end - t0,
    }


SIDES = ("snapshots", "spare", "storage", "ray_train")


def run_side(side: str, steps: int, workdir: str) -> dict:
    """One run of ``side`` (see the module docstring), again when its local Ray did not start."""
    if side == "ray_train":
        return retry_ray_start(run_ray_train, steps, os.path.join(workdir, f"rt{time.monotonic_ns()}"))
    memory_every, spares = {"snapshots": (1, 0), "spare": (1, 1), "storage": (0, 0)}[side]
    return retry_ray_start(run_elastimesh, steps, workdir, memory_every, spares)


FIGURES = ("kill_to_next_step_done_s", "recovery_s_event", "restore_s", "first_step_after_time_s",
           "steady_step_s_median", "work_lost_steps")


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per side: each figure's median with its spread (``stats.spread``); per elastimesh side: its
    ratio to the Ray Train run of the same repeat, as the median of the per-repeat ratios."""
    out: dict = {}
    for side, side_runs in runs.items():
        keys = ("kill_to_next_step_done_s", "work_lost_steps") if side == "ray_train" else FIGURES
        out[side] = {k: spread([r.get(k) for r in side_runs]) for k in keys}
        if side != "ray_train" and runs.get("ray_train"):
            rt = runs["ray_train"][:len(side_runs)]
            ratios = paired_ratios([r.get("kill_to_next_step_done_s") for r in side_runs[:len(rt)]],
                                   [r.get("kill_to_next_step_done_s") for r in rt])
            out[side]["ratio_kill_to_next_step_vs_ray_train"] = spread(ratios)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, "recovery", "same as --steps 6 --repeats 1 (the fault is always at step 5)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default 8; >= 6)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats of every side (default 3)")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    args = ap.parse_args(argv)
    steps = args.steps or (6 if args.quick else 8)
    repeats = args.repeats or (1 if args.quick else 3)
    sides = [s for s in args.sides.split(",") if s]
    if steps <= FAIL_STEP:
        ap.error(f"--steps must exceed the fault step {FAIL_STEP}")
    if not sides or any(s not in SIDES for s in sides):
        ap.error(f"--sides: a comma-separated list of {', '.join(SIDES)}")
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    loads = []
    with tempfile.TemporaryDirectory(prefix="em_recovery_") as workdir:
        for repeat in range(repeats):
            for side in (sides if repeat % 2 == 0 else sides[::-1]):  # A B C / C B A
                loads.append(load_average())
                runs[side].append(run_side(side, steps, workdir))
                write_result(args.out, _result(runs, steps, repeats, loads))  # a cut-short bench keeps its runs
    result = _result(runs, steps, repeats, loads)
    write_result(args.out, result)
    _print(result)
    return 0


def _result(runs: dict[str, list[dict]], steps: int, repeats: int, loads: list) -> dict:
    summary = summarize(runs)
    snap = (summary.get("snapshots", {}).get("ratio_kill_to_next_step_vs_ray_train") or {}).get("per_repeat", [])
    storage = (summary.get("storage", {}).get("ratio_kill_to_next_step_vs_ray_train") or {}).get("per_repeat", [])
    snap_met, snap_goal = repeats_meeting(snap, lambda r: r <= GOAL_RATIO_SNAPSHOT)
    storage_met, storage_goal = repeats_meeting(storage, lambda r: r <= GOAL_RATIO)
    return {
        "benchmark": "recovery",
        "goal": f"elastimesh kill->next-step-done / Ray Train's <= {GOAL_RATIO} from storage, "
                f"<= {GOAL_RATIO_SNAPSHOT} from in-memory snapshots; also report steps re-run",
        "config": {"overrides": MODEL, "dp": DP, "steps": steps, "fail_step": FAIL_STEP, "victim_rank": VICTIM,
                   "kill_delay_s": DELAY_S, "checkpoint_every": CKPT_EVERY, "ray_train_workers": [2, DP],
                   "ray_train_max_failures": 2, "repeats": repeats, "sides": list(runs)},
        "summary": summary,
        "runs": runs,
        "goal_snapshots_met": snap_goal, "repeats_meeting_goal_snapshots": snap_met,
        "goal_met": storage_goal, "repeats_meeting_goal": storage_met,
        "goal_rule": "met only when every repeat's ratio meets it",
        "machine": machine(load_average_before_each_run=loads, loadavg_at_end=load_average()),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _print(result: dict) -> None:
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    for side, figures in result["summary"].items():
        parts = [f"{k} {fmt(f['median'])} [{fmt(f['min'])}, {fmt(f['max'])}]" for k, f in figures.items() if f]
        print(f"recovery {side} (n={len(result['runs'][side])}): " + "; ".join(parts))
    print(f"goal (snapshots <= {GOAL_RATIO_SNAPSHOT} of Ray Train): {result['goal_snapshots_met']}; "
          f"(storage <= {GOAL_RATIO}): {result['goal_met']}")


if __name__ == "__main__":
    sys.exit(main())
