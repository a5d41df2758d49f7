"""The project's modules import one another without a cycle, and the tiers stay apart.

Every `import` / `from ... import` of a project module counts, wherever it stands (module
top, inside a function, under `TYPE_CHECKING`): an import moved into a function to dodge a
circle is still a circle in the design, so it fails here too.

Layering: a tier (services/encoder, services/language, services/router; installed as
`tandem.services.<tier>`) imports only itself and the shared package, and the shared
package (the rest of tandem/) imports no tier. What two tiers share lives in tandem/. The
same scan also counts a string that names a module of a forbidden tier
(`importlib.import_module("tandem.services.x")` is an import too).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tandem", "services")
SKIP = ("tandem/v1/",)  # generated stubs


def _module_name(path: Path) -> str:
    """The import name: services/ is installed as `tandem.services` (setup.py)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(("tandem",) + parts if parts[0] == "services" else parts)


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


def _imports(mod: str, path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, project module) for each import in `mod`, wherever it stands."""
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
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
                out.append((node.lineno, dep))
    return out


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    return {mod: {dep for _, dep in _imports(mod, path, known)} for mod, path in known.items()}


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


SHARED = "tandem"


def layer(mod: str) -> str:
    """`tandem` for the shared package, `tandem.services.<tier>` for a tier."""
    parts = mod.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["tandem", "services"] else parts[0]


def allowed(src: str, dst: str) -> bool:
    """A module may import its own layer and the shared package; nothing else."""
    return layer(dst) in (layer(src), SHARED)


def _named_modules(path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module) for each string constant that is exactly a project module's name."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value in known]


# The tiers' table (tandem/tiers.py, read by the `tandem` entry point and `tandem serve`'s
# dry run) names each tier's config and serve modules as strings and imports them on use.
# Only strings: an `import` of a tier there still fails.
NAMED_BY_THE_ENTRY_POINT = {"tandem.tiers"}


def layering_violations(known: dict[str, Path] | None = None) -> list[str]:
    known = known if known is not None else _modules()
    out = []
    for mod, path in sorted(known.items()):
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for line, dep in _imports(mod, path, known):
            if not allowed(mod, dep):
                out.append(f"{rel}:{line}: {layer(mod)} imports {dep}")
        if mod in NAMED_BY_THE_ENTRY_POINT:
            continue
        for line, dep in _named_modules(path, known):
            if dep != mod and not allowed(mod, dep):
                out.append(f"{rel}:{line}: {layer(mod)} names the module {dep!r}")
    return out


def test_the_layering_checker_sees_lazy_and_named_imports(tmp_path):
    src = tmp_path / "lazy.py"
    src.write_text("import tandem.units\n"
                   "def f():\n    from tandem.services.router import core\n"
                   "def g():\n    import importlib\n"
                   "    return importlib.import_module('tandem.services.router.core')\n")
    (tmp_path / "core.py").write_text("")
    (tmp_path / "units.py").write_text("")
    known = {"tandem.services.encoder.lazy": src, "tandem.services.router.core": tmp_path / "core.py",
             "tandem.units": tmp_path / "units.py"}
    assert layering_violations(known) == [
        f"{src}:3: tandem.services.encoder imports tandem.services.router.core",
        f"{src}:6: tandem.services.encoder names the module 'tandem.services.router.core'"]
    assert allowed("tandem.services.language.engine.core", "tandem.transfer.payload")
    assert allowed("tandem.services.language.engine.core", "tandem.services.language.model.decoder")
    assert not allowed("tandem.transfer.receiver", "tandem.services.language.engine.request")
    assert not allowed("tandem.services.router.core", "tandem.services.encoder.media.images")


def test_no_tier_imports_another_and_tandem_imports_no_tier():
    violations = layering_violations()
    assert violations == [], "across the layers:\n" + "\n".join(violations)


# Inside a tier, its roles stack: each sub-package (or top-level module) lists the roles it
# may use besides itself and the shared package. A role not listed here may use anything in
# its tier (the process's wiring: main, server, config, metrics, core, front-ends).
ROLES = {
    # language: the network <- the runner <- the engine; tp runs the runner on other ranks
    "tandem.services.language.model": set(),
    "tandem.services.language.runner": {"model", "tp"},  # tp: its TensorParallel, as a type
    "tandem.services.language.tp": {"model", "runner"},
    "tandem.services.language.engine": {"runner.forward_batch", "metrics"},
    # encoder: decoding the media and the vision tower use nothing else of the tier
    "tandem.services.encoder.media": set(),
    "tandem.services.encoder.vit": set(),
    # router: picking and calling the tiers knows nothing of the front doors above it
    "tandem.services.router.dispatch": {"config", "errors", "metrics", "request"},
}


def role_violations(known: dict[str, Path] | None = None) -> list[str]:
    known = known if known is not None else _modules()
    out = []
    for mod, path in sorted(known.items()):
        role = next((r for r in ROLES if mod == r or mod.startswith(r + ".")), None)
        if role is None:
            continue
        tier = layer(mod)
        ok = [role] + [f"{tier}.{u}" for u in ROLES[role]]
        for line, dep in _imports(mod, path, known):
            if layer(dep) == tier and not any(dep == o or dep.startswith(o + ".") for o in ok):
                out.append(f"{path.relative_to(ROOT)}:{line}: {role} uses {dep}")
    return out


def test_roles_inside_a_tier_stack():
    assert role_violations() == [], "\n".join(role_violations())


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
