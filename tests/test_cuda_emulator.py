"""The strict CUDA driver EMULATION enforces each rule of the driver's virtual memory API it models.

One test per rule: legal use works, misuse returns the driver's error code AND counts a violation.
These tests check the emulation itself (the referee), not vattention; if a rule here stopped firing,
the CUDA backend tests that run on the emulation would prove less.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emulator"))
import emu as E  # noqa: E402  (tests/cuda_emulator/emu.py)
from test_sparse import rss_shmem_bytes  # noqa: E402

G = 2 * E.MB  # default granularity


@pytest.fixture
def emu():
    reason = E.unavailable_reason()
    if reason:
        pytest.skip(reason)
    em = E.Emulator.load()
    if any(em.live().values()):
        import gc

        gc.collect()  # a cache of an earlier test must not die after our reset, inside our test
    assert not any(em.live().values()), f"an earlier test left driver objects alive: {em.live()}"
    em.reset()
    yield em
    em.reset_for_suite()  # leave it as the cache-level suite expects


@pytest.fixture
def bound(emu):
    """Initialised, with the primary context current on this thread."""
    emu.init_and_bind()
    return emu


def reserve_ok(emu, size):
    res, va = emu.reserve(size)
    assert res == E.CUDA_SUCCESS
    return va


def create_ok(emu, size=G):
    res, h = emu.create(size)
    assert res == E.CUDA_SUCCESS
    return h


def test_calls_before_cuinit_fail_not_initialized(emu):
    assert emu.reserve(G)[0] == E.CUDA_ERROR_NOT_INITIALIZED
    assert emu.create(G)[0] == E.CUDA_ERROR_NOT_INITIALIZED
    assert emu.violations == 2
    assert "before cuInit" in emu.last_violation()
    assert emu.lib.cuInit(0) == E.CUDA_SUCCESS


def test_get_proc_address_table_and_versions(emu):
    # Usable before cuInit, both the v2 and the v1 symbol.
    res, fn, status = emu.get_proc("cuMemMap", 12000)
    assert (res, status) == (E.CUDA_SUCCESS, E.CU_GET_PROC_ADDRESS_SUCCESS) and fn
    assert fn == E.ctypes.cast(emu.lib.cuMemMap, E.ctypes.c_void_p).value
    res, fn_v1, _ = emu.get_proc("cuMemMap", 12000, v2=False)
    assert res == E.CUDA_SUCCESS and fn_v1 == fn
    # Versioned symbols resolve to the _v2 ABI by base name.
    res, fn, _ = emu.get_proc("cuEventDestroy", 12000)
    assert fn == E.ctypes.cast(emu.lib.cuEventDestroy_v2, E.ctypes.c_void_p).value
    assert emu.get_proc("cuNoSuchThing", 12000) == (
        E.CUDA_SUCCESS,
        0,
        E.CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND,
    )
    assert emu.get_proc("cuMemMap", 10010) == (
        E.CUDA_SUCCESS,
        0,
        E.CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT,
    )
    assert emu.get_proc("cuMemMap", 99000)[0] == E.CUDA_ERROR_INVALID_VALUE  # newer than driver


def test_hidden_symbol_is_not_found(emu):
    emu.hide_symbol("cuMemMap")
    assert emu.get_proc("cuMemMap", 12000) == (
        E.CUDA_SUCCESS,
        0,
        E.CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND,
    )
    assert emu.get_proc("cuMemUnmap", 12000)[1] != 0


def test_device_queries(bound):
    count = E.ctypes.c_int()
    assert bound.lib.cuDeviceGetCount(E.ctypes.byref(count)) == 0 and count.value == 1
    dev, val = E.ctypes.c_int(), E.ctypes.c_int()
    assert bound.lib.cuDeviceGet(E.ctypes.byref(dev), 1) == E.CUDA_ERROR_INVALID_DEVICE
    assert bound.lib.cuDeviceGetAttribute(E.ctypes.byref(val), 102, 0) == 0 and val.value == 1
    bound.set_vmm_supported(False)
    assert bound.lib.cuDeviceGetAttribute(E.ctypes.byref(val), 102, 0) == 0 and val.value == 0
    assert bound.violations == 0


def test_granularity_is_configurable_and_sizes_must_be_multiples(bound):
    assert bound.granularity() == (E.CUDA_SUCCESS, G)
    assert bound.reserve(G + 4096)[0] == E.CUDA_ERROR_INVALID_VALUE
    assert bound.create(G // 2)[0] == E.CUDA_ERROR_INVALID_VALUE
    assert bound.violations == 2 and "granularity" in bound.last_violation()
    bound.set_granularity(64 * 1024)
    assert bound.granularity() == (E.CUDA_SUCCESS, 64 * 1024)
    h = create_ok(bound, 64 * 1024)
    assert bound.release(h) == 0
    assert bound.violations == 2


def test_reservations_are_aligned_to_granularity(bound):
    for _ in range(4):
        va = reserve_ok(bound, 3 * G)
        assert va % G == 0
    assert bound.counter("live_reservations") == 4


def test_map_address_must_be_aligned_and_offset_zero(bound):
    va = reserve_ok(bound, 4 * G)
    h = create_ok(bound)
    assert bound.map(va + 4096, G, h) == E.CUDA_ERROR_INVALID_VALUE
    assert bound.map(va, G, h, offset=G) == E.CUDA_ERROR_INVALID_VALUE
    assert "offset" in bound.last_violation()
    assert bound.violations == 2
    assert bound.map(va, G, h) == E.CUDA_SUCCESS
    assert bound.counter("live_mappings") == 1


def test_map_must_be_inside_one_reservation_and_unmapped(bound):
    va = reserve_ok(bound, 2 * G)
    h1, h2 = create_ok(bound), create_ok(bound)
    assert bound.map(va + 2 * G, G, h1) == E.CUDA_ERROR_INVALID_VALUE  # just past the end
    assert bound.map(va + G, 2 * G, create_ok(bound, 2 * G)) == E.CUDA_ERROR_INVALID_VALUE
    assert "inside one reservation" in bound.last_violation()
    assert bound.map(va, G, h1) == E.CUDA_SUCCESS
    assert bound.map(va, G, h2) == E.CUDA_ERROR_INVALID_VALUE  # already mapped
    assert "already" in bound.last_violation()
    assert bound.violations == 3
    assert bound.map(va + G, G, h2) == E.CUDA_SUCCESS


def test_new_mapping_has_no_access_until_set_access(bound):
    va = reserve_ok(bound, G)
    h = create_ok(bound)
    assert E.touch_faults(va), "a reservation without mapping must fault"
    assert bound.map(va, G, h) == 0
    assert E.touch_faults(va), "a mapping without cuMemSetAccess must fault"
    assert bound.set_access(va, G) == 0
    assert not E.touch_faults(va, write=True)
    E.ctypes.memset(va + G - 1, 7, 1)
    assert E.ctypes.c_ubyte.from_address(va + G - 1).value == 7
    assert bound.counter("accessible_mappings") == 1
    assert bound.violations == 0


def test_set_access_must_cover_a_fully_mapped_range(bound):
    va = reserve_ok(bound, 4 * G)
    for i in (0, 1, 3):  # hole at page 2
        assert bound.map(va + i * G, G, create_ok(bound)) == 0
    assert bound.set_access(va, 4 * G) == E.CUDA_ERROR_INVALID_VALUE  # includes the hole
    assert "fully mapped" in bound.last_violation()
    assert bound.set_access(va + G, 2 * G) == E.CUDA_ERROR_INVALID_VALUE  # runs into the hole
    assert bound.violations == 2
    assert bound.counter("accessible_mappings") == 0
    assert bound.set_access(va, 2 * G) == 0  # one call over two adjacent mappings is legal
    assert bound.counter("accessible_mappings") == 2


def test_set_access_cannot_cover_part_of_a_mapping(bound):
    va = reserve_ok(bound, 2 * G)
    assert bound.map(va, 2 * G, create_ok(bound, 2 * G)) == 0
    assert bound.set_access(va, G) == E.CUDA_ERROR_INVALID_VALUE
    assert bound.violations == 1
    assert bound.set_access(va, 2 * G) == 0


def test_unmap_must_cover_whole_mappings_without_holes(bound):
    va = reserve_ok(bound, 6 * G)
    assert bound.map(va, 2 * G, create_ok(bound, 2 * G)) == 0  # one 2-page mapping
    assert bound.map(va + 2 * G, G, create_ok(bound)) == 0
    assert bound.map(va + 4 * G, G, create_ok(bound)) == 0
    assert bound.unmap(va, G) == E.CUDA_ERROR_INVALID_VALUE  # splits the first mapping
    assert bound.unmap(va + G, 2 * G) == E.CUDA_ERROR_INVALID_VALUE  # starts inside one
    assert bound.unmap(va + 2 * G, 3 * G) == E.CUDA_ERROR_INVALID_VALUE  # hole at page 3
    assert bound.unmap(va + 3 * G, G) == E.CUDA_ERROR_INVALID_VALUE  # nothing mapped there
    assert "whole mappings" in bound.last_violation()
    assert bound.violations == 4
    assert bound.counter("live_mappings") == 3
    assert bound.unmap(va, 3 * G) == 0  # two adjacent mappings in one call
    assert bound.counter("live_mappings") == 1


def test_unmap_returns_range_to_reservation_and_remap_needs_access_again(bound):
    va = reserve_ok(bound, G)
    h = create_ok(bound)
    assert bound.map(va, G, h) == 0 and bound.set_access(va, G) == 0
    assert bound.unmap(va, G) == 0
    assert E.touch_faults(va)
    assert bound.map(va, G, h) == 0  # same address, same handle: legal again
    assert E.touch_faults(va)
    assert bound.violations == 0


def test_release_while_mapped_frees_memory_at_last_unmap(bound):
    va = reserve_ok(bound, 2 * G)
    h = create_ok(bound)
    assert bound.map(va, G, h) == 0 and bound.map(va + G, G, h) == 0  # aliased twice
    assert bound.release(h) == 0  # legal while mapped
    assert bound.counter("bytes_in_use") == G and bound.counter("live_handles") == 1
    assert bound.map(va, G, h) == E.CUDA_ERROR_INVALID_VALUE  # released handles cannot be mapped
    assert bound.unmap(va, G) == 0
    assert bound.counter("bytes_in_use") == G  # one mapping left
    assert bound.unmap(va + G, G) == 0
    assert bound.counter("bytes_in_use") == 0 and bound.counter("live_handles") == 0
    assert bound.violations == 1


def test_double_release_is_a_violation(bound):
    h = create_ok(bound)
    assert bound.release(h) == 0
    assert bound.release(h) == E.CUDA_ERROR_INVALID_VALUE
    assert bound.violations == 1 and "released twice" in bound.last_violation()


def test_address_free_needs_exact_reservation_and_no_mappings(bound):
    va = reserve_ok(bound, 2 * G)
    assert bound.map(va, G, create_ok(bound)) == 0
    assert bound.address_free(va, G) == E.CUDA_ERROR_INVALID_VALUE  # not the whole reservation
    assert bound.address_free(va + G, G) == E.CUDA_ERROR_INVALID_VALUE
    assert bound.address_free(va, 2 * G) == E.CUDA_ERROR_INVALID_VALUE  # still mapped
    assert "live mappings" in bound.last_violation()
    assert bound.violations == 3
    assert bound.unmap(va, G) == 0
    assert bound.address_free(va, 2 * G) == 0
    assert bound.counter("live_reservations") == 0


def test_aliasing_one_handle_at_two_addresses_shares_bytes(bound):
    a, b = reserve_ok(bound, G), reserve_ok(bound, G)
    h = create_ok(bound)
    for va in (a, b):
        assert bound.map(va, G, h) == 0 and bound.set_access(va, G) == 0
    E.ctypes.memset(a + 100, 0x42, 8)
    assert E.ctypes.string_at(b + 100, 8) == b"\x42" * 8
    assert bound.violations == 0


def test_physical_budget_gives_out_of_memory_without_violation(bound):
    bound.set_device_memory_bytes(2 * G)
    h1, h2 = create_ok(bound), create_ok(bound)
    assert bound.create(G)[0] == E.CUDA_ERROR_OUT_OF_MEMORY
    assert bound.release(h1) == 0
    h3 = create_ok(bound)  # budget freed by release
    assert {h1, h2, h3} and bound.violations == 0


def test_strict_context_rejects_threads_without_context(bound):
    results = {}

    def worker(bind):
        if bind:
            ctx = E.ctypes.c_void_p()
            bound.lib.cuDevicePrimaryCtxRetain(E.ctypes.byref(ctx), 0)
            bound.lib.cuCtxSetCurrent(ctx)
            results["has_ctx"] = bound.thread_has_context()
            results["bound"] = bound.create(G)[0]
            bound.lib.cuDevicePrimaryCtxRelease_v2(0)
        else:
            results["has_ctx_unbound"] = bound.thread_has_context()
            results["unbound"] = bound.create(G)[0]

    for bind in (False, True):
        t = threading.Thread(target=worker, args=(bind,))
        t.start()
        t.join()
    assert results["unbound"] == E.CUDA_ERROR_INVALID_CONTEXT and not results["has_ctx_unbound"]
    assert results["bound"] == E.CUDA_SUCCESS and results["has_ctx"]
    assert bound.violations == 1 and "no current context" in bound.last_violation()
    bound.set_strict_context(False)
    t = threading.Thread(target=worker, args=(False,))
    t.start()
    t.join()
    assert results["unbound"] == E.CUDA_SUCCESS
    assert bound.violations == 1


def test_released_primary_context_is_not_usable(bound):
    assert bound.lib.cuDevicePrimaryCtxRelease_v2(0) == 0  # refcount back to 0: destroyed
    assert bound.reserve(G)[0] == E.CUDA_ERROR_INVALID_CONTEXT
    assert bound.lib.cuDevicePrimaryCtxRelease_v2(0) == E.CUDA_ERROR_INVALID_CONTEXT
    assert bound.violations == 2


def test_fault_injection_fails_the_nth_call_once_without_side_effects(bound):
    va = reserve_ok(bound, 4 * G)
    bound.inject_fault("cuMemMap", 2, E.CUDA_ERROR_OUT_OF_MEMORY)
    assert bound.map(va, G, create_ok(bound)) == 0
    assert bound.map(va + G, G, create_ok(bound)) == E.CUDA_ERROR_OUT_OF_MEMORY
    assert bound.counter("live_mappings") == 1
    assert bound.map(va + G, G, create_ok(bound)) == 0  # one-shot
    assert bound.counter("cuMemMap") == 3
    bound.inject_fault("cuMemCreate", 1, E.CUDA_ERROR_UNKNOWN)
    bound.inject_fault("cuMemCreate", 0, 0)  # disarm
    create_ok(bound)
    assert bound.violations == 0


def test_latency_is_injected_per_entry_point(bound):
    va = reserve_ok(bound, G)
    h = create_ok(bound)
    bound.set_latency_us("cuMemMap", 30_000)
    t0 = time.perf_counter()
    assert bound.map(va, G, h) == 0
    # A lower bound only: the hold sleeps and spins until 30 ms have passed on the monotonic
    # clock, however loaded the machine (an upper bound would time the scheduler).
    assert time.perf_counter() - t0 >= 0.03
    assert bound.unmap(va, G) == 0
    # Which calls were held is counted by the emulation, not timed: cuMemMap's 30 ms, no other.
    assert bound.counter("held_ns:cuMemMap") == 30_000_000
    assert bound.counter("held_ns:cuMemUnmap") == 0


def test_events_stay_pending_while_gpu_busy(bound):
    res, ev = bound.event_create()
    assert res == 0
    assert bound.event_record(ev) == 0
    assert bound.event_query(ev) == E.CUDA_SUCCESS  # recorded while idle: done at once
    bound.set_gpu_busy(True)
    assert bound.event_record(ev) == 0
    assert bound.event_query(ev) == E.CUDA_ERROR_NOT_READY
    released = []

    def gpu_finishes():
        time.sleep(0.05)
        released.append(time.perf_counter())
        bound.set_gpu_busy(False)

    t = threading.Thread(target=gpu_finishes)
    t.start()
    assert bound.event_synchronize(ev) == 0
    done = time.perf_counter()
    t.join()
    assert released and done >= released[0]  # synchronize returned only after the GPU finished
    assert bound.event_query(ev) == E.CUDA_SUCCESS
    assert bound.event_destroy(ev) == 0
    assert bound.event_destroy(ev) == E.CUDA_ERROR_INVALID_HANDLE  # destroyed twice
    assert bound.violations == 1 and bound.counter("live_events") == 0


def test_counters_track_calls_and_return_to_zero(bound):
    va = reserve_ok(bound, 2 * G)
    handles = [create_ok(bound) for _ in range(2)]
    for i, h in enumerate(handles):
        assert bound.map(va + i * G, G, h) == 0
    assert bound.set_access(va, 2 * G) == 0
    assert bound.counter("cuMemCreate") == 2 and bound.counter("cuMemSetAccess") == 1
    assert bound.live()["live_mappings"] == 2
    assert bound.unmap(va, 2 * G) == 0
    for h in handles:
        assert bound.release(h) == 0
    assert bound.address_free(va, 2 * G) == 0
    assert bound.lib.cuDevicePrimaryCtxRelease_v2(0) == 0
    assert bound.live() == {k: 0 for k in bound.live()}
    assert bound.violations == 0


def test_error_strings(emu):
    s = E.ctypes.c_char_p()
    assert emu.lib.cuGetErrorString(E.CUDA_ERROR_OUT_OF_MEMORY, E.ctypes.byref(s)) == 0
    assert s.value == b"out of memory (CUDA emulation)"
    assert emu.lib.cuGetErrorString(123456, E.ctypes.byref(s)) == E.CUDA_ERROR_INVALID_VALUE


# ---- streams, in-flight work, capture, contexts -------------------------------------------------

LEGACY, PER_THREAD = E.CU_STREAM_LEGACY, E.CU_STREAM_PER_THREAD
GLOBAL = E.CU_STREAM_CAPTURE_MODE_GLOBAL
THREAD_LOCAL = E.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
RELAXED = E.CU_STREAM_CAPTURE_MODE_RELAXED
MODES = {"global": GLOBAL, "thread_local": THREAD_LOCAL, "relaxed": RELAXED}


def mapped_ok(emu, pages=1, access=True):
    """A reservation of `pages` granules, each its own mapping; returns (va, handles)."""
    va = reserve_ok(emu, pages * G)
    handles = []
    for i in range(pages):
        h = create_ok(emu)
        assert emu.map(va + i * G, G, h) == 0
        handles.append(h)
    if access:
        assert emu.set_access(va, pages * G) == 0
    return va, handles


def on_thread(fn, *args):
    """fn(*args) on a new thread (ctypes calls made there act as that thread); its result."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # re-raised below, on the test's thread
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the thread did not finish"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def bound_thread(emu, ctx, fn, *args):
    """on_thread, with `ctx` made current on that thread first."""

    def run():
        assert emu.set_current_context(ctx) == 0
        return fn(*args)

    return on_thread(run)


