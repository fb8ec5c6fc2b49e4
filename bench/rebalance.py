"""A slow replica rebalanced vs lockstep vs evicted: tokens/s at dp=4 with one replica slowed 2x
(issue 27 part 1; goal: rebalancing >= 0.9 of the capacity bound of 3 + 0.5 replicas' worth).

Each mode trains the same job for ``--steps`` steps through the real controller on real rank actors
(embedded local Ray, ``testbed.ray_cluster.make_group``, ``testbed.ray_harness.make_controller``):
dp=4, pp=tp=1, ZeRO-0 (DDP), global batch 48 = 24 microbatches of 2 sequences (6 per replica when
even, 8 at dp=3), checkpoints only for a re-formation (``checkpoint.dir`` set, ``every = 0``,
``memory_every = 0``: no per-step snapshot cost in any mode). The modes:

* ``healthy``: no slow replica; its tokens/s x 3.5 / 4 is the capacity bound;
* ``lockstep``: world rank 3 slowed 2x, nothing done about it (the even split every step);
* ``rebalance``: ``elastic.rebalance = true``;
* ``evict``: ``elastic.evict_stragglers = true`` (``straggler_factor`` 1.5, 5 steps), no spare: dp 4 -> 3;
* ``evict_spare``: the same with ``elastic.spares = 1`` (a fifth actor: more hardware than the others).

The slow replica is the ``sleep`` fault at ``where="microbatch"`` (workers/compute_clock.py): a sleep
inside the first block forward of *every* microbatch, so its step grows with its share, as on a
device that is slower per unit of work. Two scenarios:

* ``cpu``: the ranks compute on the CPU (d_model 128, 4 layers, seq_len 128); the slow rank sleeps
  ``h`` per microbatch, ``h`` = a healthy replica's compute per microbatch measured in the
  ``healthy`` mode (median over the last half of (1 - bubble) x step time / 6). On this 2-core
  machine the 4 ranks (and other users' work) share the cores: a sleeping rank frees its core for the
  others and a mesh of 3 ranks contends less than one of 4, which the capacity bound (measured with
  4 busy ranks) does not know.
* ``device``: every rank's microbatch also carries ``DEVICE_S`` of device time (the same fault on
  every actor, spares included; the slow one sleeps ``h + DEVICE_S``, so that its time per
  microbatch, CPU work included, is twice a healthy one's ``h``), over a small model (d_model 64, seq_len
  64) whose CPU work is a small part of it: replicas that behave like independent accelerators, the
  setting the issue describes, with the real training (math, collectives, controller) around them.

Figures per mode: tokens/s over the whole run (``steps`` x 48 x seq_len over the wall time of
``controller.run()``, a re-formation included) and in the steady state (the median step time of the
last half), each over its round's capacity bound; the rebalance events (split, measured speeds);
the eviction's step, recovery time and the dp after it; the load average before and after. With
``--repeats R`` (default 3) every mode runs in each of R rounds (healthy first), and the medians over
the rounds are the scenario's ``of_capacity_bound`` / ``of_capacity_bound_steady``, with their spread
(``*_spread``); ``goal_met`` holds only when rebalancing met the goal in every round
(``rounds_meeting_goal``; ``goal_met_median``: whether the median did).

    nice -n 10 python bench/rebalance.py [--steps N] [--repeats R] [--scenarios device,cpu] [--modes ...]
                                          [--quick] [--out PATH]

Writes ``bench/results/rebalance.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

# bench/ is on sys.path; importing common puts the repository root there too.
from common import load_average, local_ray, machine, parser, write_result
from stats import repeats_meeting, spread

os.environ.setdefault("RAY_DEDUP_LOGS", "0")

GOAL = 0.9
DP, SLOW_RANK, G, MBS = 4, 3, 48, 2
DEVICE_S = 0.04  # the device scenario's time per microbatch of a healthy replica
COMMON = [f"train.global_batch_size={G}", f"train.micro_batch_size={MBS}", "mesh.tp=1", "mesh.pp=1",
          "mesh.zero=0", f"mesh.dp={DP}", "elastic.grow_check_s=1e6", "elastic.collective_timeout_s=120",
          "checkpoint.every=0", "checkpoint.memory_every=0", "elastic.straggler_factor=1.5"]
SCENARIOS = {
    "device": ["model.d_model=64", "model.n_heads=4", "model.n_layers=2", "model.seq_len=64"],
    "cpu": ["model.d_model=128", "model.n_heads=4", "model.n_layers=4", "model.seq_len=128"],
}
MODES = {
    "healthy": ([], DP),
    "lockstep": ([], DP),
    "rebalance": (["elastic.rebalance=true"], DP),
    "evict": (["elastic.evict_stragglers=true"], DP),
    "evict_spare": (["elastic.evict_stragglers=true", "elastic.spares=1"], DP + 1),
}


def run_mode(scenario: str, name: str, steps: int, slow_s: float, device_s: float, workdir: str) -> dict:
    """One mode: ``slow_s`` slept per microbatch on the slow rank, ``device_s`` on every other actor."""
    from orchestrator.config.load import load_config

    extra, actors = MODES[name]
    # A fresh metrics file and checkpoint directory for every run: a later round must neither resume
    # from an earlier round's checkpoint (an eviction commits one) nor read its events.
    run_dir = tempfile.mkdtemp(prefix=f"{scenario}-{name}-", dir=workdir)
    mpath = os.path.join(run_dir, "metrics.jsonl")
    cfg = load_config(None, SCENARIOS[scenario] + COMMON + extra + [
        f"train.steps={steps}", f"metrics.path={mpath}", f"checkpoint.dir={os.path.join(run_dir, 'ckpt')}"])
    load_before = load_average()
    summary, wall, victim = _train_with_a_slow_rank(cfg, actors, steps, slow_s, device_s)
    records = [json.loads(line) for line in open(mpath)]
    by_step = {r["step"]: r for r in records if "loss" in r and "event" not in r}  # the last record wins
    assert sorted(by_step) == list(range(1, steps + 1)), f"{name}: steps {sorted(by_step)}"
    start, = [r for r in records if r.get("event") == "start"]
    assert start["resumed_from_step"] == 0, f"{name}: resumed from step {start['resumed_from_step']}"
    tokens = G * cfg.model.seq_len
    late = [by_step[s]["step_time_s"] for s in range(steps // 2 + 1, steps + 1)]
    events = {kind: [r for r in records if r.get("event") == kind] for kind in ("rebalance", "evict", "rebuild")}
    out = {
        "steps": steps, "final_step": summary.final_step, "restarts": summary.restarts, "wall_s": round(wall, 3),
        "tokens_per_s": round(steps * tokens / wall, 1),
        "steady_median_step_s": round(statistics.median(late), 4),
        "steady_tokens_per_s": round(tokens / statistics.median(late), 1),
        "median_step_s": round(statistics.median(r["step_time_s"] for r in by_step.values()), 4),
        "final_dp": by_step[steps]["dp"], "load_average_before": load_before, "load_average_after": load_average(),
        "rebalance_events": [{k: e[k] for k in ("step", "microbatches", "speeds")} for e in events["rebalance"]],
        "evicted_at_step": events["evict"][0]["step"] if events["evict"] else None,
        "rebuild_recovery_s": events["rebuild"][0].get("recovery_s") if events["rebuild"] else None,
        "evicted_the_slow_actor": bool(events["evict"]) and events["evict"][0]["actors"] == [victim],
    }
    if name == "healthy":
        # A replica's compute (device time included) per microbatch: the F/B actions' share of the
        # step (1 - bubble), over 6.
        per_mb = [(1 - by_step[s]["bubble"]) * by_step[s]["step_time_s"] / (G // MBS // DP)
                  for s in range(steps // 2 + 1, steps + 1)]
        out["compute_per_microbatch_s"] = round(statistics.median(per_mb), 5)
    return out


def _train_with_a_slow_rank(cfg, actors: int, steps: int, slow_s: float, device_s: float) -> tuple:
    """Train ``cfg`` on ``actors`` rank actors of a local Ray, SLOW_RANK's actor sleeping ``slow_s`` per
    microbatch and every other actor ``device_s``: (the run's summary, its wall seconds, the slow actor)."""
    import ray

    from meshspeak.rank_calls import RankCalls
    from testbed.ray_cluster import make_group
    from testbed.driver_steps import form_first_generation
    from testbed.ray_harness import make_controller
    from workers.store import StoreHost

    with local_ray():
        host = StoreHost.remote()
        store_address = ray.get(host.address.remote(), timeout=60)
        group = make_group(actors)
        try:
            controller = make_controller(cfg, group, store_address)
            victim = form_first_generation(controller)[SLOW_RANK]
            for actor in group.live_ids:  # spares included: a promoted spare is a healthy device
                sleep = slow_s if actor == victim else device_s
                if sleep > 0:
                    group.call([actor], RankCalls.arm_fault, (1, "sleep", sleep, "microbatch", steps + 1), timeout_s=30)
            t0 = time.time()
            summary = controller.run()
            wall = time.time() - t0
            controller.metrics.close()
        finally:
            group.shutdown()
    return summary, wall, victim


def run_mode_retried(*args) -> dict:
    """``run_mode``, once more after a pause if the local Ray failed to start (on the shared machine
    at a load average near 90 its node once timed out during start-up)."""
    try:
        return run_mode(*args)
    except Exception as exc:
        if "timed out during startup" not in str(exc):
            raise
        time.sleep(30)
        return run_mode(*args)


def _ratios(modes: dict) -> dict:
    """One round's figures over its own healthy run's capacity bound (3.5 / 4 of its tokens/s)."""
    bound = modes["healthy"]["tokens_per_s"] * (DP - 0.5) / DP
    steady_bound = modes["healthy"]["steady_tokens_per_s"] * (DP - 0.5) / DP
    return {"capacity_bound_tokens_per_s": round(bound, 1),
            "capacity_bound_steady_tokens_per_s": round(steady_bound, 1),
            "of_capacity_bound": {m: round(r["tokens_per_s"] / bound, 3) for m, r in modes.items()},
            "of_capacity_bound_steady": {m: round(r["steady_tokens_per_s"] / steady_bound, 3)
                                         for m, r in modes.items()}}


def run_scenario(scenario: str, steps: int, modes: list[str], repeats: int, workdir: str, save) -> dict:
    """``repeats`` rounds of every mode, each round measured against its own healthy run (the load of
    the shared machine drifts over minutes); the medians over the rounds are the scenario's figures."""
    device_s = DEVICE_S if scenario == "device" else 0.0
    out: dict = {"device_s_per_microbatch": device_s, "rounds": []}
    slow_s = None
    for _ in range(repeats):
        healthy = run_mode_retried(scenario, "healthy", steps, device_s, device_s, workdir)
        print(scenario, "healthy", json.dumps(healthy), flush=True)
        if slow_s is None:
            # Slowed 2x: a healthy replica's time per microbatch h (device time included) doubles: the
            # slow rank computes the same (h - device_s) and sleeps the rest, h + device_s. Fixed from
            # the first round on, so every round has the same fault.
            slow_s = out["slow_sleep_per_microbatch_s"] = healthy["compute_per_microbatch_s"] + device_s
        round_: dict = {"modes": {"healthy": healthy}}
        out["rounds"].append(round_)
        for mode in modes:
            if mode != "healthy":
                round_["modes"][mode] = run_mode_retried(scenario, mode, steps, slow_s, device_s, workdir)
                print(scenario, mode, json.dumps(round_["modes"][mode]), flush=True)
                save(out)  # what is measured so far survives a later failure
        round_.update(_ratios(round_["modes"]))
        save(out)
    out.update(over_rounds(out["rounds"]))
    return out


def over_rounds(rounds: list[dict]) -> dict:
    """The scenario's figures from its rounds: per mode the median over the rounds (``of_capacity_bound``,
    ``of_capacity_bound_steady``) and its spread (``*_spread``); the goal holds only when rebalancing
    met it in every round (``rounds_meeting_goal`` says in how many; ``goal_met_median`` whether the
    median did)."""
    out: dict = {}
    for key in ("of_capacity_bound", "of_capacity_bound_steady"):
        per_mode = {m: [r[key][m] for r in rounds] for m in rounds[0][key]}
        out[key] = {m: round(statistics.median(v), 3) for m, v in per_mode.items()}
        out[f"{key}_spread"] = {m: spread(v, 3) for m, v in per_mode.items()}
    if "rebalance" in out["of_capacity_bound"]:
        meeting, every_round = repeats_meeting([r["of_capacity_bound"]["rebalance"] for r in rounds],
                                               lambda x: x >= GOAL)
        out["rounds_meeting_goal"] = meeting
        out["goal_met_median"] = out["of_capacity_bound"]["rebalance"] >= GOAL
        out["goal_met"] = every_round
    return out


def main() -> None:
    p = parser(__doc__, "rebalance", "20 steps per mode instead of 100")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of device,cpu")
    p.add_argument("--repeats", type=int, default=None,
                   help="rounds of every mode (default 3, quick 1; medians with their spread reported)")
    args = p.parse_args()
    steps = args.steps or (20 if args.quick else 100)
    args.repeats = args.repeats or (1 if args.quick else 3)
    modes = [m for m in args.modes.split(",") if m]
    result: dict = {"benchmark": "rebalance", "quick": args.quick, "steps": steps, "repeats": args.repeats,
                    "goal": GOAL,
                    "config": {"common": COMMON, "scenarios": SCENARIOS, "slow_world_rank": SLOW_RANK,
                               "modes": {m: MODES[m][0] for m in MODES}},
                    "machine": machine(load_average_start=load_average()), "scenarios": {}}
    with tempfile.TemporaryDirectory(prefix="rebalance-bench-") as workdir:
        for scenario in [s for s in args.scenarios.split(",") if s]:
            def save(partial, scenario=scenario):
                result["scenarios"][scenario] = partial
                write_result(args.out, result)

            save(run_scenario(scenario, steps, modes, args.repeats, workdir, save))
    result["machine"]["load_average_end"] = load_average()
    write_result(args.out, result)
    print(json.dumps({name: {k: sc[k] for k in ("of_capacity_bound", "of_capacity_bound_steady", "goal_met")
                             if k in sc}
                      for name, sc in result["scenarios"].items()}, indent=2))


if __name__ == "__main__":
    main()
