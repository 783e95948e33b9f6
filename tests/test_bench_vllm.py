"""``bench vllm``'s timing loop, with stand-in engines (no vLLM needed): what ``--repetitions``
runs, and the progress it shows while a workload runs."""

from __future__ import annotations

import argparse

import pytest

from vattention.bench import vllm_bench
from vattention.bench.progress import Progress


class FakeEngine:
    """Answers each pass as an engine would: one completion per request, some tokens/s."""

    def __init__(self, name: str) -> None:
        self.name, self.passes = name, 0

    def generate(self, requests):
        self.passes += 1
        return {
            "tokens": [[[1, 2, 3]] for _ in requests],
            "tokens_per_s": 100.0 + self.passes,
        }


def _args(repetitions):
    return argparse.Namespace(
        repetitions=repetitions, num_requests=4, length_scale=0.5, max_model_len=4096, seed=0
    )


@pytest.mark.parametrize("repetitions", [1, 3])
def test_repetitions_n_times_each_engine_2n_passes(repetitions):
    engines = {name: FakeEngine(name) for name in vllm_bench.ENGINES}
    result = vllm_bench.time_workload(
        engines, "long-generation", _args(repetitions), progress=False
    )
    assert {e.name: e.passes for e in engines.values()} == {
        "stock": 2 * repetitions,
        "vattention": 2 * repetitions,
    }
    assert [len(result["rounds"][e]) for e in vllm_bench.ENGINES] == [2 * repetitions] * 2
    assert result["tokens_identical"] and result["identical_requests"] == [16 * 2 * repetitions] * 2


def test_a_progress_bar_per_engine_counts_passes_without_flooding_a_log(capsys):
    """stderr is not a terminal under pytest: plain lines, one at each quarter, per engine."""
    engines = {name: FakeEngine(name) for name in vllm_bench.ENGINES}
    vllm_bench.time_workload(engines, "shared-prefix", _args(2))
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    for engine in vllm_bench.ENGINES:
        label = f"shared-prefix {engine}"
        assert [line.split()[-2:] for line in lines if line.startswith(label)] == [
            ["25%", "(1/4)"],
            ["50%", "(2/4)"],
            ["75%", "(3/4)"],
            ["100%", "(4/4)"],
        ], err
    assert len(lines) == 8


def test_progress_counts_any_unit_and_stays_silent_when_disabled(capsys):
    with Progress(3, "quiet", enabled=False, unit="pass") as bar:
        bar.update(3)
    assert capsys.readouterr().err == ""
    with Progress(2, "passes", unit="pass") as bar:
        bar.update(1)
        bar.update(1)
    assert capsys.readouterr().err.splitlines() == [
        f"{'passes':<24}  50% (1/2)",
        f"{'passes':<24} 100% (2/2)",
    ]
