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
