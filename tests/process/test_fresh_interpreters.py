"""What only a fresh interpreter can show: import boundaries, and the built-in corpus regenerating.

The driver-side config and the data module are imported by processes that must not pay for (or
depend on) torch and Ray, and the controller's loop must need nothing of Ray but the worker group
(tests/unit/test_controller.py drives it with a fake one), so importing them alone must not import
either; a test process has both
loaded already, hence a new interpreter per check.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import meshdata as data

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["orchestrator.config.load", "meshdata", "orchestrator.control.controller"])
def test_module_imports_neither_torch_nor_ray(module: str) -> None:
    code = f"import sys, {module}; loaded = {{'ray', 'torch'}} & set(sys.modules); assert not loaded, loaded"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_builtin_is_reproducible_from_generator() -> None:
    script = data.BUILTIN_FILE.with_name("make_builtin.py")
    r = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
