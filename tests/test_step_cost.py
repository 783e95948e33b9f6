"""What a step() that maps nothing costs, counted rather than timed, through the CUDA driver
EMULATION's per-entry-point counters: no driver call, no context query or switch, no event, and
no look-up of the caller's torch stream (nothing is ordered on it). The prefetch thread binds
itself to the device once, not per job, and its own calls then make no context query.

Counts are what a shared machine can check repeatably; what they cost on a GPU is the GPU
check's to measure (docs/benchmarks.md, docs/gpu.md).
"""

from __future__ import annotations

import pytest
import torch

from support.cuda_testing import make, needs_emulation

pytestmark = needs_emulation

CONTEXT_CALLS = ("cuCtxGetCurrent", "cuCtxSetCurrent", "cuCtxPushCurrent", "cuCtxPopCurrent")
EVENT_CALLS = ("cuEventCreate", "cuEventRecord", "cuEventQuery", "cuEventSynchronize")


def calls(emu) -> dict[str, int]:
    return {n: emu.counter(n) for n in ("all_calls", *CONTEXT_CALLS, *EVENT_CALLS)}


class _Stream:
    def __init__(self, handle):
        self.cuda_stream = handle


@pytest.fixture
def stream_lookups(monkeypatch):
    """Counts the caller's-stream look-ups vattention.streams makes (CI's torch is a CPU build:
    torch.cuda is made to look initialised, its current stream the legacy one)."""
    seen = []

    def current_stream(device=None):
        seen.append(device)
        return _Stream(0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    return seen


@pytest.mark.parametrize("layout", ["layer", "mega"])
def test_a_step_that_maps_nothing_makes_no_driver_call(emu, layout):
    with make(layout, max_batch_size=8) as cache:
        lens = {cache.alloc(): 100 + 10 * i for i in range(8)}
        cache.step(lens)
        cache.prefetch(lens)  # the prefetch thread exists, idle
        cache.wait()
        before, stats = calls(emu), cache.stats()
        for _ in range(100):
            cache.step(lens)
        cache.step([lens.get(s, 0) for s in range(8)])  # a list takes the same path
        assert calls(emu) == before
        after = cache.stats()
        assert after["steps"] - stats["steps"] == 101
        assert after["step_driver_calls"] == stats["step_driver_calls"]


def test_a_step_that_maps_nothing_never_looks_up_the_callers_stream(emu, stream_lookups):
    with make(scrub=True) as cache:
        slot = cache.alloc()
        del stream_lookups[:]
        cache.step({slot: 100})  # maps (and zeroes: ordered on the caller's stream)
        assert len(stream_lookups) == 1
        for _ in range(10):
            cache.step({slot: 101})
        assert len(stream_lookups) == 1
        cache.step({slot: 101}, stream=0)  # a stream given is taken as given
        assert len(stream_lookups) == 1


def test_a_step_that_maps_looks_up_the_callers_stream_once(emu, stream_lookups):
    with make(scrub=True) as cache:
        slot = cache.alloc()
        tpp = cache.config.tokens_per_page
        del stream_lookups[:]
        cache.step({slot: 4 * tpp})
        assert stream_lookups == [torch.device("cuda:0")]


def test_the_prefetch_thread_binds_itself_once_and_then_asks_no_context(emu):
    with make(lookahead_tokens=0) as cache:
        slot = cache.alloc()
        tpp = cache.config.tokens_per_page
        cache.step({slot: 1})
        binds = emu.counter("cuThreadExchangeStreamCaptureMode")
        for k in range(2, 6):  # a job per call: each maps one page index more
            cache.prefetch({slot: k * tpp})
            cache.wait()
        assert cache.stats()["prefetch_map_calls"] > 0
        assert emu.counter("cuThreadExchangeStreamCaptureMode") - binds == 1
        contexts = {n: emu.counter(n) for n in CONTEXT_CALLS}
        cache.prefetch({slot: 8 * tpp})
        cache.wait()
        assert cache.mapped_tokens(slot) >= 8 * tpp
        assert {n: emu.counter(n) for n in CONTEXT_CALLS} == contexts
