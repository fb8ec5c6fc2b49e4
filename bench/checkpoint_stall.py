"""Issue 4: what a checkpoint costs the training step, async vs sync, and load time with resharding.

Two ranks (one process each, gloo on the CPU, a parent ``TCPStore`` on port 0:
``testbed.gloo_world.run_ranks``) build their ``RankRuntime`` for the built-in GPT at dp=2 (ZeRO-3) and
train one step, so that AdamW's moments exist. The model (default ``n_layers=3, d_model=512``, ~12.8 M parameters) holds >= 100 MB of state:
fp32 parameters + ``exp_avg`` + ``exp_avg_sq`` = 12 bytes per parameter, half on each rank. Saves go
through the production path, ``RankRuntime.save_checkpoint`` / ``wait_checkpoint`` (DCP, one file per
rank, fsync'd), into a directory on local disk.

* **sync** (``checkpoint.async = false``): ``save_checkpoint`` returns once the shard is written and
  fsync'd and DCP's ``.metadata`` is down: the whole save is stall.
* **async** (default): ``save_checkpoint`` returns once the state is staged into CPU buffers; DCP
  then writes from a thread. Its stall is what the training step pays. The first async save
  allocates the staging buffers; later ones copy into the same buffers (checked: the stager's cache
  holds the same number of storages at the same addresses), so the steady-state figure is the
  headline and the first one is reported beside it. Each save waits for the previous one's write
  to finish first (outside the timing), so no stall includes waiting for an earlier save.
* **interference**: on a 2-core machine the background write competes with training for CPU, so the
  step trained while a write is in flight is timed against an idle step.

Per repetition the figure is the slowest rank's (the step waits for every rank). Goal: the median
steady-state async stall <= 2% of the median sync save.

Loads (``RankRuntime.load_checkpoint``, DCP reading exactly the slices each rank needs) of a checkpoint
saved at dp=2, into: the same mesh (no resharding), (dp=1, tp=2) in the same two processes re-formed
as a new generation (every tensor resharded from dim-0 FSDP shards to TP shards) and one process
(dp=1, world 1). For each target the baseline is a checkpoint saved at that target mesh. The parameters
loaded by resharding are checked against the saved ones (sum of squares over the whole model). Files
are read from the page cache (just written; dropping caches needs privileges this bench does not ask for).

    python bench/checkpoint_stall.py [--repeats 5] [--layers 3] [--d-model 512] [--dir DIR] [--quick] [--out PATH]

Writes ``bench/results/checkpoint_stall.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

# bench/ is on sys.path; importing common puts the repository root there too.
from common import bench_config, environment, load_average, parser, rank_runtime, write_result

from testbed.gloo_world import run_ranks

WORLD = 2
GOAL = 0.02  # async stall / sync save


class _Rank:
    """One rank's runtime for one generation, and the helpers the measurements share."""

    def __init__(self, rank: int, port: int, model: dict[str, int], dp: int, tp: int, generation: int) -> None:
        cfg = bench_config(model, dp=dp, tp=tp, steps=1000, global_batch=4, micro_batch=2)
        self.runtime, self.actions = rank_runtime(cfg, store_port=port, world_rank=rank, generation=generation,
                                                  timeout_s=600, store_prefix=f"bench-gen{generation}")
        self.groups = self.runtime.groups
        self.rank = rank
        self.step = 0
        self.writer = None  # the writer use_writer gave the runtime

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.groups.ckpt_group)

    def train(self) -> float:
        self.step += 1
        t0 = time.perf_counter()
        self.runtime.train_step(self.step, self.actions)
        return time.perf_counter() - t0

    def use_writer(self, mode: str):
        """Give the runtime a fresh writer (``RankRuntime.use_checkpoint_writer``) and return it: "sync",
        "async_staged" (copy before save returns) or "async_background" (copy on the staging thread;
        what RankRuntime uses by default)."""
        from checkpoints.writer import AsyncCheckpointWriter

        self.writer = AsyncCheckpointWriter(
            self.groups.ckpt_group, use_async=mode != "sync", stage_in_background=mode == "async_background")
        self.runtime.use_checkpoint_writer(self.writer)
        return self.writer

    def state_bytes(self) -> int:
        """Local bytes of parameters + AdamW moments on this rank."""
        import torch
        from torch.distributed.tensor import DTensor

        def local(t):
            return t.to_local() if isinstance(t, DTensor) else t

        total = sum(local(p).numel() * p.element_size() for p in self.runtime.params)
        for opt in self.runtime.optimizers:
            for state in opt.state.values():
                for name, value in state.items():
                    if name != "step" and isinstance(value, torch.Tensor):
                        total += local(value).numel() * value.element_size()
        return total

    def param_checksum(self) -> float | None:
        """Sum of squares of the full model's parameters (a collective; the value on rank 0 only)."""
        full = self.runtime.full_state()
        return float(sum((v.astype("float64") ** 2).sum() for v in full.values())) if full else None

    def stager_cache(self) -> list[tuple[int, int]]:
        """(address, bytes) of the staging buffers the async writer's stager keeps (torch's private API)."""
        stager = getattr(getattr(getattr(self.writer, "_stager", None), "inner", None), "_state_dict_stager", None)
        cache = getattr(stager, "_cached_storage_mapping", None)
        if cache is None:
            return []
        return sorted((s.data_ptr(), s.nbytes()) for s in cache.values())

    def destroy(self) -> None:
        self.runtime.destroy()


