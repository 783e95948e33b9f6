"""The CUDA backend under the strict driver EMULATION: properties only the emulation can observe.

Leaks (driver objects back to zero), one cuMemSetAccess per contiguous run, typed driver errors,
the per-thread context rule, deferred unmapping waiting for the free() event, configuration and
driver-loading errors, and the hypothesis state machine on this backend. Fault injection lives in
test_cuda_faults.py. Passing these is evidence, not proof, that the backend is right on a GPU.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import initialize
from test_stateful import CacheMachine

import vattention

from support.cuda_testing import PAGE, E, make, needs_emulation, pages_state
from support.helpers import check_pattern, fill_pattern

pytestmark = needs_emulation


def test_layer_needs_cuda_torch_but_host_alias_reads_emulated_memory(emu):
    with make() as cache:
        slot = cache.alloc()
        cache.step({slot: 10})
        with pytest.raises(vattention.BackendUnavailableError, match="cannot wrap"):
            cache.layer(0)
        k, _ = cache.host_alias(0)
        k[slot, :10] = 3.0
        assert float(k[slot, :10].float().sum()) == 3.0 * 10 * 2 * 64
        assert k.data_ptr() == cache.layer_ptrs(0)[0]


@pytest.mark.parametrize("layout", ["layer", "mega"])
def test_everything_is_given_back_after_close(emu, layout):
    cache = make(layout, lookahead_tokens=64)
    cache.reserve(16 * PAGE)
    slots = [cache.alloc() for _ in range(3)]
    cache.step({s: 300 * (i + 1) for i, s in enumerate(slots)})
    cache.prefetch({slots[0]: 1200})
    cache.wait()
    cache.free(slots[1])
    cache.reclaim()
    cache.free(slots[2])
    assert emu.counter("live_mappings") > 0 and emu.counter("live_handles") > 0
    assert emu.counter("context_refs") == 1
    assert emu.counter("live_reservations") == 4 - 2 * (layout == "mega")
    cache.close()
    assert emu.counter("live_mappings") == 0 and emu.counter("live_handles") == 0
    assert emu.counter("live_events") == 0
    del cache  # the reservations and the context go with the last reference
    # (the fixture asserts every counter is back to zero and no rule was violated)


def test_set_access_once_per_contiguous_run(emu):
    with make(max_batch_size=3) as cache:
        cfg = cache.config
        a, b = cache.alloc(), cache.alloc()
        cache.step({a: 5 * cfg.tokens_per_page, b: 1})  # a: 5 pages per tensor in one run
        assert emu.counter("cuMemSetAccess") == 2 * cfg.num_tensors  # (slot, tensor) runs
        assert emu.counter("cuMemMap") == 6 * cfg.num_tensors  # one per page
        cache.step({a: 9 * cfg.tokens_per_page})  # growth: one more run each
        assert emu.counter("cuMemSetAccess") == 3 * cfg.num_tensors
        assert cache.stats()["set_access_calls"] == emu.counter("cuMemSetAccess")


def test_driver_error_carries_call_code_and_emulation_string(emu):
    with make() as cache:
        slot = cache.alloc()
        emu.inject_fault("cuMemMap", 2, E.CUDA_ERROR_INVALID_VALUE)
        with pytest.raises(vattention.DriverError) as info:
            cache.step({slot: 3 * cache.config.tokens_per_page})
        err = info.value
        assert err.call == "cuMemMap" and err.code == E.CUDA_ERROR_INVALID_VALUE
        assert "(CUDA emulation)" in err.error_string
        assert "va=0x" in str(err) and f"bytes={PAGE}" in str(err)


def test_out_of_device_memory_is_out_of_pages_and_changes_nothing(emu):
    with make() as cache:
        cfg = cache.config
        emu.set_device_memory_bytes(6 * PAGE)
        a = cache.alloc()
        cache.step({a: cfg.tokens_per_page})  # 4 pages (2 layers x K/V)
        fill = fill_pattern(cache, a, 0, cfg.tokens_per_page, seed=1)
        before = pages_state(cache)
        with pytest.raises(vattention.OutOfPagesError):
            cache.step({a: 2 * cfg.tokens_per_page})  # needs 4 more: only 2 fit
        assert pages_state(cache) == before
        check_pattern(cache, a, 0, cfg.tokens_per_page, fill)
        assert emu.counter("live_mappings") == 4


# ---- contexts and fences ------------------------------------------------------------------------


def test_threads_without_context_keep_none_after_a_backend_call(emu):
    backend = vattention._C.Backend("cuda:0", PAGE)
    seen = {}

    def worker():
        seen["before"] = emu.thread_has_context()
        va = backend.reserve(4 * PAGE)  # the emulation is strict: this fails unless bound
        backend.release_va(va, 4 * PAGE)
        seen["after"] = emu.thread_has_context()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"before": False, "after": False}
    backend = None  # drop it (worker() shares the variable: `del` reads as F821)


def test_every_call_leaves_the_callers_context_as_it_found_it(emu):
    # torch reads the current device from the thread's current context: a cache on cuda:0 must
    # not move a thread working on cuda:1 (or one with no context yet) to cuda:0.
    emu.set_device_count(2)
    assert emu.lib.cuInit(0) == E.CUDA_SUCCESS  # what torch (or any CUDA user) did first
    ctx1 = emu.retain_primary(1)
    try:
        for before in (ctx1, 0):
            emu.set_current_context(before)
            cache = make(lookahead_tokens=64)
            assert emu.current_context() == before, "the constructor changed the context"
            slot = cache.alloc()
            cache.step({slot: 300})
            cache.prefetch({slot: 600})
            cache.wait()
            cache.stats()
            cache.free(slot)
            cache.reclaim()
            assert emu.current_context() == before, "a call left the cache's context current"
            cache.close()
            del cache
            assert emu.current_context() == before, "close() left the cache's context current"
    finally:
        emu.set_current_context(0)
        emu.release_primary(1)


def test_the_prefetch_thread_does_not_invalidate_a_global_capture(emu):
    # torch.cuda.graph captures in global mode: a VMM call from any thread in global mode fails
    # and invalidates the capture. The prefetch thread maps pages whenever work is queued.
    with make(lookahead_tokens=0) as cache:
        tpp = cache.config.tokens_per_page
        slot = cache.alloc()
        cache.step({slot: 1})
        ctx = emu.retain_primary(0)
        emu.set_current_context(ctx)
        stream = emu.stream_create(nonblocking=True)
        try:
            assert emu.begin_capture(stream, E.CU_STREAM_CAPTURE_MODE_GLOBAL) == E.CUDA_SUCCESS
            cache.prefetch({slot: 8 * tpp})  # the thread maps while this thread captures
            cache.wait()
            assert emu.end_capture(stream) == E.CUDA_SUCCESS, emu.last_violation()
            assert cache.stats()["prefetch_map_calls"] > 0
        finally:
            emu.stream_destroy(stream)
            emu.set_current_context(0)
            emu.release_primary(0)


def test_caches_share_one_retain_of_the_primary_context(emu):
    # Retaining makes the context where nobody holds it (torch has not initialised CUDA): one
    # retain per process, not one per cache.
    retains = emu.counter("cuDevicePrimaryCtxRetain")
    for _ in range(3):
        make().close()
    caches = [make(), make()]
    assert emu.counter("cuDevicePrimaryCtxRetain") - retains == 1
    assert emu.primary_retains(0) == 1
    for cache in caches:
        cache.close()


def test_prefetch_thread_maps_under_strict_context(emu):
    with make(lookahead_tokens=0) as cache:
        cfg = cache.config
        slot = cache.alloc()
        set_current_before = emu.counter("cuCtxSetCurrent")
        cache.prefetch({slot: 4 * cfg.tokens_per_page})
        cache.wait()
        assert cache.stats()["prefetch_map_calls"] == 4 * cfg.num_tensors
        assert emu.counter("cuCtxSetCurrent") > set_current_before  # the thread bound itself
        calls = emu.counter("cuMemMap")
        cache.step({slot: 4 * cfg.tokens_per_page})
        assert emu.counter("cuMemMap") == calls  # step found them mapped


def _reclaim_in_thread(cache):
    result = {}

    def run():
        try:
            result["pages"] = cache.reclaim()
        except Exception as e:  # pragma: no cover - surfaced by the assertion below
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, result


def test_deferred_unmap_waits_for_the_free_event(emu):
    with make() as cache:
        slot = cache.alloc()
        cache.step({slot: 100})
        emu.set_gpu_busy(True)  # the step's kernels are still running
        cache.free(slot)  # event recorded now: pending while busy
        mapped, unmaps = emu.counter("live_mappings"), emu.counter("cuMemUnmap")
        t, result = _reclaim_in_thread(cache)
        time.sleep(0.2)
        assert t.is_alive(), "reclaim returned while the freeing step's work was in flight"
        assert emu.counter("cuMemUnmap") == unmaps and emu.counter("live_mappings") == mapped
        emu.set_gpu_busy(False)  # the GPU finishes
        t.join(5)
        assert result.get("pages") == mapped and emu.counter("live_mappings") == 0
        assert cache.stats()["fence_waits"] == 1


def _pretend_torch_stream(monkeypatch, stream):
    """Makes vattention.streams see ``stream`` as torch's current CUDA stream (CI's torch is a CPU
    build: the emulation's streams are its only CUDA streams)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(stream))