def event_ok(emu):
    res, ev = emu.event_create()
    assert res == 0
    return ev


def test_stream_entry_points_are_in_the_proc_table_with_their_versions(emu):
    fn_addr = lambda name: E.ctypes.cast(getattr(emu.lib, name), E.ctypes.c_void_p).value  # noqa: E731
    rows = {
        "cuStreamCreate": (2000, "cuStreamCreate"),
        "cuStreamDestroy": (4000, "cuStreamDestroy_v2"),
        "cuStreamSynchronize": (2000, "cuStreamSynchronize"),
        "cuCtxSynchronize": (2000, "cuCtxSynchronize"),
        "cuMemsetD8Async": (3020, "cuMemsetD8Async"),
        "cuStreamBeginCapture": (10010, "cuStreamBeginCapture_v2"),
        "cuStreamEndCapture": (10000, "cuStreamEndCapture"),
        "cuStreamIsCapturing": (10000, "cuStreamIsCapturing"),
        "cuThreadExchangeStreamCaptureMode": (10010, "cuThreadExchangeStreamCaptureMode"),
        "cuGraphDestroy": (10000, "cuGraphDestroy"),
    }
    for symbol, (since, exported) in rows.items():
        res, fn, status = emu.get_proc(symbol, since)
        assert (res, status, fn) == (E.CUDA_SUCCESS, 0, fn_addr(exported)), symbol
        assert emu.get_proc(symbol, since - 10)[2] == E.CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
    # One base name, two ABIs: (void) until CUDA 13, (CUcontext) from 13.0 on.
    assert emu.get_proc("cuCtxSynchronize", 12090)[1] == fn_addr("cuCtxSynchronize")
    assert emu.get_proc("cuCtxSynchronize", 13000)[1] == fn_addr("cuCtxSynchronize_v2")


