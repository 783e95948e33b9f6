"""How the package's modules may use each other.

* No import cycles. Every import counts, including those inside functions (a deferred import is
  still a cycle: the modules cannot be understood, tested or moved apart). cache.py and sharing.py
  once imported each other (sharing reached back for the stream helper); shared helpers live in a
  module both import.
* The library never imports the tooling (vattention.bench).
* The integrations (vattention/integrations/**) and the command-line tooling (vattention/bench/**,
  vattention/__main__.py) are users of the library like any other: they never import the compiled
  extension vattention._C, and never use a private name (leading underscore) of another vattention
  module: not imported by name, not read off an imported module, not read off a vattention object
  (an attribute that only another vattention module defines, such as ``cache._core``).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

PACKAGE = Path(__file__).resolve().parent.parent / "vattention"
EXTENSION = "vattention._C"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, Tuple[Path, ast.Module]]:
    """Every module of the package: name -> (path, syntax tree)."""
    return {_module_name(p): (p, ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(tree: ast.AST, name: str, is_package: bool) -> Iterator[Tuple[ast.stmt, str, list]]:
    """(node, absolute module, [(imported name or None, bound name)]) of every import in ``tree``,
    relative ones resolved against module ``name``. ``import a.b`` binds ``a``; ``import a.b as c``
    binds ``c`` to ``a.b`` (imported name None: the module itself)."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield node, target, [(a.name, a.asname or a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    yield node, a.name, [(None, a.asname)]
                else:
                    yield node, a.name, [(None, a.name.partition(".")[0])]
        elif _string_import(node):
            # importlib.import_module("a.b") / __import__("a.b"): an import all the same (what it
            # binds, if anything, is an assignment's business).
            yield node, _string_import(node), [(None, None)]


def _string_import(node: ast.AST) -> Optional[str]:
    """The module a call ``importlib.import_module("x")`` or ``__import__("x")`` imports."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    arg = node.args[0]
    if called in ("import_module", "__import__") and isinstance(arg, ast.Constant):
        return arg.value if isinstance(arg.value, str) else None
    return None


def import_graph():
    """module -> the package modules it imports. ``from pkg import sub`` depends on the submodule
    ``pkg.sub`` only (importing it runs ``pkg/__init__`` first, which is never a cycle for
    ``pkg``'s own submodules); ``from pkg import name`` of anything else depends on ``pkg``."""
    modules = _modules()
    known = set(modules) | {EXTENSION}
    graph = {}
    for name, (path, tree) in modules.items():
        deps = set()
        for _, target, names in _imports(tree, name, path.name == "__init__.py"):
            submodules = [f"{target}.{n}" for n, _ in names if n and f"{target}.{n}" in known]
            others = [n for n, _ in names if n is None or f"{target}.{n}" not in known]
            deps.update(submodules)
            if others:
                deps.add(target)
        graph[name] = {d for d in deps if d.startswith("vattention") and d != name}
    return {m: {d for d in deps if d in graph} for m, deps in graph.items()}


def find_cycle(graph):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep) :] + [dep]
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
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_import_graph_sees_package_imports_and_string_imports():
    # A library module that imports the package (which imports it back) is a cycle; importing a
    # submodule by name is not an import of the package.
    tree = ast.parse("from . import errors\nfrom vattention import KVCache\n")
    deps = {t for _, t, _ in _imports(tree, "vattention.example", False)}
    assert deps == {"vattention"}
    tree = ast.parse("import importlib\nimportlib.import_module('vattention._C')\n")
    assert "vattention._C" in {t for _, t, _ in _imports(tree, "vattention.example", False)}
    cycle = find_cycle({"vattention": {"vattention.cache"}, "vattention.cache": {"vattention"}})
    assert cycle == ["vattention", "vattention.cache", "vattention"]


# The command line dispatches to the tooling; it is the one library-side module that may.
ENTRY_POINTS = {"vattention.__main__"}


