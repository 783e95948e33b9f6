"""benchmarks/bench_attention_accuracy.py: its error measure (doctests), the arguments it refuses,
and a small table in the vLLM venv with the three kernels on the same calls."""

from __future__ import annotations

import doctest
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.vllm_harness import MISSING, VLLM_PYTHON

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention_accuracy.py"
CELL = r"([\d.]+)%, ([\d.]+), ([\d.]+)"


def load_module():
    saved = list(sys.path)  # the script puts benchmarks/ on the path, for bench_attention
    try:
        spec = importlib.util.spec_from_file_location("bench_attention_accuracy", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = saved


def test_the_error_measure_in_ulps():
    result = doctest.testmod(load_module())
    assert result.attempted >= 4 and result.failed == 0


@pytest.mark.parametrize(
    "option, value, why",
    [
        ("--prefill", "8,2,64,128", "HEADS,KV_HEADS,D,CHUNK,PAST (5 integers)"),
        ("--prefill", "8,2,x,128,0", "(5 integers)"),
        ("--prefill", "8,3,64,128,0", "HEADS must be a multiple of KV_HEADS"),
        ("--prefill", "8,2,64,100,0", "CHUNK + PAST must be a multiple of 128"),
        ("--prefill", "8,2,0,128,0", "D must be >= 1"),
        ("--decode", "8,2,64,4,100", "TOKENS must be a multiple of 128"),
        ("--decode", "8,2,64,0,128", "ROWS must be >= 1"),
        ("--threads", "0", "must be a whole number >= 1"),
        ("--threads", "two", "must be a whole number >= 1"),
    ],
)
def test_a_bad_argument_is_refused_with_its_reason(option, value, why, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_module().main([option, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and why in err and value in err, err


def test_three_kernels_on_the_same_calls_and_the_kernels_bf16_output_correctly_rounded():
    assert VLLM_PYTHON.exists(), MISSING
    prefill = [("8", "2", "64", "128", "128"), ("4", "4", "128", "256", "0")]
    decode = [("8", "2", "64", "3", "256")]
    args = [str(VLLM_PYTHON), str(SCRIPT), "--threads", "1"]
    for shape in prefill:
        args += ["--prefill", ",".join(shape)]
    for shape in decode:
        args += ["--decode", ",".join(shape)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    three = rf"{CELL} \| {CELL} \| {CELL}"  # the kernel's, vLLM's op's and SDPA's cells
    rows = re.findall(
        rf"^\| (float32|bfloat16) \| (\d+) / (\d+) x (\d+) \| (\d+) \| (\d+) \| {three} \|$",
        done.stdout,
        re.M,
    )
    rows += re.findall(
        rf"^\| (float32|bfloat16) \| (\d+) / (\d+) x (\d+) \| (\d+) x (\d+) \| {three} \|$",
        done.stdout,
        re.M,
    )
    dtypes = ("float32", "bfloat16")
    assert [r[:6] for r in rows] == [(dt, *s) for dt in dtypes for s in prefill] + [
        (dt, *s) for dt in dtypes for s in decode
    ], done.stdout
    for row in rows:
        cells = [tuple(float(x) for x in row[6 + 3 * i : 9 + 3 * i]) for i in range(3)]
        for share, mean, largest in cells:  # kernel, vLLM's op, SDPA
            assert 0 <= share <= 100 and mean >= 0 and largest >= 0
        if row[0] == "bfloat16":
            # The kernel's arithmetic is fp32 throughout (its probabilities too, in two bf16 terms
            # on the amx variant): its errors before the output's rounding are some 2^-19 of the
            # result's scale, far below half a bf16 ulp (2^-9), so nearly every element is the
            # exact result correctly rounded (99.5-99.6% on bench_attention's rows). With each
            # probability rounded to bf16 once, as vLLM's op and torch SDPA do, 57-60%.
            share, mean, largest = cells[0]
            assert share >= 95 and mean <= 0.5 and largest <= 1, (row, done.stdout)
