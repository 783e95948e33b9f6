"""Timing helpers shared by the benchmarks: interleaved repeats, median of per-call times."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict


def per_call_seconds(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def compare(candidates: Dict[str, Callable[[], object]], *, calls: int,
            repeats: int = 7) -> Dict[str, float]:
    """Median per-call seconds of each candidate, measured in interleaved rounds so that machine
    noise (other processes, frequency changes) hits every candidate alike."""
    for fn in candidates.values():
        fn()  # warm up
    samples = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            samples[name].append(per_call_seconds(fn, calls))
    return {name: statistics.median(s) for name, s in samples.items()}