def test_stream_create_destroy_and_bad_handles(bound):
    b, n = bound.stream_create(nonblocking=False), bound.stream_create()
    assert b and n and b != n and bound.counter("live_streams") == 2
    assert bound.counter("cuStreamCreate") == 2
    s = E.ctypes.c_void_p()
    assert bound.lib.cuStreamCreate(E.ctypes.byref(s), 0x4) == E.CUDA_ERROR_INVALID_VALUE
    assert bound.stream_destroy(b) == 0
    assert bound.stream_destroy(b) == E.CUDA_ERROR_INVALID_HANDLE
    assert "destroyed twice" in bound.last_violation()
    ev = event_ok(bound)
    assert bound.event_record(ev, b) == E.CUDA_ERROR_INVALID_HANDLE  # use after destroy
    assert "was destroyed" in bound.last_violation()
    for special in (0, LEGACY, PER_THREAD):  # not created: cannot be destroyed
        assert bound.stream_destroy(special) == E.CUDA_ERROR_INVALID_HANDLE
    assert bound.violations == 6
    for special in (0, LEGACY, PER_THREAD, n):  # every stream-taking entry accepts these
        assert bound.event_record(ev, special) == 0
        assert bound.counter("last_event_stream") == special
    assert bound.event_record(ev, 0x5EED) == 0  # a handle from elsewhere: adopted (default)
    bound.set_strict_streams(True)
    assert bound.event_record(ev, 0x5EE0) == E.CUDA_ERROR_INVALID_HANDLE
    assert "strict streams" in bound.last_violation() and bound.violations == 7
    assert bound.stream_destroy(n) == 0 and bound.event_destroy(ev) == 0
    assert bound.counter("live_streams") == 0


