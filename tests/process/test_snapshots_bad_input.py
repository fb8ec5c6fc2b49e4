"""checkpoint.memory_every through the real CLI: a negative value is bad input (exit 2, one line)."""

from __future__ import annotations

import pytest

from testbed.command_line import assert_bad_input, run_cli

pytestmark = pytest.mark.timeout(120)


def test_negative_memory_every_is_bad_input():
    proc = run_cli("train", "--set", "checkpoint.memory_every=-1")
    assert_bad_input(proc, "checkpoint.memory_every")
    line = next(x for x in proc.stderr.splitlines() if "elastimesh: error:" in x)
    assert "must be >= 0" in line, line
