"""benchmarks/bench_attention_replay.py: a recorded bf16 workload replayed through both kernels
(vLLM's op at the ISA its CPU backend picks), our K/V in caches of a given page size, and the
arguments it refuses."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vattention.bench.vllm_bench import named_model

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_attention_replay.py"
VLLM_PYTHON = Path(os.environ.get("VATTENTION_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def run(python, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), str(SCRIPT), *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv (.venv-vllm) built")
def test_a_bf16_recording_replays_against_the_isa_stock_picks(tmp_path):
    doc = {
        "workload": "hand-written",
        "model_size": "gqa2-bf16",
        "model": [2, 256, 4, 2, 64],  # layers, hidden, heads, KV heads, d
        "dtype": "bfloat16",
        "calls": [
            {"qlens": [1, 1], "past": [300, 129]},
            {"qlens": [1, 1, 1], "past": [301, 130, 7]},
            {"qlens": [40, 1], "past": [0, 302]},
        ],
    }
    calls = tmp_path / "calls.json"
    calls.write_text(json.dumps(doc))
    isa_code = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); "
        "from bench_attention import vllm_isa; print(vllm_isa(torch.bfloat16, 64))"
    )
    isa = subprocess.run(
        [str(VLLM_PYTHON), "-c", isa_code, str(ROOT / "benchmarks")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert isa.returncode == 0, isa.stderr
    done = run(VLLM_PYTHON, "replay", str(calls), "--rounds", "2", "--layout", "layer:64KB")
    assert done.returncode == 0, done.stderr
    assert f"bfloat16): vLLM's op with isa={isa.stdout.strip()!r}; 3 calls x 2 layers" in (
        done.stdout
    ), done.stdout
    rows = re.findall(
        r"^\| (decode rows only|with a prefill chunk) \| (\d+) \| layer:64KB \| (\d+) \((\d+)\) "
        r"\| (\d+) \((\d+)\) \| ([\d.]+) \|",
        done.stdout,
        re.M,
    )
    assert [(r[0], r[1]) for r in rows] == [
        ("decode rows only", "2"),
        ("with a prefill chunk", "1"),
    ], done.stdout


def load_script():
    spec = importlib.util.spec_from_file_location("bench_attention_replay", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_refuses_unknown_models_and_takes_layouts_with_page_sizes():
    replay = load_script()
    with pytest.raises(ValueError, match="model 'llama-7b' is neither a size .*'gqa4-bf16'"):
        named_model("llama-7b")
    assert [replay.layout_arg(v) for v in ("plain", "mega", "layer:64KB")] == [
        "plain",
        "mega",
        "layer:64KB",
    ]
    for bad in ("paged", "plain:64KB", "layer:lots"):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(bad))):
            replay.layout_arg(bad)
    assert replay.split_layout("layer:64KB") == ("layer", "64KB")
    assert replay.split_layout("mega") == ("mega", "2MB")


def test_the_command_line_refuses_them(tmp_path):
    out = str(tmp_path / "calls.json")
    model = run(sys.executable, "capture", "long-context", "llama-7b", out)
    assert model.returncode == 2 and "model 'llama-7b' is neither a size" in model.stderr
    workload = run(sys.executable, "capture", "chat", "small", out)
    assert workload.returncode == 2 and "workload 'chat' is not one of" in workload.stderr
    layout = run(sys.executable, "replay", out, "--layout", "layer:lots")
    assert layout.returncode == 2 and "'layer:lots'" in layout.stderr, layout.stderr
    once = run(sys.executable, "replay", out, "--rounds", "1")  # refused before reading `out`
    assert once.returncode == 2 and "--rounds 1 must be >= 2" in once.stderr, once.stderr
