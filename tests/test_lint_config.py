"""The lint tools' configuration agrees with what it describes.

* vattention/_C.pyi, the compiled core's types for mypy, names what the built extension defines:
  its classes, functions, methods and properties, with their parameters. A binding added, removed
  or renamed in csrc/python/ without regenerating the stub fails here (the command is in the
  stub's header).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
STUB = ROOT / "vattention" / "_C.pyi"


def _api(source: str) -> Dict[str, List[Tuple[str, ...]]]:
    """Each function, method and property of a stub: qualified name -> parameter names (one
    entry per overload). Types, defaults, imports and formatting are left out: they depend on
    the pybind11 and mypy versions that wrote the stub."""
    api: Dict[str, List[Tuple[str, ...]]] = {}

    def visit(body: list, prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                api.setdefault(prefix + node.name, [])
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.FunctionDef):
                args = node.args
                names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
                names += [f"*{a.arg}" for a in (args.vararg, args.kwarg) if a is not None]
                api.setdefault(prefix + node.name, []).append(tuple(names))

    visit(ast.parse(source).body, "")
    return api


def test_the_core_stub_names_what_the_extension_defines(tmp_path):
    stubgen = pytest.importorskip("mypy.stubgen", reason="needs mypy (make test-deps)")
    pytest.importorskip("vattention._C", reason="needs the built extension")
    options = stubgen.parse_options(["-m", "vattention._C", "-o", str(tmp_path), "--quiet"])
    stubgen.generate_stubs(options)
    fresh = _api((tmp_path / "vattention" / "_C.pyi").read_text())
    committed = _api(STUB.read_text())
    missing = sorted(set(fresh) - set(committed))
    stale = sorted(set(committed) - set(fresh))
    changed = sorted(n for n in set(fresh) & set(committed) if fresh[n] != committed[n])
    assert not (missing or stale or changed), (
        f"vattention/_C.pyi is out of date (missing {missing}, no longer defined {stale}, "
        f"other parameters {changed}); regenerate it as its header says"
    )
