"""Issue 12, item 17: the package's modules import each other without cycles.

Every import counts, including those inside functions (a deferred import is still a cycle: the
modules cannot be understood, tested or moved apart). cache.py and sharing.py once imported each
other (sharing reached back for the stream helper); shared helpers live in a module both import.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vattention"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph():
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                candidates = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            deps.update(c for c in candidates if c.startswith("vattention") and c != name)
        graph[name] = deps
    return {m: {d for d in deps if d in graph} for m, deps in graph.items()}


def find_cycle(graph):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_package_modules_import_each_other_without_cycles():
    graph = import_graph()
    assert "vattention.cache" in graph and "vattention.sharing" in graph["vattention.cache"]
    # The package __init__ re-exports submodules; submodules importing the package itself
    # (`import vattention`) are the public-API consumers (CLI, integrations), not part of a cycle.
    graph = {m: {d for d in deps if d != "vattention"} for m, deps in graph.items()}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


# The command line dispatches to the tooling; it is the one library-side module that may.
ENTRY_POINTS = {"vattention.__main__"}


def test_the_library_never_imports_the_tooling():
    # Issue 18, item 5: library modules sit at the top of vattention/ (and integrations/); the
    # tooling (benchmarks, demo, traces, progress display, packaged traces) lives in
    # vattention.bench, which may use the library but not the other way round.
    graph = import_graph()
    tooling = {m for m in graph if m == "vattention.bench" or m.startswith("vattention.bench.")}
    assert {"vattention.bench.demo", "vattention.bench.traces", "vattention.bench.progress",
            "vattention.bench.data"} <= tooling
    assert not {"vattention.demo", "vattention.traces", "vattention.progress",
                "vattention.data"} & set(graph)
    offenders = {m: sorted(deps & tooling) for m, deps in graph.items()
                 if m not in tooling and m not in ENTRY_POINTS and deps & tooling}
    assert not offenders, f"library modules importing the tooling: {offenders}"
