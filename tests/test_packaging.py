"""What `make demo` installs, and what the wheel ships."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_installs_only_what_the_demo_needs(tmp_path):
    # Dry run against a virtual env that does not exist: every install command is printed.
    venv = str(tmp_path / "venv")
    proc = subprocess.run(
        ["make", "-n", "demo", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    installs = [
        line.replace(venv, "VENV") for line in proc.stdout.splitlines() if "pip install" in line
    ]
    assert installs, proc.stdout
    for tool in ("pytest", "hypothesis", "transformers", "matplotlib"):
        assert not any(re.search(rf"\b{tool}\b", line) for line in installs), (tool, installs)
    assert any("torch" in line for line in installs) and any("numpy" in line for line in installs)


def test_test_target_installs_the_test_tools(tmp_path):
    proc = subprocess.run(
        ["make", "-n", "test-deps", f"VENV={tmp_path / 'venv'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"pip install .*pytest.*hypothesis.*transformers", proc.stdout), proc.stdout


def test_wheel_ships_the_licence_of_the_bundled_traces(tmp_path):
    # build_py copies exactly the Python files and package data a wheel contains. It runs on a
    # copy of the tracked sources: a checkout's *.egg-info/SOURCES.txt can add files by itself.
    files = subprocess.run(
        ["git", "ls-files", "vattention", "csrc", "setup.py", "pyproject.toml", "README.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    src = tmp_path / "src"
    for name in files:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path / "out")],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = tmp_path / "out" / "vattention" / "bench" / "data"
    source = ROOT / "vattention" / "bench" / "data"
    assert (data / "README.md").read_text() == (source / "README.md").read_text()
    assert sorted(p.name for p in data.glob("*.csv")) == sorted(
        p.name for p in source.glob("*.csv")
    )


def test_wheel_lists_every_package_of_the_source_tree():
    # pyproject.toml names the packages explicitly: a new folder with an __init__.py (such as
    # vattention/attention/) that is not listed would be missing from the wheel.
    block = re.search(
        r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.MULTILINE | re.DOTALL
    )
    listed = set(re.findall(r'"([^"]+)"', block.group(1)))
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "vattention").rglob("__init__.py")
    }
    assert found == listed, (sorted(found - listed), sorted(listed - found))