def test_units_on_one_stream_complete_in_launch_order(bound):
    va, _ = mapped_ok(bound)
    s = bound.stream_create()
    first = bound.launch(s, va, G)  # held
    second = bound.launch(s, va, 64, held=False)  # finished, but behind `first`
    assert first and second and first != second and bound.inflight() == 2
    ev = event_ok(bound)
    assert bound.event_record(ev, s) == 0
    assert bound.event_query(ev) == E.CUDA_ERROR_NOT_READY
    bound.complete(second)  # already finished: changes nothing
    assert bound.inflight() == 2
    bound.complete(first)
    assert bound.inflight() == 0 and bound.event_query(ev) == 0
    assert bound.launch(s, va, G, held=False) and bound.inflight() == 0  # nothing ahead: done
    assert bound.violations == 0


@pytest.mark.parametrize("legacy", [0, LEGACY])
def test_legacy_event_waits_for_blocking_streams_not_nonblocking_ones(bound, legacy):
    va, _ = mapped_ok(bound)
    b, n = bound.stream_create(nonblocking=False), bound.stream_create(nonblocking=True)
    on_b, on_n = bound.launch(b, va, G), bound.launch(n, va, G)
    ev = event_ok(bound)
    assert bound.event_record(ev, legacy) == 0
    assert bound.event_query(ev) == E.CUDA_ERROR_NOT_READY  # waits for the blocking stream
    bound.complete(on_b)
    assert bound.event_query(ev) == 0  # ready although the non-blocking stream's unit runs
    assert bound.inflight() == 1
    bound.complete(on_n)
    assert bound.inflight() == 0 and bound.violations == 0


def test_unit_on_blocking_stream_waits_for_earlier_legacy_work(bound):
    va, _ = mapped_ok(bound)
    b, n = bound.stream_create(nonblocking=False), bound.stream_create(nonblocking=True)
    on_legacy = bound.launch(0, va, G)
    bound.launch(n, va, G, held=False)  # non-blocking: no wait for the legacy stream
    assert bound.inflight() == 1
    bound.launch(b, va, G, held=False)  # blocking: behind the legacy unit
    assert bound.inflight() == 2
    ev_b, ev_n = event_ok(bound), event_ok(bound)
    assert bound.event_record(ev_b, b) == 0 and bound.event_record(ev_n, n) == 0
    assert bound.event_query(ev_b) == E.CUDA_ERROR_NOT_READY and bound.event_query(ev_n) == 0
    bound.complete(on_legacy)
    assert bound.inflight() == 0 and bound.event_query(ev_b) == 0
    assert bound.violations == 0


def test_legacy_stream_orders_blocking_streams_transitively(bound):
    va, _ = mapped_ok(bound)
    b1, b2 = bound.stream_create(nonblocking=False), bound.stream_create(nonblocking=False)
    on_b1 = bound.launch(b1, va, G)
    ev = event_ok(bound)
    assert bound.event_record(ev, 0) == 0  # the legacy stream waits for b1 ...
    bound.launch(b2, va, G, held=False)  # ... and b2 waits for the legacy stream
    assert bound.inflight() == 2
    bound.complete(on_b1)
    assert bound.inflight() == 0 and bound.event_query(ev) == 0


def test_per_thread_default_stream_is_per_thread_and_blocking(bound):
    va, _ = mapped_ok(bound)
    ctx = bound.current_context()
    mine = bound.launch(PER_THREAD, va, G)
    ev = event_ok(bound)
    assert bound.event_record(ev, PER_THREAD) == 0
    assert bound.event_query(ev) == E.CUDA_ERROR_NOT_READY

    def other_threads_own_stream():
        other = event_ok(bound)
        assert bound.event_record(other, PER_THREAD) == 0
        try:
            return bound.event_query(other)
        finally:
            bound.event_destroy(other)

    assert bound_thread(bound, ctx, other_threads_own_stream) == 0  # not this thread's unit
    assert bound.event_record(ev, bound.stream_create()) == 0  # explicit streams: no wait
    assert bound.event_query(ev) == 0
    assert bound.event_record(ev, 0) == 0  # the legacy stream waits for it (docs: not non-blocking)
    assert bound.event_query(ev) == E.CUDA_ERROR_NOT_READY
    bound.complete(mine)
    assert bound.event_query(ev) == 0 and bound.violations == 0


