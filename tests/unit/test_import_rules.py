"""The layout's import rules hold in this repository, and each rule fires when broken on purpose.

The rules (docs/design.md, "Module map and import rules") are checked from the source by
``testbed/import_rules.py``: no import cycle (typing-only imports counted); the ground package
imports no other project package, torch or Ray; workers/ never imports orchestrator/; checkpoints/
imports neither orchestrator/, workers/ nor Ray; orchestrator/ imports workers/ only lazily, in at
most four modules the design doc names, and never torch.distributed; Ray only in the cluster package,
launch, sweep and workers/; no test imports a test module or a conftest; bench/ never imports tests/;
orchestrator/ has at most 12 top-level modules; no function outside tests/ is over 60 lines
(``KNOWN_LONG_FUNCTIONS`` lists the ones that were when this cap replaced a 400-line file cap: they
may only shrink, and leave the list).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.import_rules import violations

ROOT = Path(__file__).resolve().parents[2]


def test_the_repository_keeps_every_rule() -> None:
    assert violations(ROOT) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for pkg in ("meshspeak", "orchestrator", "orchestrator/cluster", "workers", "checkpoints", "tests",
                "tests/unit", "tests/helpers"):
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").touch()
    return tmp_path


BROKEN = {
    "cycle": ({"workers/a.py": "from workers import b\n", "workers/b.py": "def f():\n    import workers.a\n"},
              "import cycle: workers.a -> workers.b"),
    "a typing-only cycle": ({"workers/a.py": "from workers import b\n",
                             "workers/b.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                             "    from workers.a import A\n"},
                            "import cycle: workers.a -> workers.b"),
    "ground imports the project": ({"meshspeak/x.py": "from workers.y import z\n", "workers/y.py": ""},
                                   "ground: meshspeak.x:1 imports workers.y"),
    "ground imports torch": ({"meshspeak/x.py": "def f():\n    import torch\n"}, "ground: meshspeak.x:2 imports torch"),
    "workers imports orchestrator": ({"workers/x.py": "from orchestrator.y import z\n", "orchestrator/y.py": ""},
                                     "workers->orchestrator: workers.x:1"),
    "checkpoints imports ray": ({"checkpoints/x.py": "import ray\n"}, "checkpoints: checkpoints.x:1 imports ray"),
    "checkpoints imports workers": ({"checkpoints/x.py": "import workers.y\n", "workers/y.py": ""},
                                    "checkpoints: checkpoints.x:1 imports workers.y"),
    "orchestrator imports workers at module level": (
        {"orchestrator/x.py": "from workers.y import z\n", "workers/y.py": ""},
        "orchestrator->workers at module level: orchestrator.x:1"),
    "orchestrator imports workers lazily in five modules": (
        {**{f"orchestrator/m{i}.py": "def f():\n    import workers.y\n" for i in range(5)}, "workers/y.py": ""},
        "orchestrator->workers lazily in 5 modules"),
    "a lazy importer the design doc does not name": (
        {"orchestrator/m.py": "def f():\n    import workers.y\n", "workers/y.py": "",
         "docs/design.md": "lazy imports of workers/ from orchestrator/: `orchestrator.other`\n"},
        "modules the design doc does not name: orchestrator.m"),
    "the driver imports torch.distributed": ({"orchestrator/x.py": "def f():\n    import torch.distributed\n"},
                                             "driver imports torch.distributed"),
    "ray outside its homes": ({"orchestrator/x.py": "import ray\n"}, "ray outside"),
    "a test imports a test module": ({"tests/unit/test_a.py": "from tests.unit.test_b import f\n",
                                      "tests/unit/test_b.py": "def f(): ...\n"},
                                     "test imports a test module or conftest: tests.unit.test_a:1"),
    "a test imports a conftest": ({"tests/unit/test_a.py": "from tests.conftest import f\n",
                                   "tests/conftest.py": "def f(): ...\n"}, "imports tests.conftest"),
    "bench imports tests": ({"bench/x.py": "from tests.helpers import y\n"}, "bench->tests: bench.x:1"),
    "too many top-level orchestrator modules": ({f"orchestrator/m{i}.py": "" for i in range(13)},
                                                "orchestrator/ has 14 top-level modules"),
    "a function over 60 lines": ({"workers/long.py": "class A:\n    def f(self):\n" + "        x = 1\n" * 60},
                                 "workers/long.py::A.f: 61 lines"),
    "a long function in bench/": ({"bench/b.py": "def g():\n" + "    x = 1\n" * 60}, "bench/b.py::g: 61 lines"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_each_rule_fires_when_broken(tmp_path: Path, case: str) -> None:
    files, expected = BROKEN[case]
    found = violations(_tree(tmp_path, files))
    assert any(expected in line for line in found), found


def test_known_long_functions_only_shrink_and_leave_the_list(tmp_path: Path, monkeypatch) -> None:
    from testbed import import_rules

    body = "def f():\n" + "    x = 1\n" * 69  # 70 lines
    monkeypatch.setitem(import_rules.KNOWN_LONG_FUNCTIONS, "workers/k.py::f", 70)
    assert import_rules.long_functions(_tree(tmp_path, {"workers/k.py": body})) == []
    (tmp_path / "workers/k.py").write_text(body + "    x = 2\n")  # grew past what it was
    assert import_rules.long_functions(tmp_path) == ["workers/k.py::f: 71 lines (at most 60): split it into named steps"]
    (tmp_path / "workers/k.py").write_text("def f():\n    return 1\n")  # split: the entry must go
    assert "remove it from KNOWN_LONG_FUNCTIONS" in import_rules.long_functions(tmp_path)[0]


def test_tests_may_hold_long_functions(tmp_path: Path) -> None:
    assert violations(_tree(tmp_path, {"tests/unit/test_x.py": "def test():\n" + "    x = 1\n" * 80})) == []


def test_a_clean_tree_has_no_violation(tmp_path: Path) -> None:
    files = {"meshspeak/a.py": "import dataclasses\n", "workers/b.py": "from meshspeak.a import x\nimport ray\n",
             "orchestrator/cluster/c.py": "import ray\n\ndef f():\n    import workers.b\n",
             "checkpoints/d.py": "from meshspeak import a\n", "tests/unit/test_e.py": "from tests.helpers import f\n",
             "tests/helpers/f.py": "", "docs/design.md": "lazy imports of workers/ from orchestrator/: "
                                                          "`orchestrator.cluster.c`\n"}
    assert violations(_tree(tmp_path, files)) == []
