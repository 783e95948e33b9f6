"""Timing helpers shared by the benchmarks: interleaved repeats, median of per-call times."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, Tuple


def per_call_seconds(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def compare(
    candidates: Dict[str, Callable[[], object]], *, calls: int, repeats: int = 7
) -> Dict[str, float]:
    """Median per-call seconds of each candidate, measured in interleaved rounds so that machine
    noise (other processes, frequency changes) hits every candidate alike."""
    for fn in candidates.values():
        fn()  # warm up
    samples = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            samples[name].append(per_call_seconds(fn, calls))
    return {name: statistics.median(s) for name, s in samples.items()}


def compare_min_median(
    candidates: Dict[str, Callable[[], object]], *, calls: int, rounds: int = 6
) -> Dict[str, Tuple[float, float]]:
    """(min, median) per-call seconds of each candidate over interleaved rounds.

    Each candidate is called once to warm up; then every round times each candidate (`calls`
    calls per sample), in the listed order on even rounds and reversed on odd ones (A B B A ...),
    so drift and noise hit every candidate alike."""
    for fn in candidates.values():
        fn()  # warm up
    names = list(candidates)
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            samples[name].append(per_call_seconds(candidates[name], calls))
    return {name: (min(s), statistics.median(s)) for name, s in samples.items()}