def test_work_launched_from_a_thread_without_context_is_on_the_primary_context(bound):
    # A test's own thread need not bind a context: its launches land on device 0's primary
    # context, so the legacy stream it names is the one the library's calls (context bound) use.
    va, _ = mapped_ok(bound)
    unit = on_thread(lambda: (bound.thread_has_context(), bound.launch(0, va, G)))
    assert unit[0] is False
    ev = event_ok(bound)
    assert bound.event_record(ev, 0) == 0
    assert bound.event_query(ev) == E.CUDA_ERROR_NOT_READY
    bound.complete(unit[1])
    assert bound.event_query(ev) == 0 and bound.violations == 0


def test_stream_and_context_synchronize_wait_for_their_work(bound):
    va, _ = mapped_ok(bound)
    b, n = bound.stream_create(nonblocking=False), bound.stream_create()
    unit = bound.launch(n, va, G)
    # b has nothing to wait for, nor the legacy stream (n is non-blocking): a wrong wait would
    # not return 0 but CUDA_ERROR_LAUNCH_TIMEOUT, after the emulation's 5 s sync timeout.
    assert bound.stream_synchronize(b) == 0
    assert bound.stream_synchronize(0) == 0
    bound.complete(unit)
    done = []

    def gpu_finishes():
        time.sleep(0.05)
        done.append(time.perf_counter())
        bound.complete(unit)

    for sync in (lambda: bound.stream_synchronize(n), bound.ctx_synchronize):
        unit = bound.launch(n, va, G)
        done.clear()
        t = threading.Thread(target=gpu_finishes)
        t.start()
        assert sync() == 0
        returned = time.perf_counter()
        t.join()
        assert done and returned >= done[0]
    assert bound.inflight() == 0
    assert bound.lib.cuCtxSynchronize_v2(None) == 0
    assert bound.counter("cuCtxSynchronize") == 2 and bound.violations == 0


def test_synchronize_on_work_never_completed_fails_loudly(bound):
    va, _ = mapped_ok(bound)
    s = bound.stream_create()
    bound.set_sync_timeout_ms(100)
    unit = bound.launch(s, va, G)
    ev = event_ok(bound)
    assert bound.event_record(ev, s) == 0
    for sync in (
        lambda: bound.stream_synchronize(s),
        bound.ctx_synchronize,
        lambda: bound.event_synchronize(ev),
    ):
        before = bound.violations
        t0 = time.perf_counter()
        assert sync() == E.CUDA_ERROR_LAUNCH_TIMEOUT
        # At least the 100 ms set (a condition-variable wait on the monotonic clock; 10 ms for
        # the clocks' granularity), and short of the 5 s default: the setting took effect. 5 s
        # for a 100 ms wait leaves any load room.
        assert 0.09 <= time.perf_counter() - t0 < 5
        assert bound.violations == before + 1 and "never completed" in bound.last_violation()
    bound.complete(unit)
    assert bound.stream_synchronize(s) == 0 and bound.violations == 3


def test_unmap_under_held_work_is_a_violation_and_after_completion_is_fine(bound):
    va, _ = mapped_ok(bound, pages=2)
    s = bound.stream_create()
    unit = bound.launch(s, va + 100, 1000)  # reads inside page 0 only
    assert bound.unmap(va + G, G) == 0 and bound.violations == 0  # page 1: not read
    assert bound.unmap(va, G) == E.CUDA_SUCCESS  # the unmap still happens ...
    assert bound.violations == 1  # ... but it is a violation
    msg = bound.last_violation()
    assert msg.startswith(f"unmapping [{va:#x}, {va + G:#x}) that in-flight work on stream")
    assert f"{s:#x}" in msg and "may still read" in msg
    assert bound.counter("live_mappings") == 0
    bound.complete(unit)
    va2, _ = mapped_ok(bound)
    unit = bound.launch(s, va2, G)
    bound.complete(unit)
    assert bound.unmap(va2, G) == 0 and bound.violations == 1


def test_unmap_under_work_on_a_destroyed_stream_is_still_a_violation(bound):
    va, _ = mapped_ok(bound)
    s = bound.stream_create()
    unit = bound.launch(s, va, G)
    assert bound.stream_destroy(s) == 0  # legal: its work stays in flight
    assert bound.inflight() == 1
    assert bound.unmap(va, G) == 0 and bound.violations == 1
    bound.complete(unit)
    assert bound.inflight() == 0


def test_freeing_memory_in_flight_work_reads_is_a_violation(bound):
    # One mapping: the unmap is the violation; the release then frees memory the unit reads.
    va, (h,) = mapped_ok(bound)
    unit = bound.launch(bound.stream_create(), va, G)
    assert bound.unmap(va, G) == 0 and bound.violations == 1
    assert bound.release(h) == 0 and bound.violations == 2
    assert "frees the memory of handle" in bound.last_violation()
    bound.complete(unit)
    # Two aliases, the unit reads through A: releasing (still mapped) and unmapping B are legal;
    # the violation is the unmap of A (which also frees the memory: counted once).
    a, b = reserve_ok(bound, G), reserve_ok(bound, G)
    h = create_ok(bound)
    for at in (a, b):
        assert bound.map(at, G, h) == 0 and bound.set_access(at, G) == 0
    unit = bound.launch(0, a, 64)
    assert bound.release(h) == 0 and bound.unmap(b, G) == 0 and bound.violations == 2
    assert bound.unmap(a, G) == 0 and bound.violations == 3
    assert bound.counter("live_handles") == 0
    bound.complete(unit)
    # The unit reads through A; A is unmapped first (violation), then B's unmap frees the memory
    # (a second violation: the unit still reads it), although B's range is not the one read.
    h = create_ok(bound)
    for at in (a, b):
        assert bound.map(at, G, h) == 0 and bound.set_access(at, G) == 0
    unit = bound.launch(0, a, 64)
    assert bound.unmap(a, G) == 0 and bound.violations == 4
    assert bound.release(h) == 0 and bound.violations == 4  # B still maps it: nothing freed
    assert bound.unmap(b, G) == 0 and bound.violations == 5
    assert "frees the memory of handle" in bound.last_violation()
    bound.complete(unit)
    # Completed work: no violation at all.
    va, (h,) = mapped_ok(bound)
    bound.complete(bound.launch(0, va, G))
    assert bound.unmap(va, G) == 0 and bound.release(h) == 0 and bound.violations == 5


