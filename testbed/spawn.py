"""Spawned gloo worlds for distributed tests: ``run_world(n, fn, *args, timeout=...)``.

Each rank is a plain ``multiprocessing`` ``Process`` (not ``torch.multiprocessing.spawn``, whose
``join`` kills every rank when one fails: tests want every rank's traceback), started from a
forkserver that has torch preloaded (clean processes, without paying torch's import per rank). The
parent hosts a ``TCPStore`` on port 0 so parallel test sessions never fight over a port, and each
world gets a fresh store prefix.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def _child(rank: int, world: int, port: int, prefix: str, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix, base), rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        # Plain pickle: mp.Queue's ForkingPickler would share tensors through this process's
        # memory, which is gone once it exits.
        results.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context() -> Any:
    # forkserver with torch preloaded: the server imports torch once per session and every rank
    # forks from it, instead of each spawned rank importing torch again (seconds each on 2 cores).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def run_world(n: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``n`` spawned gloo ranks; return results by rank.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). Raises AssertionError
    with every failing rank's traceback, or after ``timeout`` seconds (stragglers are killed).
    """
    import torch.distributed as dist

    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    prefix = f"world-{uuid.uuid4().hex[:8]}"
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, n, store.port, prefix, fn, args, results), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    out: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < n:
            try:
                rank, ok, value = results.get(timeout=0.5)
                out[rank] = (ok, value)
                if not ok:  # the others are probably stuck in a collective now: give them 5 s
                    deadline = min(deadline, time.monotonic() + 5.0)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                why = f"ranks {dead} died" if dead else f"stopped waiting after {timeout:.0f}s or a failure"
                errors = "\n".join(f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(out.items()) if not ok)
                raise AssertionError(f"world of {n}: {why}\n{errors}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    failures = {r: v for r, (ok, v) in out.items() if not ok}
    if failures:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())))
    return [pickle.loads(out[r][1]) for r in range(n)]
