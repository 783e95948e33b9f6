"""benchmarks/bench_vllm_breakdown.py's argument checks (its engines need vLLM: by hand)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_vllm_breakdown.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_vllm_breakdown", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, named",
    [
        (["both", "long-context", "small", "--rounds", "0"], "--rounds 0"),
        (["plugin", "long-context", "small", "--passes", "0"], "--passes 0"),
        (["stock", "sharegpt", "small", "--num-requests", "0"], "--num-requests 0"),
        (["both", "chat", "small"], "invalid choice: 'chat'"),
        (["both", "sharegpt", "llama-7b"], "invalid choice: 'llama-7b'"),
        (["all", "sharegpt", "small"], "invalid choice: 'all'"),
    ],
)
def test_refuses_bad_arguments_before_starting_an_engine(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_script().main(argv)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


def answers(rounds_tokens):
    """One engine's answers: per pass its round and, per request, one completion's tokens."""
    return [{"round": r, "tokens": [[t] for t in tokens]} for r, tokens in rounds_tokens]


def test_tokens_line_names_the_first_difference_and_fails_fp32_only():
    tokens_line = load_script().tokens_line
    stock = answers([(0, [[1, 2], [3, 4]]), (1, [[5, 6], [7, 8]])])
    plugin = answers([(0, [[1, 2], [3, 4]]), (1, [[5, 6], [7, 9]])])
    line, status = tokens_line({"stock": stock, "plugin": plugin}, "small")  # fp32
    assert status == 1
    assert "3 of 4 requests identical; first difference: round 1, request 1, token 1" in line
    assert "float32: a difference fails the run" in line
    line, status = tokens_line({"stock": stock, "plugin": plugin}, "gqa4-bf16")
    assert status == 0 and "bfloat16: reported only" in line
    line, status = tokens_line({"stock": stock, "plugin": stock}, "small")
    assert status == 0 and "4 of 4 requests identical (" in line
    assert "generated tokens per pass: stock [4], plugin [4]" in line