def test_launch_must_read_accessible_memory(bound):
    va = reserve_ok(bound, 2 * G)
    assert bound.map(va, G, create_ok(bound)) == 0  # page 0: mapped, no access; page 1: hole
    s = bound.stream_create()
    bound.complete(bound.launch(s, va, 64))
    assert bound.violations == 1 and "unmapped/inaccessible" in bound.last_violation()
    bound.complete(bound.launch(s, va + G, 64))
    assert bound.violations == 2 and "illegal address" in bound.last_violation()
    assert bound.set_access(va, G) == 0
    bound.complete(bound.launch(s, va, G))
    bound.complete(bound.launch(s, va + G, 0))  # reads nothing
    assert bound.violations == 2 and bound.counter("vaemu_launch") == 4


def test_memset_async_writes_checks_access_and_records_its_stream(bound):
    va, _ = mapped_ok(bound)
    s = bound.stream_create()
    assert bound.memset_async(va + 10, 0xAB, 5, s) == 0
    assert E.ctypes.string_at(va + 10, 5) == b"\xab" * 5
    assert bound.last_memset_stream() == s and bound.counter("cuMemsetD8Async") == 1
    assert bound.memset_async(va, 1, 1, PER_THREAD) == 0
    assert bound.last_memset_stream() == PER_THREAD
    no_access = reserve_ok(bound, G)
    assert bound.map(no_access, G, create_ok(bound)) == 0
    assert bound.memset_async(no_access, 1, 1, s) == E.CUDA_ERROR_INVALID_VALUE
    assert bound.memset_async(va + G - 1, 1, 2, s) == E.CUDA_ERROR_INVALID_VALUE  # runs off the end
    assert bound.violations == 2 and "not mapped with access" in bound.last_violation()
    assert bound.last_memset_stream() == PER_THREAD  # refused calls do not count


def test_memset_zero_clears_across_mappings_and_aliases_without_touching_fresh_pages(bound):
    # A GPU's memset costs its host a launch: zeroing must not fault fresh pages in (0.7 ms a
    # 2 MB page on some hosts, which would stand in the timing of the driver calls), and must
    # still zero every byte of the range, through every alias, and nothing beside it.
    va, handles = mapped_ok(bound, pages=4)
    before = rss_shmem_bytes()  # the emulated device memory is memfd pages
    assert bound.memset_async(va, 0, 4 * G, PER_THREAD) == 0
    assert rss_shmem_bytes() - before < E.MB  # 8 MB of fresh pages: well under one MB faulted in
    alias = reserve_ok(bound, G)
    assert bound.map(alias, G, handles[1]) == 0 and bound.set_access(alias, G) == 0
    E.ctypes.memset(va, 0xFF, 4 * G)
    assert bound.memset_async(va + 100, 0, 3 * G - 50, PER_THREAD) == 0
    got = E.ctypes.string_at(va, 4 * G)
    assert got[:100] == b"\xff" * 100
    assert got[100 : 3 * G + 50] == bytes(3 * G - 50)
    assert got[3 * G + 50 :] == b"\xff" * (G - 50)
    assert E.ctypes.string_at(alias, G) == bytes(G)  # the alias of the second page
    assert bound.memset_async(va + 5, 0, 3, PER_THREAD) == 0  # within one host page
    assert E.ctypes.string_at(va, 10) == b"\xff" * 5 + bytes(3) + b"\xff" * 2
    assert bound.violations == 0


def test_copies_record_their_stream(bound):
    va, _ = mapped_ok(bound, pages=2)
    s = bound.stream_create()
    E.ctypes.memset(va, 7, 16)
    assert bound.memcpy_async(va + G, va, 16, s) == 0
    assert E.ctypes.string_at(va + G, 16) == b"\x07" * 16 and bound.last_copy_stream() == s
    host = E.ctypes.c_void_p()
    assert bound.lib.cuMemHostAlloc(E.ctypes.byref(host), 16, 0) == 0
    assert bound.lib.cuMemcpyDtoHAsync_v2(host, va, 16, PER_THREAD) == 0
    assert bound.last_copy_stream() == PER_THREAD
    assert bound.lib.cuMemcpyHtoDAsync_v2(va, host, 16, 0) == 0
    assert bound.last_copy_stream() == 0 and bound.counter("last_copy_stream") == 0
    assert bound.lib.cuMemFreeHost(host) == 0 and bound.violations == 0


def test_copy_and_memset_behind_held_work_stay_in_flight(bound):
    va, _ = mapped_ok(bound, pages=3)
    s = bound.stream_create()
    unit = bound.launch(s, va, 64)  # reads page 0
    assert bound.memcpy_async(va + G, va, 64, s) == 0  # done at once, in flight behind `unit`
    assert bound.memset_async(va + 2 * G, 0, 64, s) == 0
    assert bound.inflight() == 1  # only launched kernels count
    assert bound.unmap(va + G, G) == 0 and bound.violations == 1
    assert "cuMemcpyAsync" in bound.last_violation()
    assert bound.unmap(va + 2 * G, G) == 0 and bound.violations == 2
    assert "cuMemsetD8Async" in bound.last_violation()
    bound.complete(unit)
    assert bound.unmap(va, G) == 0 and bound.violations == 2


def test_gpu_busy_and_units_both_hold_an_event(bound):
    va, _ = mapped_ok(bound)
    s = bound.stream_create()
    unit = bound.launch(s, va, G)
    bound.set_gpu_busy(True)
    ev = event_ok(bound)
    assert bound.event_record(ev, s) == 0
    bound.complete(unit)
    assert bound.event_query(ev) == E.CUDA_ERROR_NOT_READY  # still busy
    bound.set_gpu_busy(False)
    assert bound.event_query(ev) == 0 and bound.violations == 0


# ---- stream capture ----


def test_capture_records_work_without_running_it(bound):
    va, _ = mapped_ok(bound)
    s = bound.stream_create()
    ev = event_ok(bound)
    assert bound.is_capturing(s) == (0, E.CU_STREAM_CAPTURE_STATUS_NONE)
    assert bound.begin_capture(s, GLOBAL) == 0 and bound.counter("active_captures") == 1
    assert bound.is_capturing(s) == (0, E.CU_STREAM_CAPTURE_STATUS_ACTIVE)
    assert bound.memset_async(va, 0x11, 8, s) == 0  # captured: does not write
    assert E.ctypes.string_at(va, 8) == b"\x00" * 8 and bound.last_memset_stream() == s
    assert bound.launch(s, va, G) and bound.inflight() == 0  # captured: nothing in flight
    assert bound.event_record(ev, s) == 0
    other = bound.stream_create()
    assert bound.memset_async(va, 0x22, 8, other) == 0  # another stream runs as usual
    assert E.ctypes.string_at(va, 8) == b"\x22" * 8
    rc, graph = bound.end_capture_graph(s)
    assert rc == 0 and graph and bound.counter("live_graphs") == 1
    assert bound.is_capturing(s) == (0, E.CU_STREAM_CAPTURE_STATUS_NONE)
    assert bound.graph_destroy(graph) == 0
    assert bound.graph_destroy(graph) == E.CUDA_ERROR_INVALID_VALUE  # twice
    assert bound.violations == 1
    assert bound.event_query(ev) == E.CUDA_ERROR_CAPTURED_EVENT  # last recorded in a capture
    assert bound.violations == 2
    assert bound.event_record(ev, s) == 0 and bound.event_query(ev) == 0  # recorded for real
    assert bound.counter("active_captures") == 0 and bound.violations == 2