class _Stream:
    def __init__(self, handle):
        self.cuda_stream = handle


def test_a_page_outlives_a_kernel_on_the_callers_stream_when_its_slot_is_freed(
    emu, engine, monkeypatch
):
    # Engines run their models on non-blocking streams (vLLM's worker sets one current), which
    # the legacy default stream does not wait for: free() must fence on the caller's stream.
    stream = emu.stream_create(nonblocking=True)
    _pretend_torch_stream(monkeypatch, stream)
    try:
        with make() as cache:
            slot = cache.alloc()
            cache.step({slot: 100})
            k, _ = cache.host_alias(0)
            row = k[slot, :100]
            kernel = emu.launch(stream, row.data_ptr(), row.numel() * row.element_size())
            cache.free(slot)  # names no stream: torch's current one
            unmaps = emu.counter("cuMemUnmap")
            t, result = _reclaim_in_thread(cache)
            time.sleep(0.2)
            assert t.is_alive(), "the slot's pages were unmapped under a running kernel"
            assert emu.counter("cuMemUnmap") == unmaps
            emu.complete(kernel)
            t.join(5)
            assert result.get("pages", 0) > 0
    finally:
        emu.stream_destroy(stream)


def test_free_inside_torch_compile_fences_on_the_callers_stream(emu, engine, monkeypatch):
    """A cache call made from compiled code looks its stream up at run time: traced, torch's
    current stream is a generic torch.Stream with no driver handle (the first GPU run failed on
    it in transformers' compiled generate()), and a handle read at trace time would be stale."""
    from vattention import streams

    stream = emu.stream_create(nonblocking=True)

    def torch_stream(dev):  # what torch hands eager code, and what dynamo hands traced code
        return torch.Stream() if torch.compiler.is_compiling() else _Stream(stream)

    monkeypatch.setattr(streams, "_torch_stream", torch_stream)
    try:
        with make() as cache:
            slot = cache.alloc()
            cache.step({slot: 100})
            k, _ = cache.host_alias(0)
            row = k[slot, :100]
            kernel = emu.launch(stream, row.data_ptr(), row.numel() * row.element_size())
            torch.compile(lambda: cache.free(slot), backend="eager")()
            unmaps = emu.counter("cuMemUnmap")
            t, result = _reclaim_in_thread(cache)
            time.sleep(0.2)
            assert t.is_alive(), "the slot's pages were unmapped under a running kernel"
            assert emu.counter("cuMemUnmap") == unmaps
            emu.complete(kernel)
            t.join(5)
            assert result.get("pages", 0) > 0
    finally:
        emu.stream_destroy(stream)