def test_the_library_never_imports_the_tooling():
    # Library modules sit at the top of vattention/ (and integrations/); the tooling (benchmarks,
    # demo, traces, progress display, packaged traces) lives in vattention.bench, which may use
    # the library but not the other way round.
    graph = import_graph()
    tooling = {m for m in graph if m == "vattention.bench" or m.startswith("vattention.bench.")}
    assert {
        "vattention.bench.demo",
        "vattention.bench.traces",
        "vattention.bench.progress",
        "vattention.bench.data",
    } <= tooling
    assert not {
        "vattention.demo",
        "vattention.traces",
        "vattention.progress",
        "vattention.data",
    } & set(graph)
    offenders = {
        m: sorted(deps & tooling)
        for m, deps in graph.items()
        if m not in tooling and m not in ENTRY_POINTS and deps & tooling
    }
    assert not offenders, f"library modules importing the tooling: {offenders}"


# ---- the integrations and the tooling use the library's public API only -----------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def is_api_user(name: str) -> bool:
    """Modules held to the public API: the integrations, the tooling, the command line."""
    return (
        name.startswith("vattention.integrations.")
        or name == "vattention.integrations"
        or name.startswith("vattention.bench.")
        or name == "vattention.bench"
        or name == "vattention.__main__"
    )


_SETTERS = ("setattr", "__setattr__")


