"""A pool of local rank processes that run one job per generation (``testbed.world``, ``testbed.gloo_world``).

Ranks are plain ``multiprocessing.Process`` es (never ``torch.multiprocessing.start_processes``, whose
``join`` kills the world when one rank exits: docs/design.md, "torch.multiprocessing.start_processes(...)
.join() kills every rank when one exits"), forked from a ``forkserver`` that has imported torch and the
runtime once, so a new rank is a cheap fork instead of a fresh interpreter (8 fresh interpreters take
10-15 s on 2 cores: docs/design.md, "Process start-up dominates on small machines"). The pool is kept
and re-used:
every job is a new generation (fresh store prefix) in the same processes, which is also how the elastic
actors re-form. A job is a picklable callable ``job(rank, store_port, generation) -> picklable``.

Failures never hang: results come back through a queue read with a timeout; if a rank raises, dies or
the run passes its timeout, :class:`MeshRunError` carries every failed rank's traceback and the caller
kills the pool (the other ranks may be blocked in a collective).
"""

from __future__ import annotations

import atexit
import datetime as _dt
import json
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

START_METHOD = "forkserver"
# Imported once by the fork server, so every forked rank starts with them loaded.
PRELOAD = ["torch", "torch.distributed", "numpy", "workers.runtime", "workers.groups"]
WORKER_START_TIMEOUT_S = 240.0  # first pool on a loaded 2-core machine: imports dominate
FAILURE_GRACE_S = 2.0  # after the first failure, wait this long for the other ranks' tracebacks
# Where every native crash that ``testbed.world.run_mesh`` re-ran is recorded (one JSON line
# each); tests/conftest.py points it at a fresh file per session and prints it at the end.
NATIVE_CRASH_LOG_ENV = "ELASTIMESH_NATIVE_CRASH_LOG"
_QUIET_LOGGERS = (  # known noise (docs/design.md, "Warnings")
    "torch.distributed.tensor._redistribute",
    "torch.distributed.fsdp._fully_shard._fsdp_param",
)


class MeshRunError(RuntimeError):
    """A mesh run failed: a rank raised, died or timed out. The message holds every rank's traceback.

    For a failed run the outcome is also kept as data: ``raised`` (ranks whose job raised), ``died``
    (rank -> exit code), ``missing`` (ranks that had reported nothing when the wait ended) and
    ``ended_by``, what ended the wait: "died" or "raised" (the first failure; the others get
    ``FAILURE_GRACE_S`` to report, then the pool is killed) or "timeout" (the run's own deadline).
    """

    def __init__(self, message: str, *, raised: tuple[int, ...] = (), died: dict[int, int] | None = None,
                 missing: tuple[int, ...] = (), ended_by: str = "") -> None:
        super().__init__(message)
        self.raised, self.died, self.missing = tuple(raised), dict(died or {}), tuple(missing)
        self.ended_by = ended_by


