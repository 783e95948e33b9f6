"""The C++ micro-benchmarks in benchmarks/ build with the command their header gives (compiled
here, run only where the CPU has the instructions they time: docs/benchmarks.md quotes their
figures from the SPR machine)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "benchmarks").glob("*.cpp"))


def build_line(source: Path) -> list[str]:
    """The header's `g++ ... -o ...` line, as arguments."""
    for line in source.read_text().splitlines():
        m = re.match(r"//\s+(g\+\+ .*)$", line)
        if m:
            return shlex.split(m.group(1))
    raise AssertionError(f"{source.name}: no `//   g++ ...` build line in its header")


def test_every_cpp_benchmark_is_found():
    assert {s.name for s in SOURCES} >= {"vector_issue_rates.cpp", "amx_tile_rows.cpp"}


@pytest.mark.parametrize("source", SOURCES, ids=lambda s: s.name)
def test_cpp_benchmark_builds_with_its_own_command(source, tmp_path):
    args = build_line(source)
    assert args[0] == "g++" and "-o" in args, args
    out = args.index("-o")
    args[out + 1] = str(tmp_path / "bench")  # the header's /tmp path, kept out of the way
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "bench").exists()
