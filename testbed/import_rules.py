"""The layout's import rules (docs/design.md, "Module map and import rules"), read from the source.

Every ``.py`` file of the repository is parsed (AST, never imported); each ``import`` and
``from ... import`` becomes an edge from its module to the project module it names (for
``from pkg import name`` the submodule ``pkg.name`` when there is one), marked as module level or lazy
(inside a function) and as typing-only (under ``if TYPE_CHECKING:``; cycles count those all the same).
``violations(root)`` returns one line per broken rule; ``tests/unit/test_import_rules.py`` asserts there
are none in this repository and that each rule fires on a small tree that breaks it on purpose.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

GROUND = "meshspeak"
PRODUCT = (GROUND, "orchestrator", "workers", "meshmodels", "meshdata", "checkpoints")
# Where Ray may be imported: the cluster package, the launcher, the sweep, and the rank side.
RAY_HOMES = ("orchestrator.cluster", "orchestrator.launch", "orchestrator.sweep", "workers")
MAX_LAZY_WORKER_IMPORTERS = 4  # orchestrator modules that may import workers/ lazily (design doc)
MAX_TOP_LEVEL_ORCHESTRATOR = 12
MAX_FUNCTION_LINES = 60  # a function's def line to its last line, docstring and comments included
# Functions that were longer than the cap when it replaced the 400-line file cap (#38), with their length
# then: each may only shrink, and an entry must go once its function is within the cap (or gone), so the
# list can only get shorter. A file cap bent code (squeezed to fit); a function cap does not.
KNOWN_LONG_FUNCTIONS = {
}
SKIP_DIRS = {".venv", ".git", "build", "dist", "__pycache__", ".pytest_cache", "runs"}
DESIGN_MARKER = re.compile(r"^[ \t]*lazy imports of workers/ from orchestrator/: (.*)$", re.MULTILINE)


@dataclass(frozen=True)
class Edge:
    src: str  # importing module
    dst: str  # imported module (a project module, or the top-level name of an outside one)
    lazy: bool  # inside a function
    typing_only: bool  # under ``if TYPE_CHECKING:``
    line: int


def module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(root: Path) -> Iterator[Path]:
    # os.walk, pruned, rather than rglob then filter: a worktree's .venv holds tens of thousands of files,
    # and walking them took the repository check past its 120 s timeout on a loaded 2-core machine.
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in SKIP_DIRS]
        found += [Path(folder) / n for n in names if n.endswith(".py")]
    yield from sorted(found)


def _typing_guard(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[tuple[ast.stmt, bool, bool]]:
    """(import node, lazy, typing_only) for every import statement in ``tree``."""

    def walk(node: ast.AST, lazy: bool, typing_only: bool) -> Iterator[tuple[ast.stmt, bool, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, lazy, typing_only
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, True, typing_only)
            elif isinstance(child, ast.If) and _typing_guard(child):
                for sub in child.body:
                    yield from walk(ast.Module(body=[sub], type_ignores=[]), lazy, True)
                for sub in child.orelse:
                    yield from walk(ast.Module(body=[sub], type_ignores=[]), lazy, typing_only)
            else:
                yield from walk(child, lazy, typing_only)

    yield from walk(tree, False, False)


def edges(root: Path) -> tuple[set[str], list[Edge]]:
    """Every module of the tree and every import edge between them (outside modules by top name)."""
    files = {module_name(root, p): p for p in source_files(root)}
    modules = set(files)
    bench_local = {m.split(".", 1)[1] for m in modules if m.startswith("bench.")}  # bench scripts import siblings
    out: list[Edge] = []
    for src, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        package = src if path.name == "__init__.py" else src.rpartition(".")[0]
        for node, lazy, typing_only in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in modules else base)
            for name in targets:
                if src.startswith("bench.") and name.split(".")[0] in bench_local:
                    name = f"bench.{name}"
                out.append(Edge(src, _resolve(name, modules), lazy, typing_only, node.lineno))
    return modules, out


def _resolve(name: str, modules: set[str]) -> str:
    """The longest prefix of ``name`` that is a module of the tree, else ``name`` itself."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in modules:
            return candidate
    return name


