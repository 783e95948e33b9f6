"""benchmarks/bench_attention_variants.py on small shapes: a row per shape, two variants alternated,
and the arguments it refuses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from vattention.attention import kernel_variants

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention_variants.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )


def test_a_row_per_shape_with_both_variants_timed():
    names = [v.name for v in kernel_variants() if v.runnable]
    if len(names) < 2:
        pytest.skip(f"needs two runnable variants; this CPU runs {names}")
    a, b = names[-2:]  # generic and the one above it: the cheapest pair every x86 CPU has
    done = run(
        a,
        b,
        "--threads",
        "1",
        "--rounds",
        "2",
        "--calls",
        "1",
        "--decode",
        "4,2,64,3,40",
        "8,2,32,2,17",
        "--prefill",
        "4,1,64,20,30",
        "4,4,64,9,0",
    )
    assert done.returncode == 0, done.stderr
    rows = re.findall(
        r"^\| (decode|prefill) \| ([\d,]+) \| ([\d.]+) / [\d.]+ ms \| ([\d.]+) / [\d.]+ ms "
        r"\| \*\*([\d.]+)x\*\* \|$",
        done.stdout,
        re.M,
    )
    assert [(r[0], r[1]) for r in rows] == [
        ("decode", "4,2,64,3,40"),
        ("decode", "8,2,32,2,17"),
        ("prefill", "4,1,64,20,30"),
        ("prefill", "4,4,64,9,0"),
    ], done.stdout
    assert all(float(r[2]) > 0 and float(r[3]) > 0 and float(r[4]) > 0 for r in rows)
    assert (
        f"| {a} / {b} speed |" in done.stdout
        and "min / median" in done.stdout
        and "variants alternated" in done.stdout
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_variant_in_two_tunings_over_layers(dtype):
    done = run(
        "generic:intel",
        "generic:other",
        "--dtype",
        dtype,
        "--layers",
        "3",
        "--threads",
        "1",
        "--rounds",
        "2",
        "--calls",
        "1",
        "--decode",
        "4,2,64,3,40",
        "--prefill",
    )
    assert done.returncode == 0, done.stderr
    assert (
        "generic:intel: generic tuned intel; generic:other: generic tuned other" in done.stdout
    ), done.stdout
    assert f"over 3 layer(s) of {dtype} in 2MB pages" in done.stdout
    assert re.search(
        r"^\| decode \| 4,2,64,3,40 \| [\d.]+ / [\d.]+ ms \| [\d.]+ / [\d.]+ ms "
        r"\| \*\*[\d.]+x\*\* \|$",
        done.stdout,
        re.M,
    ), done.stdout


@pytest.mark.parametrize(
    "args, said",
    [
        (("generic", "generic"), "two different variants"),
        (("generic", "sve"), "'sve' does not run"),
        (("generic:amd", "generic"), "tuning 'amd' of 'generic:amd': intel or other"),
        (("generic", "generic:other", "--layers", "0"), "--layers 0 must be >= 1"),
        (("generic", "generic:other", "--dtype", "float16"), "invalid choice: 'float16'"),
    ],
)
def test_refuses_what_it_cannot_compare(args, said):
    done = run(*args)
    assert done.returncode == 2 and said in done.stderr, done.stderr