def test_scrubbing_zeroes_on_the_callers_stream_and_the_prefetch_thread_on_its_own(
    emu, engine, monkeypatch
):
    stream = emu.stream_create(nonblocking=True)
    _pretend_torch_stream(monkeypatch, stream)
    try:
        with make(scrub=True, lookahead_tokens=0) as cache:
            tpp = cache.config.tokens_per_page
            slot = cache.alloc()  # the caller's stream: the new request's kernels follow there
            cache.step({slot: 100})
            assert emu.counter("cuMemsetD8Async") > 0 and emu.last_memset_stream() == stream
            assert emu.counter("cuMemcpyHtoDAsync") == 0  # no copy of a zero page on stream 0
            memsets = emu.counter("cuMemsetD8Async")
            cache.prefetch({slot: 4 * tpp})
            cache.wait()
            assert emu.counter("cuMemsetD8Async") > memsets
            assert emu.last_memset_stream() not in (0, stream)  # the scrubber's own stream
            k, _ = cache.host_alias(0)
            assert not k[slot, 100 : 4 * tpp].any()
    finally:
        emu.stream_destroy(stream)


def test_close_waits_for_kernels_on_every_stream(emu, engine):
    stream = emu.stream_create(nonblocking=True)
    try:
        cache = make()
        slot = cache.alloc()
        cache.step({slot: 100})
        k, _ = cache.host_alias(0)
        row = k[slot, :100]
        kernel = emu.launch(stream, row.data_ptr(), row.numel() * row.element_size())
        del k, row
        t = threading.Thread(target=cache.close)
        t.start()
        time.sleep(0.2)
        assert t.is_alive(), "close() unmapped a row a kernel on another stream still reads"
        emu.complete(kernel)
        t.join(5)
        assert cache.closed
        del cache
    finally:
        emu.stream_destroy(stream)


