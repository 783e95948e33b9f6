"""benchmarks/bench_attention_layouts.py on a small shape: both cache layouts timed for a
`--model-size` model (fp32, bench vllm's random Llama), and the arguments it refuses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from vattention.bench.vllm_bench import size_model

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention_layouts.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )


def test_a_model_size_gets_a_row_per_layout():
    done = run(
        "--model-size", "tiny", "--rows", "2", "--tokens", "256", "--threads", "1",
        "--rounds", "2", "--calls", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    p = size_model("tiny")
    shape = rf"{p.num_heads} / {p.num_kv_heads} x {p.head_dim}, float32"
    rows = re.findall(
        rf"^\| tiny \| {shape} \| (mega|layer|vLLM op) \| (\d+) \((\d+)\) \| ([\d.]+|-) \|$",
        done.stdout,
        re.M,
    )
    assert [r[0] for r in rows][:2] == ["mega", "layer"], done.stdout
    assert all(int(r[1]) > 0 and int(r[2]) >= int(r[1]) for r in rows), rows


def test_refuses_a_size_it_does_not_have_a_partial_block_and_one_round():
    bad = run("--model-size", "huge")
    assert bad.returncode == 2 and "invalid choice: 'huge'" in bad.stderr
    part = run("--model-size", "tiny", "--tokens", "200")
    assert part.returncode == 2 and "--tokens 200" in part.stderr
    once = run("--model-size", "tiny", "--rounds", "1")
    assert once.returncode == 2 and "--rounds 1 must be >= 2" in once.stderr