def _rm(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _child(rank: int, port: int, model: dict[str, int], repeats: int, workdir: str) -> dict:
    out: dict = {}
    r = _Rank(rank, port, model, dp=WORLD, tp=1, generation=1)
    r.train()  # AdamW state exists from here on
    out["local_state_bytes"] = r.state_bytes()

    # Synchronous saves: the whole save is stall.
    r.use_writer("sync")
    out["sync_s"] = []
    for i in range(repeats):
        path = os.path.join(workdir, f"sync-{i}")
        r.barrier()
        t0 = time.perf_counter()
        r.runtime.save_checkpoint(path, r.step)
        out["sync_s"].append(time.perf_counter() - t0)
        r.barrier()
        if rank == 0:
            _rm(path)
    for mode in ("async_staged", "async_background"):
        out[mode] = _async_saves(r, mode, repeats, workdir)

    # Loads. The source: the current state, saved at dp=2.
    source = os.path.join(workdir, "sync-src-dp2")
    r.use_writer("sync")
    r.runtime.save_checkpoint(source, r.step)
    r.barrier()
    saved_checksum = r.param_checksum()
    out["saved_checksum"] = saved_checksum
    out["loads"] = {"dp2": _time_loads(r, source, repeats)}  # same mesh: no resharding
    r.destroy()

    # (dp=1, tp=2) in the same processes, a new generation: resharded load vs a tp=2 checkpoint.
    r = _Rank(rank, port, model, dp=1, tp=2, generation=2)
    resharded = _time_loads(r, source, repeats)
    resharded["checksum"] = r.param_checksum()
    own = os.path.join(workdir, "sync-tp2")
    r.use_writer("sync")
    r.runtime.save_checkpoint(own, r.step)
    r.barrier()
    out["loads"]["tp2"] = {"resharded_from_dp2": resharded, "same_mesh": _time_loads(r, own, repeats)}
    r.destroy()

    # One process (dp=1, world 1): rank 0 alone.
    if rank == 0:
        r = _Rank(0, port, model, dp=1, tp=1, generation=3)
        resharded = _time_loads(r, source, repeats)
        resharded["checksum"] = r.param_checksum()
        own = os.path.join(workdir, "sync-dp1")
        r.use_writer("sync")
        r.runtime.save_checkpoint(own, r.step)
        out["loads"]["dp1"] = {"resharded_from_dp2": resharded, "same_mesh": _time_loads(r, own, repeats)}
        r.destroy()
    return out


def _async_saves(r: _Rank, mode: str, repeats: int, workdir: str) -> dict:
    """Stall of each save (the call, plus the wait for staging before the next optimizer step),
    the step trained while the write runs, and an idle step before it for comparison."""
    writer = r.use_writer(mode)
    out: dict = {k: [] for k in ("call_s", "fence_s", "stall_s", "write_s", "staging_s", "waited_s",
                                 "step_idle_s", "step_during_write_s", "stager_cache", "in_flight_at_save")}
    for i in range(repeats + 1):  # save 0 allocates the staging buffers
        out["step_idle_s"].append(r.train())
        path = os.path.join(workdir, f"{mode}-{i}")
        r.barrier()
        out["in_flight_at_save"].append(writer.in_flight)  # the previous write must be done by now
        call = r.runtime.save_checkpoint(path, r.step)
        out["step_during_write_s"].append(r.train())  # waits for staging before its optimizer step
        ack = r.runtime.wait_checkpoint()
        timing = r.runtime.last_save_timing()
        out["call_s"].append(call)
        out["fence_s"].append(writer.fence_wait_s)
        out["stall_s"].append(ack.stall_s)  # = the call + the wait for staging in the next step
        out["write_s"].append(ack.write_s)
        out["staging_s"].append(timing.staging_s)
        out["waited_s"].append(timing.waited_s)
        out["stager_cache"].append(r.stager_cache())
        # Did this save take the verified state-dict shortcut?
        out.setdefault("state_dict_shortcut", []).append(list(r.runtime.state_dict_shortcuts()))
        r.barrier()
        if r.rank == 0:
            _rm(path)
    return out


def _time_loads(r: _Rank, path: str, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        r.barrier()
        t0 = time.perf_counter()
        r.runtime.load_checkpoint(path)
        times.append(time.perf_counter() - t0)
    return {"load_s": times}


def run_world(model: dict[str, int], repeats: int, workdir: str, timeout_s: float = 1800.0) -> list[dict]:
    ranks = run_ranks(WORLD, _child, model, repeats, workdir, timeout=timeout_s)
    return [{"rank": rank, **out} for rank, out in enumerate(ranks)]


# -- the figures, from what the ranks measured (pure; no processes). Per repetition a figure is the
# slowest rank's: the training step waits for every rank.


def _slowest_of(per_rank) -> list[float]:
    """Per repetition, the slowest rank's figure: the training step waits for every rank."""
    return [max(values) for values in zip(*per_rank, strict=True)]


def _slowest(ranks: list[dict], key: str) -> list[float]:
    return _slowest_of(r[key] for r in ranks)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _async_summary(ranks: list[dict], mode: str, sync_median: float) -> dict:
    def slowest(key: str) -> list[float]:
        return _slowest_of(r[mode][key] for r in ranks)

    stall, idle, during = slowest("stall_s"), slowest("step_idle_s"), slowest("step_during_write_s")
    caches = [r[mode]["stager_cache"] for r in ranks]
    steady = _median(stall[1:])
    return {
        "stall_s": stall,
        "stall_first_s": stall[0],
        "stall_steady_median_s": steady,
        "stall_ratio": steady / sync_median,
        "call_median_s": _median(slowest("call_s")[1:]),
        "fence_wait_median_s": _median(slowest("fence_s")[1:]),
        "staging_median_s": _median(slowest("staging_s")[1:]),
        "write_median_s": _median(slowest("write_s")),
        "waited_for_previous_max_s": max(slowest("waited_s")),
        # Each save is timed alone: the previous one's write was waited for before it started.
        "saves_started_with_none_in_flight": not any(any(r[mode]["in_flight_at_save"]) for r in ranks),
        # Same staging buffers (address, size) after every save: allocated once, then reused.
        "staging_buffers_reused": all(c and all(x == c[0] for x in c) for c in caches),
        "staging_buffer_bytes_per_rank": [sum(n for _, n in c[-1]) for c in caches],
        # [model, optimizer] per save and rank: True once checkpoints.state verified its shortcut.
        "state_dict_shortcut_steady": all(all(all(f) for f in r[mode]["state_dict_shortcut"][1:]) for r in ranks),
        "step_idle_median_s": _median(idle),
        "step_during_write_median_s": _median(during),
        "step_slowdown_during_write": _median(during) / _median(idle),
    }


def summarize(ranks: list[dict]) -> dict:
    """The figures of the run from every rank's raw timings (slowest rank per repeat, then medians)."""
    sync = _slowest(ranks, "sync_s")
    modes = {mode: _async_summary(ranks, mode, _median(sync)) for mode in ("async_staged", "async_background")}
    state_bytes = sum(r["local_state_bytes"] for r in ranks)
    loads: dict = {}
    saved = ranks[0]["saved_checksum"]
    for target, entry in ranks[0]["loads"].items():
        holders = [r for r in ranks if target in r["loads"]]  # dp1 ran on rank 0 alone
        if target == "dp2":
            same = _slowest_of(h["loads"][target]["load_s"] for h in holders)
            loads[target] = {"same_mesh_median_s": _median(same), "same_mesh_s": same}
            continue
        resh = _slowest_of(h["loads"][target]["resharded_from_dp2"]["load_s"] for h in holders)
        same = _slowest_of(h["loads"][target]["same_mesh"]["load_s"] for h in holders)
        checksum = entry["resharded_from_dp2"]["checksum"]
        loads[target] = {
            "resharded_from_dp2_median_s": _median(resh),
            "same_mesh_median_s": _median(same),
            "ratio_resharded_vs_same": _median(resh) / _median(same),
            "resharded_s": resh,
            "same_mesh_s": same,
            "params_match_saved": checksum is not None and abs(checksum - saved) <= 1e-6 * abs(saved),
        }
    headline = modes["async_background"]
    return {
        "state_bytes": state_bytes,
        "state_mb": state_bytes / 1e6,
        "sync_save_s": sync,
        "sync_save_median_s": _median(sync),
        "async_stall_steady_median_s": headline["stall_steady_median_s"],
        "async_stall_first_s": headline["stall_first_s"],
        "stall_ratio": headline["stall_ratio"],
        "async": modes,
        "loads": loads,
        "goal_met": headline["stall_ratio"] <= GOAL,
    }


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, "checkpoint_stall", "the default tiny model, 2 repeats (smoke run)")
    ap.add_argument("--repeats", type=int, default=5, help="measured saves/loads of each kind (default 5)")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.repeats < 2:
        ap.error("--repeats must be >= 2")
    repeats = 2 if args.quick else args.repeats
    model = {} if args.quick else {"n_layers": args.layers, "d_model": args.d_model, "n_heads": 8}
    workdir = tempfile.mkdtemp(prefix="ckpt-stall-", dir=args.dir)
    t0 = time.perf_counter()
    try:
        ranks = run_world(model, repeats, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    figures = summarize(ranks)
    result = {
        "benchmark": "checkpoint_stall",
        "goal": "median steady-state async stall <= 2% of the median synchronous save of the same state",
        "goal_ratio": GOAL,
        "quick": args.quick,
        "config": {"model_overrides": model, "world": WORLD, "mesh": {"dp": WORLD, "pp": 1, "tp": 1, "zero": 3},
                   "repeats": repeats, "writer": "DCP FileSystemWriter, one file per rank, fsync",
                   "async": "thread, dedicated gloo group, DefaultStager (CPU buffers reused); headline = "
                            "async_background (staging copy on DCP's staging thread, waited for before "
                            "the next optimizer step); async_staged = copy before save returns",
                   "torch_num_threads": 1},
        **figures,
        "elapsed_s": time.perf_counter() - t0,
        "environment": {**environment(), "load_avg_1m": (load_average() or [None])[0]},
    }
    write_result(args.out, result)
    loads = ", ".join(f"{k}: {v.get('resharded_from_dp2_median_s', v['same_mesh_median_s']):.3f}s"
                      + (f" vs {v['same_mesh_median_s']:.3f}s" if "resharded_from_dp2_median_s" in v else "")
                      for k, v in figures["loads"].items())
    print(f"checkpoint_stall: {figures['state_mb']:.0f} MB state; sync save {figures['sync_save_median_s']:.3f}s, "
          f"async stall {figures['async_stall_steady_median_s'] * 1000:.1f} ms (first {figures['async_stall_first_s'] * 1000:.1f} ms) "
          f"= {figures['stall_ratio'] * 100:.2f}% (goal <= {GOAL * 100:.0f}%: {'met' if figures['goal_met'] else 'NOT met'}); "
          f"loads resharded vs same mesh: {loads} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
