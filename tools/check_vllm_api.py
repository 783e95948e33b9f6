#!/usr/bin/env python3
"""Check that the vLLM symbols the vattention plugin touches exist, with compatible signatures.

Reads vLLM's *sources* (never imports them), so it runs where a vLLM version cannot be
installed (no CPU build): give it a wheel (``vllm-X-*.whl``), an unpacked wheel or a source
checkout (a folder holding ``vllm/``), or the ``vllm`` package folder itself::

    python tools/check_vllm_api.py .venv-vllm/lib/python3.11/site-packages/vllm
    python tools/check_vllm_api.py vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl

Prints one line per manifest entry (``OK``, ``MISSING`` or ``CHANGED`` with the expected and the
found parameters) and exits 1 if any entry failed, 2 on a usage error. The symbols are listed in
``tools/vllm_api_manifest.py`` (``--manifest`` to use another file); each entry is
``(kind, module, name[, params])``:

``class``      a class ``name`` defined (or imported) in ``module``
``function``   a module-level function; ``params`` checked as below
``method``     ``Class.method``, looked up through the class's bases; ``params`` checked
``attribute``  ``Class.attr``: a class-body name (field, property, method, enum member) or a
               ``self.attr = ...`` in any method, through the bases
``name``       a module-level name: assigned, defined, imported, re-exported by ``import *``,
               or served by a module ``__getattr__`` that names it in a string
``literal``    a string constant ``name`` appears in ``module`` (env var names, entry points)
``assigned``   an attribute ``name`` that some ``x.name = ...`` in ``module`` sets (attributes a
               module function puts on objects, such as a layer's fp8 scales)

``params`` are checked in order: plain names must be the leading positional parameters
(``self``/``cls`` included for methods, omitted for static methods), ``"name="`` only has to
exist (positional or keyword-only) anywhere in the signature.
Stdlib only: ``ast`` and ``zipfile``.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import runpy
import sys
import zipfile
from typing import Dict, List, Optional, Sequence, Tuple

MAX_DEPTH = 8  # base-class / star-import hops followed before giving up


class Source:
    """vLLM's ``.py`` files, read from a wheel or a folder; modules parsed once."""

    def __init__(self, location: str) -> None:
        path = pathlib.Path(location)
        self._zip: Optional[zipfile.ZipFile] = None
        if path.is_file() and zipfile.is_zipfile(path):
            self._zip = zipfile.ZipFile(path)
            self._root = None
        elif (path / "vllm" / "__init__.py").is_file():
            self._root = path
        elif (path / "__init__.py").is_file() and path.name == "vllm":
            self._root = path.parent
        else:
            raise FileNotFoundError(f"{location}: not a vLLM wheel, nor a folder with vllm/")
        self._trees: Dict[str, Optional[ast.Module]] = {}

    def _read(self, rel: str) -> Optional[str]:
        if self._zip is not None:
            try:
                return self._zip.read(rel).decode("utf-8")
            except KeyError:
                return None
        file = self._root / rel
        return file.read_text(encoding="utf-8") if file.is_file() else None

    def module(self, dotted: str) -> Optional[ast.Module]:
        if dotted not in self._trees:
            base = dotted.replace(".", "/")
            text = self._read(base + ".py")
            if text is None:
                text = self._read(base + "/__init__.py")
            self._trees[dotted] = ast.parse(text) if text is not None else None
        return self._trees[dotted]

    def is_package(self, dotted: str) -> bool:
        return self._read(dotted.replace(".", "/") + "/__init__.py") is not None


def _top_statements(body: Sequence[ast.stmt]):
    """Module-level statements, looking inside ``if``/``try``/``with`` (not defs)."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []) or []:
                    inner = child.body if isinstance(child, ast.ExceptHandler) else [child]
                    yield from _top_statements(inner)


def _absolute(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_pkg else 0)
    base = parts[:keep]
    return ".".join(base + ([node.module] if node.module else []))


def _bound_names(node: ast.stmt) -> List[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"]
    return []


class Checker:
    def __init__(self, source: Source) -> None:
        self.src = source

    # ---- module level ----------------------------------------------------------------------
    def find_def(self, module: str, name: str, depth: int = 0) -> Optional[Tuple[str, ast.AST]]:
        """(module, node) binding ``name`` in ``module``: a def/class/assignment, or the
        import it came through, followed to the defining module when it is vLLM's."""
        tree = self.src.module(module)
        if tree is None or depth > MAX_DEPTH:
            return None
        is_pkg = self.src.is_package(module)
        found = None
        for node in _top_statements(tree.body):
            if name in _bound_names(node):
                found = node
        if isinstance(found, ast.ImportFrom):
            origin = _absolute(module, is_pkg, found)
            alias = next(a for a in found.names if (a.asname or a.name) == name)
            if origin.startswith("vllm"):
                sub = f"{origin}.{alias.name}"
                if self.src.module(sub) is not None:  # "from pkg import submodule"
                    return sub, self.src.module(sub)
                return self.find_def(origin, alias.name, depth + 1) or (module, found)
        if found is not None:
            return module, found
        for node in _top_statements(tree.body):  # from .x import *
            if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
                origin = _absolute(module, is_pkg, node)
                hit = self.find_def(origin, name, depth + 1)
                if hit is not None:
                    return hit
        for node in tree.body:  # def __getattr__(name): "name"
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                if any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(node)):
                    return module, node
        return None

    # ---- classes -----------------------------------------------------------------------------
    def find_member(
        self, module: str, cls_name: str, member: str, want_attr: bool, depth: int = 0
    ) -> Optional[ast.AST]:
        hit = self.find_def(module, cls_name)
        if hit is None or not isinstance(hit[1], ast.ClassDef) or depth > MAX_DEPTH:
            return None
        mod, cls = hit
        defs = [
            n
            for n in cls.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == member
        ]
        real = [d for d in defs if not any(_name_of(x) == "overload" for x in d.decorator_list)]
        if defs:
            return (real or defs)[-1]
        if want_attr:
            for node in cls.body:
                if member in _bound_names(node):
                    return node
            for fn in ast.walk(cls):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.args.args:
                    me = fn.args.args[0].arg
                    for n in ast.walk(fn):
                        if (
                            isinstance(n, ast.Attribute)
                            and n.attr == member
                            and isinstance(n.ctx, ast.Store)
                            and isinstance(n.value, ast.Name)
                            and n.value.id == me
                        ):
                            return n
        for base in cls.bases:
            if isinstance(base, ast.Subscript):  # Generic[T], Base[M]
                base = base.value
            if isinstance(base, ast.Name):
                found = self.find_member(mod, base.id, member, want_attr, depth + 1)
                if found is not None:
                    return found
        return None


