"""orchestrator.launch without a cluster: the RAY_ADDRESS probe and the stop signals (SIGTERM, SIGINT).

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
from orchestrator.launch import STOP_SIGNALS, StopRequest, probe, stop_on_signals


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


@pytest.fixture
def stand_in():
    """Stand-in handlers outside the context: were stop_on_signals' missing, a signal lands here (and
    the assertions fail) instead of killing the test process."""
    outside = []

    def record(signum, _frame):
        outside.append(signum)

    saved = {sig: signal.signal(sig, record) for sig in STOP_SIGNALS}
    yield outside, record
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", STOP_SIGNALS)
def test_a_signal_during_start_up_exits_at_once_and_the_handlers_are_restored(stand_in, sig):
    outside, record = stand_in
    cleaned = []
    with pytest.raises(SystemExit) as info:
        with stop_on_signals(StopRequest()):
            try:
                os.kill(os.getpid(), sig)
                time.sleep(5)  # the handler raises in the main thread and cuts this short
            finally:
                cleaned.append(True)  # the run's `finally` blocks (withdraw, shut down) do run
    assert info.value.code == 128 + sig
    assert cleaned == [True] and outside == []
    assert all(signal.getsignal(s) is record for s in STOP_SIGNALS)


@pytest.mark.parametrize("first,second", [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGTERM)])
def test_while_training_the_first_signal_asks_for_a_stop_and_the_second_exits(stand_in, first, second):
    outside, _ = stand_in
    stop = StopRequest()
    stop.graceful = True
    with pytest.raises(SystemExit) as info:
        with stop_on_signals(stop):
            os.kill(os.getpid(), first)
            time.sleep(0.2)  # the handler runs; nothing is raised
            assert stop() and stop.signum == first
            os.kill(os.getpid(), second)
            time.sleep(5)
    assert info.value.code == 128 + second and outside == []


def test_a_graceful_stop_runs_its_on_stop_callbacks_at_once_on_a_thread(stand_in):
    """What must not wait for the step boundary (the autoscaler request's withdrawal: `ray job stop`
    SIGKILLs 3 s after its SIGTERM by default) runs as soon as the signal comes, off the main thread."""
    import threading

    ran = threading.Event()
    threads = []
    stop = StopRequest()
    stop.graceful = True
    stop.on_stop.append(lambda: (threads.append(threading.current_thread()), ran.set()))
    with stop_on_signals(stop):
        os.kill(os.getpid(), signal.SIGTERM)
        assert ran.wait(5.0), "the on-stop callback did not run"
        assert stop() and threads and threads[0] is not threading.main_thread()


def test_systemexit_from_inside_ray_calls_keeps_the_signal_code():
    # Ray's ray.wait re-raises a SystemExit raised by a signal handler as SystemExit(1).
    with pytest.raises(SystemExit) as info:
        with stop_on_signals(StopRequest()):
            handler = signal.getsignal(signal.SIGTERM)
            try:
                handler(signal.SIGTERM, None)
            except SystemExit:
                raise SystemExit(1) from None
    assert info.value.code == 128 + signal.SIGTERM