def _vmm_call(emu):
    """A potentially unsafe call: cuMemAddressReserve (freed again when it succeeds)."""
    res, va = emu.reserve(G)
    if res == 0:
        assert emu.address_free(va, G) == 0
    return res


@pytest.mark.parametrize("other_mode", list(MODES))
@pytest.mark.parametrize("capture_mode", list(MODES))
def test_capture_mode_rule_for_another_thread(bound, capture_mode, other_mode):
    s = bound.stream_create()
    ctx = bound.current_context()
    assert bound.begin_capture(s, MODES[capture_mode]) == 0

    def vmm_call_in_mode():
        previous = bound.exchange_capture_mode(MODES[other_mode])
        assert previous == GLOBAL  # every thread starts in GLOBAL mode
        try:
            return _vmm_call(bound)
        finally:
            bound.exchange_capture_mode(previous)

    rc = bound_thread(bound, ctx, vmm_call_in_mode)
    prohibited = capture_mode == "global" and other_mode == "global"
    if prohibited:
        assert rc == E.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and bound.violations == 1
        assert "another thread's" in bound.last_violation()
        assert bound.counter("live_reservations") == 0  # it did not act
        assert bound.is_capturing(s) == (0, E.CU_STREAM_CAPTURE_STATUS_INVALIDATED)
        assert bound.end_capture(s) == E.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    else:
        assert rc == 0 and bound.violations == 0
        assert bound.end_capture(s) == 0
    assert bound.is_capturing(s) == (0, E.CU_STREAM_CAPTURE_STATUS_NONE)
    assert bound.counter("live_graphs") == 0 and bound.violations == (1 if prohibited else 0)


@pytest.mark.parametrize("thread_mode", list(MODES))
@pytest.mark.parametrize("capture_mode", list(MODES))
def test_capture_mode_rule_for_the_capturing_thread(bound, capture_mode, thread_mode):
    s = bound.stream_create()
    previous = bound.exchange_capture_mode(MODES[thread_mode])
    assert bound.begin_capture(s, MODES[capture_mode]) == 0
    rc = _vmm_call(bound)
    bound.exchange_capture_mode(previous)
    prohibited = capture_mode != "relaxed" and thread_mode != "relaxed"
    if prohibited:
        assert rc == E.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and bound.violations == 1
        assert "this thread's" in bound.last_violation()
        assert bound.end_capture(s) == E.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    else:
        assert rc == 0 and bound.end_capture(s) == 0 and bound.violations == 0


def test_thread_local_capture_ignores_other_threads_but_not_its_own(bound):
    s = bound.stream_create()
    ctx = bound.current_context()
    assert bound.begin_capture(s, THREAD_LOCAL) == 0
    assert bound_thread(bound, ctx, _vmm_call, bound) == 0  # another thread, GLOBAL mode: fine
    assert bound.is_capturing(s) == (0, E.CU_STREAM_CAPTURE_STATUS_ACTIVE)
    assert _vmm_call(bound) == E.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED  # its own thread
    assert bound.end_capture(s) == E.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    assert bound.violations == 1


def test_relaxed_capture_prohibits_nobody(bound):
    s = bound.stream_create()
    ctx = bound.current_context()
    assert bound.begin_capture(s, RELAXED) == 0
    assert _vmm_call(bound) == 0
    assert bound_thread(bound, ctx, _vmm_call, bound) == 0
    assert bound.end_capture(s) == 0 and bound.violations == 0


def test_a_prohibited_call_invalidates_every_capture_it_conflicts_with(bound):
    s1, s2, s3 = (bound.stream_create() for _ in range(3))
    ctx = bound.current_context()
    assert bound.begin_capture(s1, GLOBAL) == 0
    assert bound_thread(bound, ctx, lambda: bound.begin_capture(s2, GLOBAL)) == 0
    assert bound_thread(bound, ctx, lambda: bound.begin_capture(s3, RELAXED)) == 0

    # This thread's own GLOBAL capture and the other thread's GLOBAL one conflict; RELAXED does not.
    assert _vmm_call(bound) == E.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    assert "2 capture(s) invalidated" in bound.last_violation()
    assert bound.is_capturing(s2) == (0, E.CU_STREAM_CAPTURE_STATUS_INVALIDATED)
    assert bound.is_capturing(s3) == (0, E.CU_STREAM_CAPTURE_STATUS_ACTIVE)
    assert bound.end_capture(s1) == E.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    # s2 was begun in GLOBAL mode by another thread: only that thread may end it.
    assert bound.end_capture(s2) == E.CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
    assert bound.violations == 2
    assert bound.end_capture(s3) == 0  # RELAXED: any thread may end it
    # s2 stays capturing (invalidated) until ended on its thread; that thread has exited, so the
    # capture goes with its stream.
    assert bound.stream_destroy(s2) == 0 and bound.counter("active_captures") == 0


def test_invalidated_capture_refuses_work_until_ended(bound):
    va, _ = mapped_ok(bound)
    s = bound.stream_create()
    assert bound.begin_capture(s, GLOBAL) == 0
    assert bound.ctx_synchronize() == E.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    assert bound.violations == 1
    # Work on the invalidated stream fails without a new violation (the first one said it).
    assert bound.memset_async(va, 1, 1, s) == E.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    assert bound.violations == 1
    rc, graph = bound.end_capture_graph(s)
    assert (rc, graph) == (E.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, 0)
    assert bound.memset_async(va, 1, 1, s) == 0  # usable again
    assert bound.end_capture(s) == E.CUDA_ERROR_ILLEGAL_STATE  # nothing to end now
    assert bound.violations == 2