def _top(name: str) -> str:
    return name.split(".")[0]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def cycles(modules: set[str], graph: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), typing-only edges counted: a
    circle behind ``if TYPE_CHECKING:`` is still two modules that cannot be understood one without the
    other (#38)."""
    succ: dict[str, set[str]] = {m: set() for m in modules}
    for e in graph:
        if e.dst in modules and e.dst != e.src:
            succ[e.src].add(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (a few hundred)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return found


def allowed_lazy_worker_importers(root: Path) -> set[str] | None:
    """The orchestrator modules the design doc names as lazy importers of workers/ (None: no line)."""
    doc = root / "docs" / "design.md"
    if not doc.is_file():
        return None
    m = DESIGN_MARKER.search(doc.read_text(encoding="utf-8"))
    return {name.strip(" `.") for name in m.group(1).split(",")} if m else None


def violations(root: Path) -> list[str]:
    """One line per broken rule in the tree at ``root`` (empty: every rule holds)."""
    modules, graph = edges(root)
    bad: list[str] = []
    for e in graph:
        where = f"{e.src}:{e.line} imports {e.dst}"
        src_top, dst_top = _top(e.src), _top(e.dst)
        if src_top == GROUND and dst_top != GROUND and (dst_top in PRODUCT or dst_top in ("torch", "ray")):
            bad.append(f"ground: {where} (the ground package imports no other project package, torch or Ray)")
        if src_top == "workers" and dst_top == "orchestrator":
            bad.append(f"workers->orchestrator: {where}")
        if src_top == "checkpoints" and dst_top in ("orchestrator", "workers", "ray"):
            bad.append(f"checkpoints: {where} (checkpoints/ imports neither orchestrator/, workers/ nor Ray)")
        if src_top == "orchestrator" and dst_top == "workers" and not e.lazy:
            bad.append(f"orchestrator->workers at module level: {where}")
        if src_top == "orchestrator" and _under(e.dst, "torch.distributed"):
            bad.append(f"driver imports torch.distributed: {where}")
        if (dst_top == "ray" and src_top in PRODUCT and not e.typing_only
                and not any(_under(e.src, home) for home in RAY_HOMES)):
            bad.append(f"ray outside {', '.join(RAY_HOMES)}: {where}")
        if src_top == "tests" and (e.dst.rpartition(".")[2].startswith("test_")
                                   or e.dst.rpartition(".")[2] == "conftest") and e.dst in modules:
            bad.append(f"test imports a test module or conftest: {where} (move the shared part to testbed/)")
        if src_top == "bench" and dst_top == "tests":
            bad.append(f"bench->tests: {where} (what both need goes into a package both may import)")
    lazy_importers = sorted({e.src for e in graph if _top(e.src) == "orchestrator" and _top(e.dst) == "workers"})
    if len(lazy_importers) > MAX_LAZY_WORKER_IMPORTERS:
        bad.append(f"orchestrator->workers lazily in {len(lazy_importers)} modules (at most "
                   f"{MAX_LAZY_WORKER_IMPORTERS}): {', '.join(lazy_importers)}")
    named = allowed_lazy_worker_importers(root)
    if lazy_importers and named is not None and not set(lazy_importers) <= named:
        bad.append(f"orchestrator->workers lazily in modules the design doc does not name: "
                   f"{', '.join(sorted(set(lazy_importers) - named))}")
    for component in cycles(modules, graph):
        bad.append(f"import cycle: {' -> '.join(component)}")
    top_level = sorted(p.name for p in (root / "orchestrator").glob("*.py")) if (root / "orchestrator").is_dir() else []
    if len(top_level) > MAX_TOP_LEVEL_ORCHESTRATOR:
        bad.append(f"orchestrator/ has {len(top_level)} top-level modules (at most {MAX_TOP_LEVEL_ORCHESTRATOR}): "
                   "move them into its subpackages")
    bad += long_functions(root)
    return list(dict.fromkeys(bad))  # one line per violation, not per import statement naming it


def function_lengths(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(qualified name, lines from ``def`` to its last line) of every function and method in ``tree``."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    yield name, child.end_lineno - child.lineno + 1
                yield from walk(child, f"{name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def long_functions(root: Path) -> list[str]:
    """Functions over ``MAX_FUNCTION_LINES`` outside tests/ (beyond what ``KNOWN_LONG_FUNCTIONS`` still
    allows), and entries of that list that no longer apply."""
    bad, seen = [], {}
    for path in source_files(root):
        rel = path.relative_to(root).as_posix()
        if rel.split("/", 1)[0] == "tests":
            continue
        for name, lines in function_lengths(ast.parse(path.read_text(encoding="utf-8"))):
            key = f"{rel}::{name}"
            seen[key] = max(lines, seen.get(key, 0))
            allowed = KNOWN_LONG_FUNCTIONS.get(key, MAX_FUNCTION_LINES)
            if lines > allowed:
                bad.append(f"{key}: {lines} lines (at most {MAX_FUNCTION_LINES}): split it into named steps")
    for key, was in KNOWN_LONG_FUNCTIONS.items():
        if (root / key.split("::")[0]).is_file() and seen.get(key, 0) <= MAX_FUNCTION_LINES:
            bad.append(f"{key} is within {MAX_FUNCTION_LINES} lines now (or gone): remove it from "
                       "KNOWN_LONG_FUNCTIONS in testbed/import_rules.py")
    return bad
