"""Run the model-family meshes again and again in the test pool, to catch a rare native crash.

    python -m testbed.stress_meshes --log DIR [--only hf-dp1-pp1-tp2 ...] [--hours H] [--runs N]
        [--steps N] [--pool-per-pass] [--malloc-check] [--perturb BYTE] [--asan] [--valgrind DIR]

docs/design.md, "A rare native crash in the test pool": CI once saw a pooled rank die of SIGABRT
("malloc(): unaligned tcache chunk detected") in ``tests/distributed/test_model_families.py``. This
runs that module's meshes (in its order, or only the named cases) through ``testbed.world.run_mesh``
exactly as the tests do, with the harness's re-run switched off so a crash surfaces, checks every
run against the one-process reference, and appends one JSON line per run to ``DIR/runs.jsonl``
(case, pass, outcome, died codes, ended_by, wall seconds, load average). The ranks' stderr
(faulthandler stacks, glibc's message) goes to this process's stderr: redirect it to a file.

Heap checks in the rank processes (the environment is set before the pool's fork server starts, so
every rank inherits it): ``--malloc-check`` preloads glibc's ``libc_malloc_debug.so`` with
``MALLOC_CHECK_=3`` (glibc >= 2.34 needs the preload for it); ``--perturb`` sets ``MALLOC_PERTURB_``
(freed memory filled with that byte, fresh memory with its complement); ``--asan`` preloads
AddressSanitizer's runtime (its allocator's quarantine, and its checks of the ranges that the
intercepted libc calls - memcpy, read/readv/recv - touch); ``--valgrind DIR`` runs the pool's fork
server, so every rank, under memcheck (every invalid read or write, ~50x slower; logs in DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

MALLOC_DEBUG = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
ASAN = "/usr/lib/x86_64-linux-gnu/libasan.so.8"


def _environment(args) -> dict[str, str]:
    env: dict[str, str] = {}
    preload = []
    if args.asan:
        preload.append(ASAN)
        env["ASAN_OPTIONS"] = "detect_leaks=0:halt_on_error=1:abort_on_error=1:allocator_may_return_null=1"
    if args.malloc_check:
        preload.append(MALLOC_DEBUG)
        env["MALLOC_CHECK_"] = "3"
    if args.perturb:
        env["MALLOC_PERTURB_"] = str(args.perturb)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def _arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log", required=True, type=Path)
    p.add_argument("--only", action="append", help="case name(s), e.g. hf-dp1-pp1-tp2; default: all, in order")
    p.add_argument("--hours", type=float, default=1.0)
    p.add_argument("--runs", type=int, default=0, help="stop after this many runs (0: only --hours)")
    p.add_argument("--steps", type=int, default=0, help="steps per run (default: the tests' 10)")
    p.add_argument("--pool-per-pass", action="store_true", help="a fresh pool for every pass, as per test module")
    p.add_argument("--malloc-check", action="store_true")
    p.add_argument("--perturb", type=int, default=0)
    p.add_argument("--asan", action="store_true")
    p.add_argument("--valgrind", type=Path, default=None,
                   help="run the pool's fork server (so every rank) under valgrind memcheck, logs in this dir")
    return p.parse_args()


def main() -> int:
    args = _arguments()
    env = _environment(args)
    if env and os.environ.get("_STRESS_REEXEC") != "1":
        # LD_PRELOAD must be in place when a process starts: re-exec this driver with it (the pool's
        # fork server is started by this process, so the ranks inherit it too).
        os.environ.update(env, _STRESS_REEXEC="1")
        os.execv(sys.executable, [sys.executable, "-m", "testbed.stress_meshes", *sys.argv[1:]])

    from testbed import world
    from testbed.mesh_cases import STEPS
    from testbed.world import shutdown_pool

    world._native_crash = lambda error: False  # no re-run: every crash is counted
    timeouts = _under_valgrind(args.valgrind) if args.valgrind else (60.0, None)
    cases = _cases()
    if args.only:
        unknown = set(args.only) - {c[0] for c in cases}
        if unknown:
            print(f"--only: unknown case(s) {sorted(unknown)}; known: {[c[0] for c in cases]}", file=sys.stderr)
            return 2
        cases = [c for c in cases if c[0] in args.only]
    args.log.mkdir(parents=True, exist_ok=True)
    steps = args.steps or STEPS
    log = (args.log / "runs.jsonl").open("a")
    log.write(json.dumps({"start": time.time(), "env": env, "cases": [c[0] for c in cases],
                          "pool_per_pass": args.pool_per_pass, "steps": steps,
                          "pid": os.getpid()}) + "\n")
    end = time.monotonic() + args.hours * 3600
    runs = crashes = 0
    passes = 0
    while time.monotonic() < end and (not args.runs or runs < args.runs):
        passes += 1
        for name, shape, overrides in cases:
            row, crashed = _run_case(name, passes, shape, overrides, steps, timeouts)
            crashes += crashed
            runs += 1
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(f"[stress] run {runs} {name}: {row['outcome']} {row.get('died', '')}", file=sys.stderr, flush=True)
        if args.pool_per_pass:
            shutdown_pool()
    shutdown_pool()
    log.write(json.dumps({"end": time.time(), "runs": runs, "passes": passes, "native_crashes": crashes}) + "\n")
    print(f"[stress] {runs} runs, {passes} passes, {crashes} native crashes", file=sys.stderr)
    return 0


def _under_valgrind(directory: Path) -> tuple[float, float]:
    """Run the pool's fork server under memcheck; (collective timeout, run timeout) fit for it."""
    # The fork server is a fresh interpreter started from multiprocessing's executable: a wrapper
    # that execs valgrind puts it, and every rank forked from it, under memcheck (~50x slower).
    import multiprocessing

    from testbed import rank_pool

    directory.mkdir(parents=True, exist_ok=True)
    wrapper = directory / "python-under-valgrind.sh"
    wrapper.write_text("#!/bin/sh\nPYTHONMALLOC=malloc exec valgrind --tool=memcheck --trace-children=no "
                       f"--log-file={directory}/vg-%p.log --num-callers=40 --error-limit=no "
                       f"{sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    multiprocessing.set_executable(str(wrapper))
    rank_pool.WORKER_START_TIMEOUT_S = 3600.0
    return 1800.0, 7200.0


def _cases() -> list[tuple[str, tuple[int, int, int], tuple[str, ...]]]:
    """tests/distributed/test_model_families.py's meshes, in its order: (name, (dp, pp, tp), overrides)."""
    from testbed.family_cases import HF_BATCH, POSNORM
    from testbed.hf_models import save_tiny_llama

    hf_dir = tempfile.mkdtemp(prefix="stress-llama-")
    save_tiny_llama(hf_dir, tie=True, bias=True, layers=2)
    hf = (f"model.from_hf={hf_dir}", f"checkpoint.init_from={hf_dir}", *HF_BATCH)
    rand = (f"model.from_hf={hf_dir}", *HF_BATCH)
    cases = [("posnorm-dp2-pp2-tp2", (2, 2, 2), POSNORM)]
    cases += [(f"hf-dp{d}-pp{q}-tp{t}", (d, q, t), hf) for d, q, t in
              [(3, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (1, 2, 2)]]
    cases += [("rand-dp2-pp2-tp2", (2, 2, 2), rand)]
    return cases


def _run_case(name: str, passes: int, shape: tuple[int, int, int], overrides: tuple[str, ...], steps: int,
              timeouts: tuple[float, float | None]) -> tuple[dict, bool]:
    """One run of one case (in pass ``passes``), checked against the one-process reference: (its log row, whether a rank
    died of a signal: a native crash)."""
    from testbed.family_cases import tied_copy
    from testbed.reference import assert_matches_reference, reference
    from testbed.world import MeshRunError, run_mesh

    dp, pp, tp = shape
    collective_timeout, run_timeout = timeouts
    t0 = time.monotonic()
    row = {"case": name, "pass": passes, "t": time.time()}
    crashed = False
    try:
        run = run_mesh(dp, pp, tp, overrides, steps, instrument=tied_copy if pp > 1 else None,
                       timeout=run_timeout or max(240.0, 8.0 * steps), collective_timeout_s=collective_timeout)
        assert_matches_reference(run.losses, run.params, reference(overrides, steps))
        row["outcome"] = "ok"
    except MeshRunError as error:
        row.update(outcome="mesh_error", died=error.died, ended_by=error.ended_by,
                   raised=list(error.raised), message=str(error)[:4000])
        crashed = any(code < 0 for code in error.died.values())
    except AssertionError as error:
        row.update(outcome="mismatch", message=str(error)[:2000])
    row["wall_s"] = round(time.monotonic() - t0, 2)
    row["load"] = list(os.getloadavg())
    return row, crashed

if __name__ == "__main__":
    sys.exit(main())
