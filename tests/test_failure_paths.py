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