def _is_self(node: ast.AST) -> bool:
    """``self``, ``cls`` or ``super()``: an object of the module's own classes."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


_ACCESSORS = ("getattr", "hasattr", "delattr") + _SETTERS


def _named_attribute(node: ast.AST, calls=_ACCESSORS) -> Optional[str]:
    """The attribute a ``getattr(x, "name")``-style call of ``calls`` names, else None."""
    if not isinstance(node, ast.Call) or len(node.args) < 2:
        return None
    func = node.func
    called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    arg = node.args[1]
    if called in calls and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


def private_definitions(tree: ast.Module) -> Set[str]:
    """Private names a module defines: its top-level names, its classes' members, and attributes
    it assigns on any object (``self._core = ...``, ``setattr(self, "_geometry", ...)``)."""
    found = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update(t.id for t in targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    found.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    found.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update(t.attr for t in targets if isinstance(t, ast.Attribute))
        elif _named_attribute(node, _SETTERS):
            found.add(_named_attribute(node, _SETTERS))
    return {n for n in found if _private(n)}


def private_uses(
    tree: ast.Module, name: str, is_package: bool, modules: Set[str], defined: Dict[str, Set[str]]
) -> List[str]:
    """Every use of another vattention module's private name in module ``name``, one line each.

    ``modules``: the package's module names; ``defined``: module -> its private definitions.
    """
    found = []
    bound = {}  # local name -> the vattention module it is bound to
    for node, target, names in _imports(tree, name, is_package):
        if not target.startswith("vattention"):
            continue
        where = f"line {node.lineno}"
        if any(_private(part) for part in target.split(".")):
            found.append(f"{where}: imports {target}")
        for imported, local in names:
            if imported is None:
                bound[local] = target if local != target.partition(".")[0] else local
                continue
            if _private(imported):
                found.append(f"{where}: imports {imported} from {target}")
            elif f"{target}.{imported}" in modules:
                bound[local] = f"{target}.{imported}"
    own = defined.get(name, set())
    others: Dict[str, List[str]] = {}
    for module, names in defined.items():
        for n in names:
            if module != name:
                others.setdefault(n, []).append(module)
    for node in ast.walk(tree):
        attr = node.attr if isinstance(node, ast.Attribute) else _named_attribute(node)
        if not attr or not _private(attr):
            continue
        owner = node.value if isinstance(node, ast.Attribute) else node.args[0]
        chain = []
        while isinstance(owner, ast.Attribute):
            chain.insert(0, owner.attr)
            owner = owner.value
        where = f"line {node.lineno}"
        if isinstance(owner, ast.Name) and owner.id in bound:
            found.append(
                f"{where}: {'.'.join([owner.id, *chain, attr])} (a private name of "
                f"module {'.'.join([bound[owner.id], *chain])})"
            )
        elif attr in others and not (attr in own and not chain and _is_self(owner)):
            # A name this module defines too is its own only on its own objects (self, cls,
            # super()).
            found.append(f"{where}: .{attr} (private to {', '.join(sorted(others[attr]))})")
    return found


def _uses_in(source: str, name: str = "vattention.integrations.vllm.example") -> List[str]:
    """private_uses of ``source`` as if it were module ``name`` of the package."""
    modules = _modules()
    defined = {m: private_definitions(tree) for m, (_, tree) in modules.items()}
    tree = ast.parse(textwrap.dedent(source))
    defined[name] = private_definitions(tree)
    return private_uses(tree, name, False, set(modules) | {EXTENSION}, defined)


def test_private_use_finder_finds_every_form():
    bad = {
        "from vattention import _C": "imports _C from vattention",
        "from ... import _C": "imports _C from vattention",
        "def f():\n    from ... import _C": "imports _C from vattention",
        "import vattention._C as native": "imports vattention._C",
        "from vattention._C import KVCacheCore": "imports vattention._C",
        "from ..flash_attn import _check_offsets": "imports _check_offsets from",
        "from .. import flash_attn as fa\nfa._default_kernel(q, k)": "fa._default_kernel (a",
        "import vattention\nvattention._C.host_huge_unit()": "vattention._C (a private name",
        "import vattention.integrations.flash_attn\n"
        "vattention.integrations.flash_attn._check_offsets": "flash_attn._check_offsets (a",
        "def f(cache):\n    return cache._core.stats()": "._core (private to vattention.cache_base",
        "def f(config):\n    return config._geometry": "._geometry (private to",
        "getattr(cache, '_core')": "._core (private to",
        "import importlib\nimportlib.import_module('vattention._C')": "imports vattention._C",
        # defining a name of the same spelling does not make another module's private one ours
        "class C:\n    def __init__(self):\n        self._core = 1\n"
        "    def f(self, cache):\n        return cache._core": "._core (private to",
    }
    for source, message in bad.items():
        uses = _uses_in(source)
        assert len(uses) == 1 and message in uses[0], (source, uses)
    fine = [
        "from vattention import KVCache, __version__, attention, backends",
        "from .. import flash_attn as fa\nfa.flash_attn_with_kvcache",
        "def f(layer):\n    return layer._k_scale_float",  # vLLM's attribute: not ours
        "class R:\n    def g(self):\n        return super()._update_states()\n"
        "    def _update_states(self):\n        self._core = 1\n        return self._core",
        "from vattention.arguments import as_stream as _stream",
    ]
    for source in fine:
        assert _uses_in(source) == [], source


def test_integrations_and_tooling_never_import_the_extension():
    modules = _modules()
    users = {m for m in modules if is_api_user(m)}
    assert {
        "vattention.__main__",
        "vattention.bench.sizing",
        "vattention.integrations.vllm.plugin",
        "vattention.integrations.vllm.attention",
    } <= users
    offenders = {}
    for name in sorted(users):
        path, tree = modules[name]
        for node, target, names in _imports(tree, name, path.name == "__init__.py"):
            paths = [target] + [f"{target}.{n}" for n, _ in names if n]
            if any(p == EXTENSION or p.startswith(EXTENSION + ".") for p in paths):
                offenders.setdefault(name, []).append(node.lineno)
    assert not offenders, f"vattention._C imported (module: lines): {offenders}"


def test_integrations_and_tooling_use_only_public_names():
    modules = _modules()
    names = set(modules) | {EXTENSION}
    defined = {m: private_definitions(tree) for m, (_, tree) in modules.items()}
    offenders = {}
    for name, (path, tree) in sorted(modules.items()):
        if is_api_user(name):
            uses = private_uses(tree, name, path.name == "__init__.py", names, defined)
            if uses:
                offenders[name] = uses
    assert not offenders, f"private names of other vattention modules used: {offenders}"
