"""What the benchmark scripts share: their command line, writing the result, a local Ray, one rank's runtime.

Scripts run as ``python bench/NAME.py``, so ``bench/`` is on ``sys.path`` and they import this module as
``common``; importing it puts the repository root on ``sys.path`` too (for ``orchestrator``, ``workers``,
``testbed``). Heavy imports (torch, ray) happen inside the functions that need them.

* :func:`parser` / :func:`write_result`: ``--quick`` and ``--out`` (default ``bench/results/NAME.json``)
  and the JSON file every script writes (indented, parent directories created).
* :func:`load_average`, :func:`environment`, :func:`machine`: the machine facts recorded beside the figures.
* :func:`local_ray`: an embedded local Ray (8 CPU slots, no dashboard), shut down afterwards.
* :func:`bench_config` / :func:`rank_runtime`: a job config and one rank's ``RankRuntime`` with its
  1F1B action list, built as a rank actor would but without Ray (pp = 1); the scripts run such ranks
  with ``testbed.gloo_world.run_ranks`` (the tests' rank pool).
* :func:`remove_node`: a local ``Cluster`` node vanishes, taking the listed processes with it.
* :func:`retry_ray_start`: a run again (up to twice more) when the local Ray or its actors did not start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"


def parser(doc: str, name: str, quick_help: str) -> argparse.ArgumentParser:
    """An argument parser with the script's one-line description, ``--quick`` and ``--out``."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--out", type=Path, default=RESULTS / f"{name}.json",
                   help=f"JSON output (default bench/results/{name}.json)")
    return p


def write_result(out: Path, result: dict) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the platform has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def environment() -> dict[str, Any]:
    """torch and Python versions and the CPU count."""
    import torch

    return {"torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count()}


def machine(**extra: Any) -> dict[str, Any]:
    """The platform string and the CPU count, plus ``extra`` (e.g. a load average)."""
    return {"platform": platform.platform(), "cpus": os.cpu_count(), **extra}


@contextmanager
def local_ray() -> Iterator[None]:
    """An embedded local Ray for the comparisons (never a `ray start` cluster on this machine)."""
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def bench_config(model: dict[str, Any], *, dp: int = 1, tp: int = 1, steps: int, global_batch: int,
                 micro_batch: int):
    """A job config at (dp, pp=1, tp), ZeRO-3, with ``model.*`` overrides."""
    from orchestrator.config.load import load_config

    overrides = [f"mesh.dp={dp}", "mesh.pp=1", f"mesh.tp={tp}", "mesh.zero=3", f"train.steps={steps}",
                 f"train.global_batch_size={global_batch}", f"train.micro_batch_size={micro_batch}"]
    return load_config(None, overrides + [f"model.{k}={v}" for k, v in model.items()])


def rank_runtime(cfg, *, store_port: int, world_rank: int = 0, generation: int = 1, timeout_s: float = 120,
                 store_prefix: str | None = None, device=None):
    """Join ``cfg``'s mesh as ``world_rank`` through the store at 127.0.0.1:``store_port``, on
    ``device`` (default the CPU; a CUDA device makes it an NCCL rank, bench/gpu.py).

    Returns ``(runtime, actions)``: the ``RankRuntime`` and its 1F1B action list (one stage per rank).
    """
    import torch

    from meshspeak.mesh import MeshShape
    from meshspeak.schedule import make_schedule
    from orchestrator.control.generation import runtime_spec
    from orchestrator.plan.mesh_plan import make_plan
    from workers.groups import build_process_groups
    from workers.runtime import RankRuntime

    mesh = cfg.mesh
    device = device or torch.device("cpu")
    # The driver's construction (orchestrator/control/generation.py), with the bench's timeout.
    spec = dataclasses.replace(runtime_spec(cfg, make_plan(cfg), data_path=cfg.data.path,
                                            use_gpu=device.type == "cuda", mask_eos_id=None, resuming=False),
                               collective_timeout_s=timeout_s)
    groups = build_process_groups(store_addr="127.0.0.1", store_port=store_port, generation=generation,
                                  shape=MeshShape(mesh.dp, 1, mesh.tp), world_rank=world_rank,
                                  timeout_s=timeout_s, device=device, store_prefix=store_prefix)
    runtime = RankRuntime(spec, groups)
    microbatches = cfg.train.global_batch_size // (mesh.dp * cfg.train.micro_batch_size)
    return runtime, make_schedule("1f1b", 1, microbatches, 1)[0]


def remove_node(nodes, node, pids) -> None:
    """``node`` of a local ``ray.cluster_utils.Cluster`` goes as a real node would: every process on it
    dies at once. On one machine its worker processes would outlive its raylet (each exits only once it
    notices the raylet gone), so they are killed first: those in ``pids`` (the rank actors the caller
    knows) and every descendant of the node's raylet (``node_processes``), which also takes an actor
    still starting there — in the chaos campaign a spare that became ready as its node was removed lived
    on for a second, answered the failure path's liveness probe and was promoted, and the next
    generation's join failed on it 3 s later (a 4.9 s episode where a real node loss costs ~1.5 s)."""
    for pid in {*pids, *node_processes(node)}:
        if pid > 1:  # never os.kill(0, 1 or -1, ...)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    nodes.remove_node(node, allow_graceful=False)


def node_processes(node) -> list[int]:
    """The pids of every process a local Ray node's raylet started (its workers, its agents), which this
    process started in turn through ``ray.cluster_utils.Cluster.add_node``."""
    import psutil
    from ray._private import ray_constants

    pids: list[int] = []
    for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
        try:
            pids += [child.pid for child in psutil.Process(info.process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return pids


def retry_ray_start(run, *args) -> dict:
    """``run(*args)``, again (up to twice more, in a fresh directory) when the local Ray or the rank actors
    did not start: on a 2-core machine loaded by others a raylet can miss Ray's fixed 30 s registration
    wait (``ray/_private/node.py``) and actors importing torch the group's 120 s ping, which is not what
    is measured."""
    for attempt in range(3):
        try:
            return {**run(*args), "ray_start_retries": attempt}
        except Exception as exc:  # Ray raises a bare Exception for this
            started = "timed out during startup" not in str(exc) and "workers failed to start" not in str(exc)
            if started or attempt == 2:
                raise
            end_own_children()
            args = tuple(fresh_dir(a) if isinstance(a, str) and os.path.isdir(a) else a for a in args)
    raise AssertionError("unreachable")


def end_own_children() -> None:
    """What a Ray that failed to start left behind (its GCS, raylet...): this process's own descendants
    only (nothing else runs in this process between runs)."""
    import psutil
    import ray

    if ray.is_initialized():
        ray.shutdown()
    for child in psutil.Process(os.getpid()).children(recursive=True):
        if child.pid > 1:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass


def fresh_dir(path: str) -> str:
    fresh = f"{path}_retry{time.time_ns()}"
    os.makedirs(fresh)
    return fresh
