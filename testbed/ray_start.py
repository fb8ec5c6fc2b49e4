"""What every `ray start` cluster the tests and benchmarks launch on this machine shares: free ports for
its listeners, the processes that are ours, and a teardown that never touches another Ray.

Used by tests/e2e/raycluster.py (the e2e tests' cluster) and bench/ray_nodes.py (the benchmarks').
Ours are the `ray start --block` processes we started (each in a session of its own), their
descendants, and any process whose environment carries this cluster's token path: Ray's workers run in
process groups of their own, so the session alone would miss them. Teardown never runs ``ray stop``
(it ends every Ray on the machine).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil


def free_ports(count: int) -> list[int]:
    """Ports no process listens on now (held open together so they are distinct)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def owned_processes(procs: list[subprocess.Popen], token_path: Path) -> set[psutil.Process]:
    """The processes of a cluster: ``procs`` (its `ray start`s), their descendants, and every process
    whose environment carries its ``RAY_AUTH_TOKEN_PATH``."""
    found: set[psutil.Process] = set()
    for proc in procs:
        try:
            parent = psutil.Process(proc.pid)
            found |= {parent, *parent.children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    marker = str(token_path)
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("RAY_AUTH_TOKEN_PATH") == marker:
                found.add(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def stop_cluster(procs: list[subprocess.Popen], token_path: Path, grace_s: float = 60.0) -> None:
    """SIGTERM to our `ray start --block` processes (each stops its own node), wait up to ``grace_s``,
    then SIGKILL what is left of ours: their sessions, and every process ``owned_processes`` found
    before or after."""
    leftovers = owned_processes(procs, token_path)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    leftovers |= owned_processes(procs, token_path)
    for proc in procs:  # the sessions we created for them: what is still in them is ours
        if proc.pid > 1:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in leftovers:
        try:
            if p.pid > 1:
                p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(leftovers), timeout=10)
