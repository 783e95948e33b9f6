"""benchmarks/bench_attention_call.py on a short run: both settings timed for every candidate
(vLLM's CPU path too, in the vLLM venv), the outputs compared first, bad arguments refused."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from support.vllm_harness import ROOT, VLLM_PYTHON

SCRIPT = ROOT / "benchmarks" / "bench_attention_call.py"
SHORT = ("--rounds", "2", "--calls", "3", "--rows", "4", "--past", "20")


def run(python, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )


def rows(stdout: str):
    return re.findall(r"^\| (hot|evicted) \| (.*) \|$", stdout, re.M)


def test_both_settings_for_our_three_calls():
    done = run(sys.executable, *SHORT, "--dtype", "float32", "--heads", "4", "--kv-heads", "2")
    assert done.returncode == 0, done.stderr
    assert "vLLM's path not run" in done.stdout or "vLLM's write" in done.stdout
    table = rows(done.stdout)
    assert [setting for setting, _ in table] == ["hot", "evicted"], done.stdout
    for _, cells in table:
        values = [float(x) for x in re.findall(r"(?<![(\w])\d+\.\d+", cells)]
        assert all(v > 0 for v in values), cells
    assert "| CpuAttentionPlan us | cpu_attention us | native entry us |" in done.stdout


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv (.venv-vllm) built")
def test_vllm_path_beside_ours_with_the_same_output():
    done = run(VLLM_PYTHON, *SHORT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "vLLM's write + attention ops us" in done.stdout
    assert "vLLM's write + attention ops / plan" in done.stdout
    assert len(rows(done.stdout)) == 2


@pytest.mark.parametrize(
    "args, message",
    [(("--rows", "0"), "--rows must be >= 1"), (("--heads", "6"), "a multiple of --kv-heads")],
)
def test_bad_arguments_are_refused(args, message):
    done = run(sys.executable, *args)
    assert done.returncode == 2 and message in done.stderr
