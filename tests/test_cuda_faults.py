"""Fault injection at every driver entry point the cache uses, on the emulated CUDA backend.

Each failure during reserve, step, reclaim, free and close must surface as a typed error
(OutOfPagesError for device out-of-memory, DriverError naming the call otherwise), leave every
slot's mapped state and data exactly as before, and leave the cache usable (or, for close, closed
with everything given back).
"""

from __future__ import annotations

import pytest

import vattention

from support.cuda_testing import PAGE, E, assert_clean, make, needs_emulation, pages_state
from support.helpers import check_pattern, fill_pattern

pytestmark = needs_emulation


STEP_ENTRIES = ["cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuCtxGetCurrent"]
FAULTS = [E.CUDA_ERROR_UNKNOWN, E.CUDA_ERROR_OUT_OF_MEMORY]


def _expect_typed(entry, code):
    if entry == "cuMemCreate" and code == E.CUDA_ERROR_OUT_OF_MEMORY:
        return vattention.OutOfPagesError
    return vattention.DriverError


@pytest.mark.parametrize("code", FAULTS, ids=["UNKNOWN", "OOM"])
@pytest.mark.parametrize("entry", STEP_ENTRIES)
@pytest.mark.parametrize("nth", [1, 3])
def test_fault_during_step_is_typed_and_transactional(emu, entry, nth, code):
    with make(layout="layer") as cache:
        cfg = cache.config
        a, b = cache.alloc(), cache.alloc()
        cache.step({a: 10})
        fill = fill_pattern(cache, a, 0, 10, seed=3)
        before, live = pages_state(cache), emu.live()
        emu.inject_fault(entry, nth, code)
        with pytest.raises(_expect_typed(entry, code)):
            cache.step({a: 3 * cfg.tokens_per_page, b: 2 * cfg.tokens_per_page})
        assert pages_state(cache) == before
        assert emu.counter("live_mappings") == live["live_mappings"]
        assert cache._core.check_invariants() == ""
        check_pattern(cache, a, 0, 10, fill)
        cache.step({a: 3 * cfg.tokens_per_page, b: 2 * cfg.tokens_per_page})  # usable again
        assert cache.mapped_tokens(b) >= 2 * cfg.tokens_per_page


@pytest.mark.parametrize("code", FAULTS, ids=["UNKNOWN", "OOM"])
@pytest.mark.parametrize("nth", [1, 4])
def test_fault_during_reserve_keeps_no_pages(emu, nth, code):
    with make() as cache:
        emu.inject_fault("cuMemCreate", nth, code)
        with pytest.raises(_expect_typed("cuMemCreate", code)):
            cache.reserve(8 * PAGE)
        assert cache.stats()["pages_total"] == 0 and emu.counter("live_handles") == 0
        cache.reserve(8 * PAGE)
        assert cache.stats()["pages_total"] == 8


@pytest.mark.parametrize(
    "entry", ["cuMemUnmap", "cuEventQuery", "cuEventDestroy", "cuCtxGetCurrent"]
)
def test_fault_during_reclaim_is_typed_and_retry_works(emu, entry):
    with make() as cache:
        a, b = cache.alloc(), cache.alloc()
        cache.step({a: 100, b: 100})
        fill = fill_pattern(cache, b, 0, 100, seed=5)
        cache.free(a)
        emu.inject_fault(entry, 1, E.CUDA_ERROR_UNKNOWN)
        with pytest.raises(vattention.DriverError) as info:
            cache.reclaim()
        assert info.value.call == entry
        assert cache._core.check_invariants() == ""
        check_pattern(cache, b, 0, 100, fill)
        cache.reclaim()
        assert cache.mapped_tokens(a) == 0 and cache.mapped_tokens(b) >= 100


@pytest.mark.parametrize("entry", ["cuEventCreate", "cuEventRecord"])
def test_fault_recording_the_free_fence_leaves_slot_active(emu, entry):
    with make() as cache:
        a = cache.alloc()
        cache.step({a: 100})
        emu.inject_fault(entry, 1, E.CUDA_ERROR_UNKNOWN)
        with pytest.raises(vattention.DriverError):
            cache.free(a)
        assert cache.active_slots() == [a] and emu.counter("live_events") == 0
        cache.free(a)
        assert cache.active_slots() == []


# A driver failure inside close() (its device synchronisation, an unmap, a page release) is raised
# typed, and the cache is closed all the same with nothing left behind.
@pytest.mark.checks_own_cleanup
@pytest.mark.parametrize("entry", ["cuMemUnmap", "cuCtxSynchronize", "cuMemRelease"])
def test_fault_during_close_is_typed_closes_and_cleans_up(emu, entry):
    cache = make()
    a = cache.alloc()
    cache.step({a: 100})
    emu.inject_fault(entry, 1, E.CUDA_ERROR_UNKNOWN)
    with pytest.raises(vattention.DriverError) as info:
        cache.close()
    assert info.value.call == entry
    assert cache.closed
    cache.close()  # idempotent
    with pytest.raises(vattention.CacheClosedError):
        cache.alloc()
    del cache, info
    assert_clean(emu)