def test_free_records_its_fence_on_the_callers_stream(emu):
    with make() as cache:
        a, b = cache.alloc(), cache.alloc()
        cache.step({a: 10, b: 10})
        cache.free(a, stream=0x5EED)
        assert emu.counter("last_event_stream") == 0x5EED
        cache.free(b)  # default: torch's current stream; a CPU torch has none: handle 0
        assert emu.counter("last_event_stream") == 0


def test_event_recorded_while_idle_needs_no_wait(emu):
    with make() as cache:
        slot = cache.alloc()
        cache.step({slot: 100})
        cache.free(slot)
        assert cache.reclaim() > 0
        assert emu.counter("cuEventSynchronize") == 0 and cache.stats()["fence_waits"] == 0


def test_eager_reclaim_defers_unmap_until_event_completes(emu):
    with make(reclaim="eager") as cache:
        slot = cache.alloc()
        cache.step({slot: 100})
        emu.set_gpu_busy(True)
        cache.free(slot)
        assert emu.counter("live_mappings") > 0 and emu.counter("cuMemUnmap") == 0
        emu.set_gpu_busy(False)
        other = cache.alloc()  # a later call drains what is now safe to unmap
        cache.step({other: 1})
        assert cache.stats()["idle_slots_with_pages"] == 0 or cache.mapped_tokens(slot) == 0


# ---- configuration ------------------------------------------------------------------------------


def test_page_size_must_be_a_multiple_of_the_device_granularity(emu):
    emu.set_granularity(2 << 20)  # as on real GPUs
    with pytest.raises(vattention.ConfigError, match=r"65536.*2097152"):
        make(page_size="64KB")
    with make(page_size="2MB", num_kv_heads=8, head_dim=128) as cache:
        slot = cache.alloc()
        cache.step({slot: 1500})
        assert cache.mapped_tokens(slot) == 2048


def test_device_without_vmm_or_out_of_range_is_refused(emu):
    emu.set_vmm_supported(False)
    with pytest.raises(vattention.BackendUnavailableError, match="virtual memory management"):
        make()
    emu.set_vmm_supported(True)
    with pytest.raises(vattention.ConfigError, match=r"cuda:1.*1 CUDA device"):
        make(device="cuda:1")