def _name_of(expr: ast.AST) -> str:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return ""


def _params(fn: ast.AST) -> Tuple[List[str], List[str]]:
    """(positional parameter names, keyword-only names) of a def."""
    args = fn.args
    return [a.arg for a in args.posonlyargs + args.args], [a.arg for a in args.kwonlyargs]


def check_params(fn: ast.AST, expected: Sequence[str]) -> Optional[str]:
    """None if ``fn``'s signature satisfies ``expected``, else what was found."""
    positional, kwonly = _params(fn)
    leading = [p for p in expected if not p.endswith("=")]
    anywhere = [p[:-1] for p in expected if p.endswith("=")]
    ok = positional[: len(leading)] == leading and all(
        p in positional or p in kwonly for p in anywhere
    )
    if ok:
        return None
    shown = positional + [f"*, {k}" if i == 0 else k for i, k in enumerate(kwonly)]
    return f"expected ({', '.join(expected)}) found ({', '.join(shown)})"


def check_entry(checker: Checker, entry: Sequence) -> Tuple[str, str]:
    kind, module, name = entry[0], entry[1], entry[2]
    params = list(entry[3]) if len(entry) > 3 and entry[3] is not None else None
    label = f"{kind:9s} {module}:{name}" + (f"({', '.join(params)})" if params else "")
    if kind == "literal":
        tree = checker.src.module(module)
        hit = tree is not None and any(
            isinstance(n, ast.Constant) and n.value == name for n in ast.walk(tree)
        )
        return ("OK" if hit else "MISSING"), label
    if kind == "assigned":
        tree = checker.src.module(module)
        hit = tree is not None and any(
            isinstance(n, ast.Attribute) and n.attr == name and isinstance(n.ctx, ast.Store)
            for n in ast.walk(tree)
        )
        return ("OK" if hit else "MISSING"), label
    if kind in ("class", "function", "name"):
        hit = checker.find_def(module, name)
        node = hit[1] if hit else None
        if node is None:
            return "MISSING", label
        if kind == "class" and not isinstance(node, ast.ClassDef):
            return "CHANGED", f"{label}: not a class"
        if kind == "function":
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return "CHANGED", f"{label}: not a function"
            problem = check_params(node, params or [])
            if problem:
                return "CHANGED", f"{label}: {problem}"
        return "OK", label
    if kind in ("method", "attribute"):
        cls_name, _, member = name.partition(".")
        if checker.find_def(module, cls_name) is None:
            return "MISSING", f"{label}: no class {cls_name}"
        node = checker.find_member(module, cls_name, member, want_attr=(kind == "attribute"))
        if node is None:
            return "MISSING", label
        if kind == "method":
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return "CHANGED", f"{label}: not a method"
            problem = check_params(node, params or [])
            if problem:
                return "CHANGED", f"{label}: {problem}"
        return "OK", label
    raise ValueError(f"unknown manifest kind {kind!r} in {entry!r}")


def load_manifest(path: pathlib.Path) -> List[Sequence]:
    entries = runpy.run_path(str(path)).get("MANIFEST")
    if not isinstance(entries, (list, tuple)):
        raise ValueError(f"{path} defines no MANIFEST list")
    return list(entries)


def run(location: str, manifest: List[Sequence], out=sys.stdout) -> int:
    """Check every manifest entry against the vLLM at ``location``; return the failure count."""
    checker = Checker(Source(location))
    failures = 0
    for entry in manifest:
        status, label = check_entry(checker, entry)
        failures += status != "OK"
        print(f"{status:8s} {label}", file=out)
    print(f"{len(manifest) - failures} OK, {failures} failed ({location})", file=out)
    return failures


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vllm", help="a vLLM wheel, a folder holding vllm/, or the vllm folder")
    parser.add_argument(
        "--manifest",
        default=str(pathlib.Path(__file__).with_name("vllm_api_manifest.py")),
        help="Python file defining MANIFEST (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        manifest = load_manifest(pathlib.Path(args.manifest))
        return 1 if run(args.vllm, manifest) else 0
    except (FileNotFoundError, ValueError) as e:
        print(f"check_vllm_api: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