def _unsafe_calls(emu, va, handle, ev, other):
    """Every potentially unsafe call, as (name, call); each must not act when prohibited."""
    host = E.ctypes.c_void_p()
    return [
        ("cuMemAddressReserve", lambda: emu.reserve(G)[0]),
        ("cuMemAddressFree", lambda: emu.address_free(va, 2 * G)),
        ("cuMemCreate", lambda: emu.create(G)[0]),
        ("cuMemRelease", lambda: emu.release(handle)),
        ("cuMemMap", lambda: emu.map(va + G, G, handle)),
        ("cuMemUnmap", lambda: emu.unmap(va, G)),
        ("cuMemSetAccess", lambda: emu.set_access(va, G)),
        ("cuMemHostAlloc", lambda: emu.lib.cuMemHostAlloc(E.ctypes.byref(host), 64, 0)),
        ("cuMemFreeHost", lambda: emu.lib.cuMemFreeHost(E.ctypes.c_void_p(va))),
        ("cuEventQuery", lambda: emu.event_query(ev)),
        ("cuEventSynchronize", lambda: emu.event_synchronize(ev)),
        ("cuStreamSynchronize", lambda: emu.stream_synchronize(other)),
        ("cuCtxSynchronize", emu.ctx_synchronize),
        ("cuEventRecord", lambda: emu.event_record(ev, 0)),
        ("cuEventRecord", lambda: emu.event_record(ev, LEGACY)),
        ("cuMemsetD8Async", lambda: emu.memset_async(va, 9, 8, 0)),
        ("cuMemcpyAsync", lambda: emu.memcpy_async(va + 8, va, 8, LEGACY)),
    ]


def test_every_potentially_unsafe_call_is_prohibited_during_a_global_capture(bound):
    va, (h,) = mapped_ok(bound)
    extra = create_ok(bound)
    ev, other = event_ok(bound), bound.stream_create()
    s = bound.stream_create()
    for k, (name, call) in enumerate(_unsafe_calls(bound, va, extra, ev, other)):
        before = {
            n: bound.counter(n) for n in ("live_reservations", "live_handles", "live_mappings")
        }
        assert bound.begin_capture(s, GLOBAL) == 0
        assert call() == E.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, name
        assert bound.violations == k + 1 and bound.last_violation().startswith(name), name
        assert {n: bound.counter(n) for n in before} == before, f"{name} acted"
        assert bound.end_capture(s) == E.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, name
    assert E.ctypes.string_at(va, 16) == b"\x00" * 16  # the memset and copy did not act
    # Stream work on other (non-legacy) streams is not among them.
    n = bound.violations
    assert bound.begin_capture(s, GLOBAL) == 0
    assert bound.event_record(ev, other) == 0 and bound.memset_async(va, 1, 1, PER_THREAD) == 0
    assert bound.memcpy_async(va + 8, va, 8, other) == 0
    assert bound.end_capture(s) == 0 and bound.violations == n


def test_legacy_stream_beside_a_capturing_blocking_stream_is_an_implicit_dependency(bound):
    va, _ = mapped_ok(bound)
    ev = event_ok(bound)
    bound.exchange_capture_mode(RELAXED)  # so the prohibition does not apply: only this rule
    blocking, nonblocking = bound.stream_create(nonblocking=False), bound.stream_create()
    assert bound.begin_capture(nonblocking, RELAXED) == 0
    assert bound.event_record(ev, 0) == 0  # non-blocking capture: the legacy stream is usable
    assert bound.is_capturing(0) == (0, E.CU_STREAM_CAPTURE_STATUS_NONE)
    assert bound.end_capture(nonblocking) == 0
    assert bound.begin_capture(blocking, RELAXED) == 0
    assert bound.is_capturing(0)[0] == E.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT  # a query: no misuse
    assert bound.violations == 0
    assert bound.is_capturing(blocking) == (0, E.CU_STREAM_CAPTURE_STATUS_ACTIVE)
    assert bound.memset_async(va, 1, 1, LEGACY) == E.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    assert bound.violations == 1 and "implicit dependency" in bound.last_violation()
    assert bound.end_capture(blocking) == E.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED


def test_capture_begin_and_end_misuse(bound):
    s = bound.stream_create()
    ctx = bound.current_context()
    assert bound.begin_capture(0, GLOBAL) == E.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    assert bound.begin_capture(LEGACY, RELAXED) == E.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    assert "legacy" in bound.last_violation()
    assert bound.begin_capture(s, 7) == E.CUDA_ERROR_INVALID_VALUE
    assert bound.end_capture(s) == E.CUDA_ERROR_ILLEGAL_STATE
    assert bound.begin_capture(s, THREAD_LOCAL) == 0
    assert bound.begin_capture(s, THREAD_LOCAL) == E.CUDA_ERROR_ILLEGAL_STATE
    assert bound.violations == 5
    assert (
        bound_thread(bound, ctx, bound.end_capture, s) == E.CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
    )
    assert bound.violations == 6
    assert bound.end_capture(s) == E.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    assert bound.begin_capture(PER_THREAD, THREAD_LOCAL) == 0  # per-thread streams can capture
    assert bound.end_capture(PER_THREAD) == 0
    with pytest.raises(RuntimeError):
        bound.exchange_capture_mode(5)
    assert bound.violations == 7


def test_capture_mode_is_per_thread_and_reset_restores_global(bound):
    assert bound.exchange_capture_mode(RELAXED) == GLOBAL
    assert bound.exchange_capture_mode(THREAD_LOCAL) == RELAXED
    assert on_thread(bound.exchange_capture_mode, RELAXED) == GLOBAL  # a new thread: GLOBAL
    assert bound.exchange_capture_mode(THREAD_LOCAL) == THREAD_LOCAL  # untouched by it
    bound.reset()
    assert bound.lib.cuInit(0) == 0
    assert bound.exchange_capture_mode(GLOBAL) == GLOBAL
    assert bound.counter("cuThreadExchangeStreamCaptureMode") == 1


# ---- contexts ----


def test_primary_context_refcount_and_retain_counter(bound):
    assert bound.primary_retains(0) == 1 and bound.counter("cuDevicePrimaryCtxRetain") == 1
    ctx = bound.retain_primary(0)
    assert ctx == bound.current_context() and bound.primary_retains(0) == 2
    assert bound.counter("cuDevicePrimaryCtxRetain") == 2
    assert bound.release_primary(0) == 0 and bound.primary_retains(0) == 1
    assert bound.primary_retains(1) == 0 and bound.primary_retains(-1) == -1
    assert bound.release_primary(0) == 0 and bound.primary_retains(0) == 0
    assert bound.violations == 0


def test_current_context_is_per_thread_and_settable_from_any_thread(bound):
    ctx = bound.current_context()
    assert ctx

    def fresh_thread():
        seen = [bound.current_context()]
        assert bound.set_current_context(ctx) == 0
        seen.append(bound.current_context())
        assert bound.set_current_context(0) == 0
        seen.append(bound.current_context())
        return seen

    assert on_thread(fresh_thread) == [0, ctx, 0]
    assert bound.current_context() == ctx  # this thread's is untouched
    assert bound.violations == 0
