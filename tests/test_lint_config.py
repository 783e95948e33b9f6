"""The lint tools' configuration agrees with what it describes.

* .pre-commit-config.yaml runs `make lint`'s checks: the same tools, called from the Makefile's
  virtual env (so at the versions its test-deps line pins, which are those installed here), with
  the same arguments, in the same order.
* vattention/_C.pyi, the compiled core's types for mypy, names what the built extension defines:
  its classes, functions, methods and properties, with their parameters. A binding added, removed
  or renamed in csrc/python/ without regenerating the stub fails here (the command is in the
  stub's header).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
STUB = ROOT / "vattention" / "_C.pyi"
MAKEFILE = ROOT / "Makefile"
PRE_COMMIT = ROOT / ".pre-commit-config.yaml"
LINT_TOOLS = ("ruff", "mypy", "clang-format")


def _pins() -> Dict[str, str]:
    """The lint tools' versions that the Makefile's test-deps line installs."""
    return dict(re.findall(r"\b(ruff|mypy|clang-format)==(\S+)", MAKEFILE.read_text()))


def _lint_commands() -> List[str]:
    """`make lint`'s commands, without the files they are given (`.`, the C++ files)."""
    recipe = re.search(r"^lint:.*\n((?:\t.*\n)+)", MAKEFILE.read_text(), re.MULTILINE)
    assert recipe, "no lint target in the Makefile"
    lines = [line.strip() for line in recipe.group(1).splitlines()]
    return [re.sub(r" (\.|\$\(CPP_FILES\))$", "", line) for line in lines if line[0] != "@"]


def _hooks() -> List[Tuple[str, dict]]:
    yaml = pytest.importorskip("yaml", reason="needs PyYAML (a transformers dependency)")
    config = yaml.safe_load(PRE_COMMIT.read_text())
    return [(repo, hook) for repo in config["repos"] for hook in repo["hooks"]]


def test_the_makefile_pins_every_lint_tool_and_lint_calls_them_all():
    pins = _pins()
    assert sorted(pins) == sorted(LINT_TOOLS), pins
    tools = [cmd.split()[0].rpartition("/")[2] for cmd in _lint_commands()]
    assert tools == ["ruff", "ruff", "mypy", "clang-format"], tools


def test_pre_commit_runs_make_lints_commands_with_its_tools():
    venv = re.search(r"^VENV := (\S+)$", MAKEFILE.read_text(), re.MULTILINE).group(1)
    entries = []
    for repo, hook in _hooks():
        # Local hooks running the venv's tools: their versions are the Makefile's pins. (Hooks
        # from mirror repositories would pin versions of their own: check those here instead.)
        assert repo["repo"] == "local" and hook["language"] == "system", (repo["repo"], hook)
        entry = hook["entry"]
        assert entry.startswith(f"{venv}/bin/"), (entry, f"not run from {venv}/bin/")
        entries.append("$(VENV)/bin/" + entry[len(venv) + len("/bin/") :])
        # mypy checks the package its configuration names, as `make lint` runs it
        assert hook.get("pass_filenames", True) == (hook["id"] != "mypy"), hook
    assert entries == _lint_commands()


def test_the_installed_lint_tools_are_the_pinned_versions():
    # The tools the tests run beside (make test's venv) are those `make lint` runs.
    for tool, version in _pins().items():
        try:
            installed = importlib.metadata.version(tool)
        except importlib.metadata.PackageNotFoundError:
            continue
        assert installed == version, f"{tool} {installed} installed, the Makefile pins {version}"


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
