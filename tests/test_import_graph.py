"""The project's modules import one another without a cycle.

Every `import` / `from ... import` of a project module counts, wherever it stands (module
top, inside a function, under `TYPE_CHECKING`): an import moved into a function to dodge a
circle is still a circle in the design, so it fails here too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tandem", "services")
SKIP = ("tandem/v1/",)  # generated stubs


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            if not any(str(p.relative_to(ROOT)).startswith(s) for s in SKIP):
                out[_module_name(p)] = p
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The project module an imported name lives in (longest known prefix)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for mod, path in known.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from a.b import c` may import the module a.b.c or the name c of a.b
                targets = [f"{base}.{a.name}" for a in node.names] or [base]
            for t in targets:
                dep = _resolve(t, known)
                # a package's __init__ is its own parent, not an edge to itself
                if dep and dep != mod and not mod.startswith(dep + "."):
                    graph[mod].add(dep)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_tandem_and_services():
    graph = import_graph()
    assert len(graph) > 50  # the walk sees the project
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_benchmarks_do_not_import_the_test_suites_conftest():
    """tests/conftest.py sets OMP_NUM_THREADS=1 for the suite; a benchmark that imported it
    ran every tier of its clusters on one thread (inherited), and measured that. Benchmarks
    build their checkpoints with tandem.models.tiny.cached_tiny_model instead."""
    offenders = []
    for p in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "conftest" for n in names):
                offenders.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
