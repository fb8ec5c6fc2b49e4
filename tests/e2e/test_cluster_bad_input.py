"""Cluster bad input through the real CLI (default run): exit 2, one line naming what to fix, no
traceback, and always within a bound -- never a hang (each test's pytest timeout is that bound; the
error line shows which bounded path ended the run, no wall-clock asserts).

  * RAY_ADDRESS with nothing listening: fails at once (a TCP probe before ray.init's retries);
  * RAY_ADDRESS that accepts TCP but never speaks Ray: fails after the connect bound
    (resources.connect_timeout_s, 30 s by default; 5 s here);
  * RAY_ADDRESS set to the dashboard's http:// address (what `ray job` uses): says so;
  * resources.use_gpu=true on a CPU-only Ray with no autoscaler: fails after
    resources.placement_timeout_s instead of waiting forever. (tests/e2e/test_ray_job_submit.py does
    the same through `ray job submit` on a `ray start` cluster.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest

from testbed.ray_start import free_ports

pytestmark = pytest.mark.ray  # Ray clients (and, for the GPU case, an embedded Ray) in a subprocess

CONNECT_BOUND_S = 5.0  # resources.connect_timeout_s, set by the test (the default, 30 s, is only waited longer)


def run_cli(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=timeout, env={**base, **env})


def error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("elastimesh: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.timeout(120)
def test_ray_address_with_nothing_listening_fails_at_once():
    (port,) = free_ports(1)
    line = error_line(run_cli("train", env={"RAY_ADDRESS": f"127.0.0.1:{port}"}, timeout=100))
    assert f"RAY_ADDRESS=127.0.0.1:{port}" in line and "cannot reach a Ray cluster" in line
    assert "ray start --head" in line
    # The TCP probe refused it (its wording), before ray.init and its own retry loop ever ran.
    assert f"nothing answers at 127.0.0.1:{port}" in line


class SilentListener:
    """Accepts TCP connections on a free port and never answers: a host:port that is not a Ray GCS."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("0.0.0.0", 0))  # any interface: ray.init rewrites 127.0.0.1 to the node's IP
        self.sock.listen(64)
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.mark.timeout(180)
def test_ray_address_that_never_answers_fails_within_the_connect_bound():
    listener = SilentListener()
    try:
        proc = run_cli("train", "--set", f"resources.connect_timeout_s={CONNECT_BOUND_S:g}",
                       env={"RAY_ADDRESS": f"127.0.0.1:{listener.port}"}, timeout=150)
    finally:
        listener.close()
    line = error_line(proc)
    assert f"RAY_ADDRESS=127.0.0.1:{listener.port}" in line and "cannot reach a Ray cluster" in line
    assert listener.conns, "the probe should have connected (then ray.init waited for an answer)"
    # The connect bound ended it (its wording, naming the key), not ray.init giving up on its own.
    assert f"no answer in {CONNECT_BOUND_S:g}s, resources.connect_timeout_s" in line


@pytest.mark.timeout(120)
def test_dashboard_http_address_in_ray_address_is_explained():
    line = error_line(run_cli("train", env={"RAY_ADDRESS": "http://127.0.0.1:8265"}, timeout=100))
    assert "RAY_ADDRESS=http://127.0.0.1:8265" in line and "dashboard" in line and "host:6379" in line


@pytest.mark.timeout(300)
@pytest.mark.slow  # ~17 s; in CI the e2e suite (run after the default one) checks it through `ray job submit`
def test_gpu_job_on_a_cpu_only_ray_fails_after_the_placement_timeout():
    # No RAY_ADDRESS: the embedded local Ray, CPU only, no autoscaler.
    proc = run_cli("train", "--set", "resources.use_gpu=true", "--set", "resources.placement_timeout_s=3",
                   env={}, timeout=280)
    line = error_line(proc)
    # The placement wait (the configured 3 s) ended it: the message names that bound.
    assert "resources.placement_timeout_s=3s" in line and "GPU 0" in line
    assert "no node has a GPU" in line and "resources.use_gpu=false" in line
