"""Work in flight on the emulated GPU meets the cache: the emulated analogues of two GPU checks
(`make gpu-check`'s "streams" and "graphs" parts; tests/gpu/ has the GPU versions).

- A "kernel" still reading a slot's rows on a non-blocking stream when the slot is freed on that
  stream: the pages are unmapped only once it completed (zero rule violations), whether reclaim()
  or another slot's step() under a tight budget takes them.
- A capture begun in the default GLOBAL mode on one thread while the prefetch thread maps pages:
  the capture must survive (the driver forbids VMM calls of other threads in GLOBAL mode unless
  they make them in a mode that allows them).

Pages are the emulation's suite granularity (64 KB, or a GPU's 2 MB in the GPU check's emulated
run), so these run in both.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import vattention

from support.cuda_testing import E, make, needs_emulation

pytestmark = needs_emulation

# 4 pages a row and tensor (make(): 2 KV heads x 64 fp16, 256 bytes a token), at either page size.
TOKENS = 4 * E.SUITE_GRANULARITY // 256


def _row_range(cache: vattention.KVCache, slot: int, tokens: int) -> tuple[int, int]:
    """(address, bytes) of the first ``tokens`` positions of ``slot`` in layer 0's K."""
    k, _ = cache.host_alias(0)
    return k.data_ptr() + slot * k.stride(0) * k.element_size(), tokens * k.stride(1) * 2


@pytest.mark.parametrize("take", ["reclaim", "budget"])
def test_a_kernel_in_flight_on_a_nonblocking_stream_outlives_its_slots_free(emu, engine, take):
    page = E.SUITE_GRANULARITY
    probe = make(page_size=page, max_batch_size=2, max_seq_len=TOKENS)
    pages = probe.config.pages_for_tokens(TOKENS)
    probe.close()
    # "budget": room for one slot's pages only, so the second slot's step() must take the first's.
    budget = pages * page if take == "budget" else None
    cache = make(page_size=page, max_batch_size=2, max_seq_len=TOKENS, memory_budget=budget)
    side = emu.stream_create(nonblocking=True)
    try:
        # b is taken first: alloc() would hand a's row, pages and all, to a new request.
        a, b = cache.alloc(), cache.alloc()
        cache.step({a: TOKENS})
        k, v = cache.host_alias(0)
        assert v is not None
        k[a].normal_()
        v[a].normal_()
        want = (k[a].clone(), v[a].clone())
        unit = emu.launch(side, *_row_range(cache, a, TOKENS), held=True)  # reads a's rows
        cache.free(a, stream=side)
        seen: dict[str, bool] = {}

        def kernel_ends() -> None:  # the rows must still hold the data while it runs
            time.sleep(0.2)
            seen["intact"] = torch.equal(k[a], want[0]) and torch.equal(v[a], want[1])
            emu.complete(unit)

        ender = threading.Thread(target=kernel_ends)
        ender.start()
        t0 = time.monotonic()
        if take == "reclaim":
            assert cache.reclaim() == pages
        else:
            cache.step({b: TOKENS})  # takes a's pages, after the fence
        waited = time.monotonic() - t0
        ender.join()
        assert seen == {"intact": True}
        assert emu.violations == 0, emu.last_violation()
        assert waited >= 0.15, f"the pages went after {waited:.3f} s, before the kernel ended"
        assert cache.stats()["fence_waits"] == 1
    finally:
        cache.close()
        assert emu.stream_destroy(side) == E.CUDA_SUCCESS


@pytest.mark.checks_own_cleanup  # on failure the violation is the finding; cleaned up below
def test_a_global_capture_beside_the_prefetch_thread_is_not_invalidated(emu, engine):
    cache = make(page_size=E.SUITE_GRANULARITY, max_batch_size=4, max_seq_len=TOKENS)
    stream = emu.stream_create(nonblocking=True)
    capturing = False
    try:
        slots = [cache.alloc() for _ in range(4)]
        cache.step({s: 1 for s in slots})
        emu.gate("cuMemMap")  # the prefetch thread's first map waits here ...
        cache.prefetch({s: TOKENS for s in slots}, lookahead_tokens=0)
        try:
            emu.wait_gate_held()
        except AssertionError as e:
            raise RuntimeError(f"setup: {e}") from None
        assert emu.begin_capture(stream, E.CU_STREAM_CAPTURE_MODE_GLOBAL) == E.CUDA_SUCCESS
        capturing = True
        emu.gate_open()  # ... and maps, and grants access, while this thread captures
        error = None
        try:
            cache.wait()
        except vattention.DriverError as e:
            error = e
        rc = emu.end_capture(stream)
        capturing = False
        assert error is None, f"the prefetch thread failed during the capture: {error}"
        assert rc == E.CUDA_SUCCESS, f"cuStreamEndCapture returned {rc} (901: invalidated)"
        assert emu.violations == 0, emu.last_violation()
        assert all(cache.mapped_tokens(s) >= TOKENS for s in slots)
    finally:
        emu.gate_open()
        if capturing:
            emu.end_capture(stream)
        cache.close()
        emu.stream_destroy(stream)
