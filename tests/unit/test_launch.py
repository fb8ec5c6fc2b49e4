"""orchestrator.launch without a cluster: the RAY_ADDRESS probe and the SIGTERM-to-cleanup path.

(tests/e2e/test_cluster_bad_input.py runs the same cases through the CLI; test_ray_job_submit.py shows
`ray job stop` reaching the cleanup on a real cluster.)
"""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from orchestrator.errors import ClusterConnectError
from orchestrator.launch import probe, stop_on_sigterm


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_probe_refused_port_is_a_clear_connect_error():
    port = closed_port()
    with pytest.raises(ClusterConnectError) as info:
        probe(f"127.0.0.1:{port}")
    assert f"RAY_ADDRESS=127.0.0.1:{port}" in info.value.message and "Connection refused" in info.value.message
    assert info.value.exit_code == 2


def test_probe_accepts_a_listening_port_and_forms_ray_resolves_itself():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        probe(f"127.0.0.1:{s.getsockname()[1]}")  # reachable: ray.init takes it from here
        probe(f"ray://127.0.0.1:{s.getsockname()[1]}")
    probe("auto")  # no host:port to probe


@pytest.mark.parametrize("address", ["http://127.0.0.1:8265", "https://head:8265"])
def test_probe_explains_a_dashboard_address(address):
    with pytest.raises(ClusterConnectError, match="dashboard .* address"):
        probe(address)


def test_sigterm_becomes_systemexit_143_and_the_handler_is_restored():
    # A stand-in handler outside the context: were stop_on_sigterm's missing, the signal lands here
    # (and the assertions fail) instead of killing the test process.
    outside = []

    def stand_in(signum, _frame):
        outside.append(signum)

    saved = signal.signal(signal.SIGTERM, stand_in)
    try:
        cleaned = []
        with pytest.raises(SystemExit) as info:
            with stop_on_sigterm():
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)  # the handler raises in the main thread and cuts this short
                finally:
                    cleaned.append(True)  # the run's `finally` blocks (withdraw, shut down) do run
        assert info.value.code == 128 + signal.SIGTERM
        assert cleaned == [True] and outside == []
        assert signal.getsignal(signal.SIGTERM) is stand_in
    finally:
        signal.signal(signal.SIGTERM, saved)


def test_systemexit_from_inside_ray_calls_keeps_the_sigterm_code():
    # Ray's ray.wait re-raises a SystemExit raised by a signal handler as SystemExit(1).
    with pytest.raises(SystemExit) as info:
        with stop_on_sigterm():
            handler = signal.getsignal(signal.SIGTERM)
            try:
                handler(signal.SIGTERM, None)
            except SystemExit:
                raise SystemExit(1) from None
    assert info.value.code == 128 + signal.SIGTERM