def _worker_main(worker_id: int, inbox: Any, outbox: Any) -> None:
    """A pool worker: run jobs from ``inbox`` until ``None``; every outcome goes to ``outbox``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import faulthandler
    import logging
    import warnings

    import torch

    torch.set_num_threads(1)
    # A native crash (SIGABRT/SIGSEGV) then leaves every thread's Python stack in the test's stderr.
    faulthandler.enable(all_threads=True)
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # FSDP2 + SP + our stage outputs: harmless here, nothing modifies a stage output in place
    # (docs/design.md, "Warnings").
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    outbox.put(("ready", worker_id, 0, True, b""))
    while True:
        message = inbox.get()
        if message is None:
            return
        rank, store_port, generation, job = message
        try:
            # Plain pickle: the queue's ForkingPickler would hand tensors over through shared memory.
            payload = pickle.dumps(job(rank, store_port, generation))
            outbox.put(("result", worker_id, generation, True, payload))
        except BaseException:  # noqa: BLE001 - everything goes back to the parent as text
            outbox.put(("result", worker_id, generation, False, traceback.format_exc()))
            # The other ranks may be blocked in a collective with us; the parent kills the pool.


# --- the parent side -----------------------------------------------------------------------------


class _Pool:
    def __init__(self) -> None:
        import datetime

        import torch.distributed as dist

        self.ctx = mp.get_context(START_METHOD)
        if START_METHOD == "forkserver":
            self.ctx.set_forkserver_preload(PRELOAD)
        # Driver-hosted store on a free port: it outlives every rank, and each run gets a fresh
        # "gen<N>" prefix inside build_process_groups (docs/design.md,
        # "Store keys collide across generations").
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip
        self.outbox = self.ctx.Queue()
        self.workers: list[tuple[mp.Process, Any]] = []
        self.generation = 0

    def ensure(self, n: int) -> None:
        """Grow the pool to ``n`` workers and wait until each has its imports done."""
        new = []
        for worker_id in range(len(self.workers), n):
            inbox = self.ctx.Queue()
            proc = self.ctx.Process(
                target=_worker_main, args=(worker_id, inbox, self.outbox), daemon=True,
                name=f"mesh-worker-{worker_id}",
            )  # fmt: skip
            proc.start()
            self.workers.append((proc, inbox))
            new.append(worker_id)
        pending = set(new)
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while pending:
            try:
                kind, worker_id, _, _, _ = self.outbox.get(timeout=0.5)
                if kind == "ready":
                    pending.discard(worker_id)
                continue
            except queue.Empty:
                pass
            dead = [w for w in pending if self.workers[w][0].exitcode is not None]
            if dead or time.monotonic() > deadline:
                codes = {w: self.workers[w][0].exitcode for w in sorted(pending)}
                raise MeshRunError(f"pool workers did not start (worker -> exit code): {codes}")

    def run(self, job: Callable[[int, int, int], Any], world: int, timeout: float) -> dict[int, dict[str, Any]]:
        self.ensure(world)
        self.generation += 1
        generation = self.generation
        for rank in range(world):
            self.workers[rank][1].put((rank, self.store.port, generation, job))
        done: dict[int, dict[str, Any]] = {}
        failed: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(done) + len(failed) < world:
            try:
                kind, worker_id, gen, ok, payload = self.outbox.get(timeout=0.5)
                if kind == "result" and gen == generation:
                    if ok:
                        done[worker_id] = pickle.loads(payload)
                    else:
                        failed[worker_id] = payload
                        deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                continue
            except queue.Empty:
                pass
            dead = {
                r: self.workers[r][0].exitcode
                for r in range(world)
                if r not in done and r not in failed and self.workers[r][0].exitcode is not None
            }
            if dead or time.monotonic() > deadline:
                missing = [r for r in range(world) if r not in done and r not in failed and r not in dead]
                why = []
                if dead:
                    why.append(f"ranks died (rank -> exit code): {dead}")
                if failed:
                    why.append(f"ranks raised: {sorted(failed)}")
                ended_by = "died" if dead else "raised" if failed else "timeout"
                if missing:
                    after = "the run's timeout" if ended_by == "timeout" else "the first failure"
                    why.append(f"no result from ranks {missing} (killed after {after})")
                raise MeshRunError(_failure_text(world, timeout, why, failed), raised=tuple(sorted(failed)),
                                   died=dead, missing=tuple(missing), ended_by=ended_by)
        if failed:
            raise MeshRunError(_failure_text(world, timeout, [f"ranks raised: {sorted(failed)}"], failed),
                               raised=tuple(sorted(failed)), ended_by="raised")
        return done

    def close(self) -> None:
        for proc, inbox in self.workers:
            if proc.is_alive():
                try:
                    inbox.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + 3.0
        for proc, _ in self.workers:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc, _ in self.workers:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for _, inbox in self.workers:
            inbox.close()
            inbox.cancel_join_thread()
        self.outbox.close()
        self.outbox.cancel_join_thread()
        self.workers.clear()


def native_crash_log() -> Path:
    """The file native crashes are recorded in: ``$ELASTIMESH_NATIVE_CRASH_LOG``, else one in the
    system's temporary directory (runs outside pytest: the benchmarks)."""
    return Path(os.environ.get(NATIVE_CRASH_LOG_ENV) or Path(tempfile.gettempdir()) / "elastimesh-native-crashes.jsonl")


def record_native_crash(error: MeshRunError, what: str) -> Path:
    """Append one JSON line for a run that ended in a native crash (docs/design.md, "A rare native crash in
    the test pool"): when, which test (pytest's ``PYTEST_CURRENT_TEST``), ``what`` ran, and the run's
    outcome as data."""
    path = native_crash_log()
    row = {"time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "test": os.environ.get("PYTEST_CURRENT_TEST", ""), "run": what, "died": error.died,
           "raised": list(error.raised), "missing": list(error.missing), "ended_by": error.ended_by,
           "first_line": str(error).splitlines()[0][:500]}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    return path


def read_native_crashes(path: Path) -> list[dict]:
    """The records in ``path`` (none if it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _failure_text(world: int, timeout: float, why: list[str], failed: dict[int, str]) -> str:
    head = f"mesh run of {world} ranks failed (timeout {timeout:.0f}s): " + "; ".join(why)
    return "\n".join([head, *(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))])


_POOL: _Pool | None = None


def shutdown_pool() -> None:
    """Stop the shared worker pool (a later run starts a new one). Safe to call at any time."""
    global _POOL
    pool, _POOL = _POOL, None
    if pool is not None:
        pool.close()


atexit.register(shutdown_pool)


def shared_pool() -> _Pool:
    """The module's shared pool, started on first use."""
    global _POOL
    if _POOL is None:
        _POOL = _Pool()
    return _POOL


def is_shared(pool: _Pool) -> bool:
    return pool is _POOL


def native_crash_report(path: Path) -> list[str]:
    """The terminal summary's lines for the records in ``path`` (none: no lines)."""
    records = read_native_crashes(path)
    if not records:
        return []
    lines = [f"{len(records)} mesh run(s) re-ran after a native crash (docs/design.md, 'A rare native crash in "
             f"the test pool'); records in {path}:"]
    for r in records:
        lines.append(f"  {r['time']} {r['test'] or '(outside a test)'} {r['run']}: died {r['died']}, "
                     f"raised {r['raised']}, ended by {r['ended_by']}: {r['first_line']}")
    return lines
