"""Every file path and module the docs and the code's comments point at exists.

The layout moves (docs/design.md, "Module map and import rules") left no pointer behind: a path such
as ``orchestrator/control/controller.py`` or a module such as ``meshspeak.dp_plan.ddp_applies`` in
README.md, docs/, bench/README.md or any source file's docstrings and comments must name a file or a
module of the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

from testbed.import_rules import module_name, source_files

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("meshspeak", "orchestrator", "workers", "meshmodels", "meshdata", "checkpoints", "testbed")
DIRS = (*PACKAGES, "tests", "bench", "docs", "examples")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w)" % "|".join(DIRS))
MODULE = re.compile(r"(?<![\w./-])((?:%s)(?:\.\w+)+)" % "|".join(PACKAGES))
# Tests whose text holds made-up trees on purpose.
SYNTHETIC = ("test_import_rules.py", "test_doc_references.py")
# A path's tail that is not a file of ours: globs, results the benches write, generated outputs.
NOT_FILES = re.compile(r"[*<>{}]|\bNAME\b|/results/|\.(json|jsonl|png|html|log|txt|parquet)$")


def _texts() -> list[tuple[Path, str]]:
    docs = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [(p, p.read_text(encoding="utf-8")) for p in [*docs, *source_files(ROOT)]]


def test_every_referenced_path_and_module_exists() -> None:
    modules = {module_name(ROOT, p) for p in source_files(ROOT)}
    missing = set()
    for path, text in _texts():
        if path.name in SYNTHETIC:
            continue
        where = path.relative_to(ROOT)
        for ref in PATH.findall(text):
            ref = ref.rstrip(".")
            if not NOT_FILES.search(ref) and not (ROOT / ref).exists():
                missing.add(f"{where}: {ref}")
        for ref in MODULE.findall(text):
            parts = ref.split(".")
            if not any(".".join(parts[:i]) in modules for i in range(2, len(parts) + 1)):
                missing.add(f"{where}: {ref}")
    assert sorted(missing) == []
