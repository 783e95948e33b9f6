"""Every command prints its own usage, and the documented examples run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import vattention.__main__
import vattention.bench.cli

ROOT = Path(__file__).resolve().parent.parent


def _run(args, cwd=None, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env=env,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "args,usage",
    [
        (["bench", "--help"], "usage: python -m vattention bench [-h] {memory,vllm,elastic}"),
        (["bench", "memory", "--help"], "usage: python -m vattention bench memory [-h]"),
        (["bench", "vllm", "--help"], "usage: python -m vattention bench vllm [-h]"),
        (["demo", "--help"], "usage: python -m vattention demo [-h]"),
        (["info", "--help"], "usage: python -m vattention info [-h]"),
        (["pool", "--help"], "usage: python -m vattention pool [-h]"),
        (["--help"], "usage: python -m vattention [-h] {info,demo,bench,pool}"),
    ],
)
def test_each_command_prints_its_own_usage(args, usage, capsys):
    # In this process (a fresh interpreter per command costs a torch import each); the module
    # entry point itself runs in the test below.
    with pytest.raises(SystemExit) as exit_:
        vattention.__main__.main(args)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(usage), out[:300]


def test_python_dash_m_runs_the_command_line():
    proc = _run(["vattention", "--help"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m vattention [-h] {info,demo,bench,pool}")


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        vattention.__main__.main(["bogus"])
    assert exit_.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


def test_bench_cli_docstring_example_runs(tmp_path):
    doc = vattention.bench.cli.__doc__
    command = re.search(r"runs on its own.*?``python -m ([^`]+)``", doc, re.S).group(1).split()
    proc = _run(command, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "allocators failed" not in proc.stderr, proc.stderr[-2000:]
    assert "| vattention-mega-64KB |" in proc.stdout
