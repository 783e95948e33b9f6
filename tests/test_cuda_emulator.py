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
    assert time.perf_counter() - t0 >= 0.03
    t0 = time.perf_counter()
    assert bound.unmap(va, G) == 0
    assert time.perf_counter() - t0 < 0.03


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
