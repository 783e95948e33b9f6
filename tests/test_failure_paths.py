"""The staging page of ensure_private and swap's page copies is never back in the pool while still
mapped, and rollbacks undo exactly what was done (nothing they did not map). Runs on the host
backend and the emulated CUDA backend, whose fixture fails the test on any driver-rule violation
or mapping left behind after close()."""

from __future__ import annotations

import pytest

import vattention

from support.helpers import check_pattern, fill_pattern, inject_backend_fault, page_state


@pytest.fixture
def page_size():
    return "64KB"  # several pages per slot at small sizes


def _forked(make_cache):
    cache = make_cache(max_batch_size=4, max_seq_len=4096)
    parent = cache.alloc()
    tokens = 3 * cache.config.tokens_per_page + 5
    cache.step({parent: tokens})
    written = fill_pattern(cache, parent, 0, tokens, seed=7)
    child = cache.fork(parent)
    return cache, parent, child, tokens, written


def _outcome_is_clean(cache, slots_written):
    assert cache._core.check_invariants() == ""
    for slot, (tokens, written) in slots_written.items():
        check_pattern(cache, slot, 0, tokens, written)


def test_ensure_private_staging_unmap_failure_leaves_no_mapped_page_in_the_pool(make_cache):
    cache, parent, child, tokens, written = _forked(make_cache)
    inject_backend_fault(cache, "unmap", 1)  # ensure_private's first unmap: the staging page
    try:
        copied = cache.ensure_private(child, 0)
    except vattention.DriverError:
        copied = None
    _outcome_is_clean(cache, {parent: (tokens, written), child: (tokens, written)})
    if copied is not None:
        assert copied == cache.stats()["cow_pages_copied"] - cache.config.num_tensors
    # The staging address is usable again (on CUDA a stale mapping there is a rule violation).
    cache.ensure_private(child, 0)
    _outcome_is_clean(cache, {parent: (tokens, written), child: (tokens, written)})
    # The device fixture then checks, after close(): no violation, nothing left mapped.


def test_swap_out_staging_unmap_failure_leaves_no_mapped_page_in_the_pool(make_cache):
    cache, parent, child, tokens, written = _forked(make_cache)
    handle = cache.swap_out(child)  # full pages kept on the device by reference
    cache.free(parent)  # now only the handle and an idle slot hold them
    other = cache.alloc()
    cache.step({other: 10})
    inject_backend_fault(cache, "unmap", 1)  # the first unmap of swap_out: a staged page
    try:
        cache.swap_out(other)
    except vattention.DriverError:
        pass
    assert cache._core.check_invariants() == ""
    slot = cache.swap_in(handle)
    check_pattern(cache, slot, 0, tokens, written)
    assert cache._core.check_invariants() == ""


@pytest.mark.parametrize("op,nth", [("map", 2), ("set_access", 2)])
def test_ensure_private_rollback_undoes_exactly_what_it_did(make_cache, op, nth):
    # ensure_private's calls per page: map+set_access (staging), unmap (staging), unmap (slot),
    # map+set_access (slot). The 2nd map/set_access is the slot's: its rollback must not unmap a
    # page it never mapped (map failed) and must put the shared page back.
    cache, parent, child, tokens, written = _forked(make_cache)
    before = page_state(cache)
    call, match = inject_backend_fault(cache, op, nth)
    with pytest.raises(vattention.DriverError, match=match) as info:
        cache.ensure_private(child, 0)
    assert info.value.call == call
    after = page_state(cache)
    for key in ("mappings", "mapped_tokens", "seq_lens", "active_slots", "pages_mapped"):
        assert after[key] == before[key], key
    _outcome_is_clean(cache, {parent: (tokens, written), child: (tokens, written)})
    assert cache.ensure_private(child, 0) > 0
    _outcome_is_clean(cache, {parent: (tokens, written), child: (tokens, written)})


# Counters of time, which a failed step spends like any other (creating, then destroying again,
# the pages it made); and oom_events, which counts the OutOfPagesError raised.
_SPENT = ("step_page_create_ns", "page_destroy_ns", "background_page_create_ns")


def _fail_page_creation(cache, nth, out_of_memory):
    """Make the nth next page creation fail: a driver error, or the device out of memory."""
    if cache.config.device == "cpu":
        cache._core.inject_host_fault("create_page", nth, out_of_memory)
        return
    from support.cuda_setup import CUDA_MODE, cuda_emu

    if CUDA_MODE != "emulated":
        pytest.skip("faults are injected through the host hook or the CUDA emulation only")
    code = cuda_emu.CUDA_ERROR_OUT_OF_MEMORY if out_of_memory else cuda_emu.CUDA_ERROR_UNKNOWN
    cuda_emu.Emulator.load().inject_fault("cuMemCreate", nth, code if nth > 0 else 0)


@pytest.mark.parametrize("out_of_memory", [False, True], ids=["driver-error", "out-of-memory"])
def test_a_step_failing_at_page_creation_k_leaves_every_count_as_it_was(make_cache, out_of_memory):
    """A step whose k-th page creation fails, for every k it reaches, raises and leaves stats()
    as it was but for time spent: the pages it created before the failure are destroyed again
    and counted neither in pages_created nor in step_pages_created (both counted them before,
    with the pool keeping them; pages_created and step_pages_created then went up by k - 1)."""

    def grown():
        cache = make_cache(max_batch_size=4, max_seq_len=4096)
        slot = cache.alloc()
        cache.step({slot: 700})
        written = fill_pattern(cache, slot, 0, 700, seed=3)
        return cache, slot, written

    probe, slot, _ = grown()
    before = probe.stats()["step_pages_created"]
    probe.step({slot: 1600})
    creations = probe.stats()["step_pages_created"] - before
    assert creations > 2
    for k in range(1, creations + 1):
        cache, slot, written = grown()
        stats = cache.stats()
        _fail_page_creation(cache, k, out_of_memory)
        error = vattention.OutOfPagesError if out_of_memory else vattention.DriverError
        with pytest.raises(error):
            cache.step({slot: 1600})
        _fail_page_creation(cache, 0, out_of_memory)
        after = cache.stats()
        for key in _SPENT:
            assert after.pop(key) >= stats.pop(key), key
        assert after.pop("oom_events") == stats.pop("oom_events") + out_of_memory
        assert after == stats, f"page creation {k} of {creations} failed"
        _outcome_is_clean(cache, {slot: (700, written)})
        # The step then succeeds, and both counts count its pages.
        cache.step({slot: 1600})
        done = cache.stats()
        assert done["pages_created"] - stats["pages_created"] == creations
        assert done["step_pages_created"] - stats["step_pages_created"] == creations
        cache.close()
