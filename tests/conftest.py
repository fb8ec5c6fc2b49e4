"""Session-wide: the record of native crashes the mesh harness re-ran, printed at the end of the run.

``testbed.world.run_mesh`` re-runs a mesh once when a rank died of SIGABRT/SIGSEGV/SIGBUS
(docs/design.md, "A rare native crash in the test pool": a heap-check abort seen once in CI and not
reproduced since). A re-run must not hide it: each one is appended to the file ``$ELASTIMESH_NATIVE_CRASH_LOG`` names
(``testbed.rank_pool.record_native_crash``). This points that variable at a fresh file for the
session (unless it is set already, e.g. by CI to keep a history across runs) and, at the end, prints
every record in it in the terminal summary.

Also session-wide: the embedded Ray that consecutive modules share (testbed/shared_ray.py): the modules
asking for tests/ray's ``ray_local`` run one after another, and every other module finds it stopped.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from testbed import shared_ray
from testbed.rank_pool import NATIVE_CRASH_LOG_ENV, native_crash_report


def pytest_configure(config) -> None:
    if not os.environ.get(NATIVE_CRASH_LOG_ENV):
        directory = tempfile.mkdtemp(prefix="elastimesh-native-crashes-")
        os.environ[NATIVE_CRASH_LOG_ENV] = str(Path(directory) / "native_crashes.jsonl")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    lines = native_crash_report(Path(os.environ.get(NATIVE_CRASH_LOG_ENV, "")))
    if lines:
        terminalreporter.section("native crashes re-run", sep="=", red=True, bold=True)
        for line in lines:
            terminalreporter.write_line(line)


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: only the tests that will run count
def pytest_collection_modifyitems(session, config, items) -> None:
    config.ray_local_modules = shared_ray.ray_local_first(items)


@pytest.fixture(scope="module", autouse=True)
def _shared_ray_only_where_asked(request):
    """A module that does not ask for ``ray_local`` finds no shared Ray running (it may start its own,
    or test what happens without one)."""
    if shared_ray.module_of(request.node) not in getattr(request.config, "ray_local_modules", set()):
        shared_ray.release()
    yield


@pytest.fixture(scope="session", autouse=True)
def _shared_ray_stopped_at_the_end():
    yield
    shared_ray.release()
