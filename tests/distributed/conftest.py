"""Spawned gloo worlds for distributed tests (``testbed.spawn.run_world``), as a fixture."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from testbed.spawn import run_world


@pytest.fixture
def world_runner() -> Callable[..., list[Any]]:
    """The :func:`run_world` helper, as a fixture."""
    return run_world