@pytest.mark.checks_own_cleanup
def test_backend_surfaces_driver_refusals_as_driver_errors(emu):
    backend = vattention._C.Backend("cuda:0", PAGE)
    va = backend.reserve(4 * PAGE)
    page = backend.create_page()
    backend.map(va, page)
    misuse = [
        ("cuMemUnmap", lambda: backend.unmap(va, 2 * PAGE)),  # includes a hole
        ("cuMemSetAccess", lambda: backend.set_access(va, 2 * PAGE)),  # not fully mapped
        ("cuMemMap", lambda: backend.map(va, page)),  # already mapped
        ("cuMemAddressFree", lambda: backend.release_va(va, 4 * PAGE)),
    ]  # still mapped
    for call, fn in misuse:
        with pytest.raises(vattention.DriverError) as info:
            fn()
        assert info.value.call == call and info.value.code == E.CUDA_ERROR_INVALID_VALUE
    assert emu.violations == len(misuse)  # the emulation saw each misuse too
    backend.set_access(va, PAGE)  # and the backend is still usable
    backend.unmap(va, PAGE)
    backend.destroy_page(page)
    backend.release_va(va, 4 * PAGE)
    backend = info = None  # drop them (the lambdas share `backend`: `del` reads as F821)
    gc.collect()
    assert emu.live() == {k: 0 for k in emu.live()}


# ---- loading the driver -------------------------------------------------------------------------


def _run_with_libcuda(path: str, code: str):
    import os
    import subprocess
    import sys

    env = dict(os.environ, VATTENTION_LIBCUDA=path)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )


LOAD_SCRIPT = """
import torch, vattention
print("REASON:", vattention._C.backend_unavailable_reason("cuda"))
cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64, max_batch_size=1,
                               max_seq_len=64, dtype=torch.float16, device="cuda")
try:
    vattention.KVCache(cfg)
except vattention.BackendUnavailableError as e:
    print("RAISED:", e)
"""


@pytest.mark.parametrize(
    "lib,why",
    [
        (
            "/nonexistent/libcuda.so.1",
            "cannot load the CUDA driver library '/nonexistent/libcuda.so.1'",
        ),
        ("libm.so.6", "libm.so.6 exports neither cuGetProcAddress_v2 nor cuGetProcAddress"),
    ],
)
def test_unusable_driver_library_is_backend_unavailable_with_reason(lib, why):
    proc = _run_with_libcuda(lib, LOAD_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert f"REASON: {why}" in proc.stdout
    assert "RAISED: CUDA backend unavailable: " + why in proc.stdout


def test_missing_entry_point_is_backend_unavailable_naming_it():
    script = (
        "import ctypes, os; lib = ctypes.CDLL(os.environ['VATTENTION_LIBCUDA']); "
        "lib.vaemu_hide_symbol(b'cuMemSetAccess')\n" + LOAD_SCRIPT
    )
    proc = _run_with_libcuda(str(E.LIB_PATH), script)
    assert proc.returncode == 0, proc.stderr
    why = (
        "does not provide cuMemSetAccess for CUDA 10.2 (cuGetProcAddress returned 0, "
        "symbol not found)"
    )
    assert why in proc.stdout.split("RAISED:")[0]
    assert "RAISED: CUDA backend unavailable" in proc.stdout


# ---- the hypothesis state machine of test_stateful.py, on the emulated CUDA backend --------------


class CudaCacheMachine(CacheMachine):
    """Random alloc/step/free/reclaim/reserve/shrink sequences against the pure-Python model, on the
    CUDA backend: the emulation additionally refuses any call that breaks a driver rule."""

    DEVICE = "cuda:0"

    @initialize()
    def note_violations(self):
        self.violations_at_start = E.Emulator.load().violations

    def teardown(self):
        super().teardown()
        self.__dict__.pop("cache", None)  # hypothesis may keep the machine: drop the cache now
        em = E.Emulator.load()
        if hasattr(self, "violations_at_start"):
            assert em.violations == self.violations_at_start, em.last_violation()
        live = em.live()
        assert live == {k: 0 for k in live}, f"driver objects left after close: {live}"


TestCudaCacheMachine = CudaCacheMachine.TestCase
TestCudaCacheMachine.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
