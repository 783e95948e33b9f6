"""benchmarks/bench_attention.py's batch rows (calls shaped as vLLM's scheduler makes them): our
planned call timed on a small batch, and in the vLLM venv the whole section beside vLLM's write
and attention ops, their outputs compared first."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
import torch

from support.vllm_harness import ROOT, VLLM_PYTHON

SCRIPT = ROOT / "benchmarks" / "bench_attention.py"


def load_script():
    saved = list(sys.path)  # the script puts benchmarks/ on the path, for _timing
    try:
        spec = importlib.util.spec_from_file_location("bench_attention", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_beside_decodes_is_timed(dtype):
    bench = load_script()
    t = bench.measure_batch(dtype, 4, 2, 64, (40, 1, 1), (0, 30, 200), rounds=2, calls=1)
    assert set(t) == {"kernel"} and 0 < t["kernel"][0] <= t["kernel"][1]


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv (.venv-vllm) built")
def test_the_section_beside_vllm_ops():
    done = subprocess.run(
        [str(VLLM_PYTHON), str(SCRIPT), "--skip-decode", "--skip-prefill", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = re.findall(r"^\| (float32|bfloat16) \| .* \| (\d+\.\d+)x \|$", done.stdout, re.M)
    assert len(rows) == 20, done.stdout
    assert {dtype for dtype, _ in rows} == {"float32", "bfloat16"}
    assert all(float(ratio) > 0 for _, ratio in rows)
