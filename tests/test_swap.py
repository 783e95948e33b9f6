"""Swap to host memory (swap_out / swap_in / swap_drop) and victim selection (pick_victims)."""

from __future__ import annotations

import pytest
import torch

import vattention

from support.helpers import inject_backend_fault, page_state
from support.share_helpers import check_pattern, fast_fill, paged_cache


def slot_pages(cache, num_tokens):
    return cache.config.pages_for_tokens(num_tokens)


def test_swap_round_trip_is_bit_identical_into_another_slot(make_cache):
    cache = paged_cache(make_cache, pages=3, max_batch_size=2)
    cfg = cache.config
    n = 2 * cfg.tokens_per_page + 5
    slot = cache.alloc()
    cache.step({slot: n})
    data = fast_fill(cache, slot, 0, n, seed=1)
    handle = cache.swap_out(slot)
    stats = cache.stats()
    assert cache.active_slots() == []
    assert (stats["pages_mapped"], stats["mappings"]) == (0, 0)  # unmapped at once, not idle
    assert stats["swap_host_bytes"] == slot_pages(cache, n) * cfg.page_bytes
    assert stats["swap_out_pages"] == slot_pages(cache, n)
    squatter = cache.alloc()  # takes the old slot: swap-in must go elsewhere
    assert squatter == slot
    restored = cache.swap_in(handle)
    assert restored != slot
    assert cache.seq_len(restored) == n and cache.mapped_tokens(restored) >= n
    check_pattern(cache, restored, 0, n, data)
    stats = cache.stats()
    assert (stats["swap_host_bytes"], stats["swap_handles"]) == (0, 0)
    assert stats["swap_in_pages"] == slot_pages(cache, n)
    end = cfg.max_seq_len
    cache.step({restored: end})  # keeps growing normally
    more = fast_fill(cache, restored, n, end, seed=2)
    check_pattern(cache, restored, 0, n, data)
    check_pattern(cache, restored, n, end, more)


def test_swap_of_an_empty_slot(make_cache):
    cache = make_cache()
    slot = cache.alloc()
    handle = cache.swap_out(slot)
    assert cache.stats()["swap_host_bytes"] == 0
    assert cache.seq_len(cache.swap_in(handle)) == 0


def test_shared_pages_are_swapped_by_reference_then_copied_once(make_cache):
    cache = paged_cache(make_cache, pages=3)
    cfg = cache.config
    P, T = cfg.page_bytes, cfg.num_tensors
    n = 2 * cfg.tokens_per_page + 3
    parent = cache.alloc()
    cache.step({parent: n})
    data = fast_fill(cache, parent, 0, n, seed=3)
    child = cache.fork(parent)
    shared = 2 * T  # two full pages in every tensor
    own = slot_pages(cache, n) - shared  # the partial page, private to each
    h_parent = cache.swap_out(parent)
    stats = cache.stats()
    # The child still maps the shared pages: copying them would free nothing.
    assert stats["swap_host_bytes"] == own * P
    assert stats["swap_device_pages"] == shared
    assert stats["pages_mapped"] == shared + own
    assert cache._core.check_invariants() == ""
    h_child = cache.swap_out(child)
    stats = cache.stats()
    # Now nobody maps them: each shared page goes to host once, for both handles.
    assert stats["swap_host_bytes"] == (shared + 2 * own) * P
    assert (stats["swap_device_pages"], stats["pages_mapped"]) == (0, 0)
    assert stats["swap_out_pages"] == shared + 2 * own
    a, b = cache.swap_in(h_child), cache.swap_in(h_parent)
    check_pattern(cache, a, 0, n, data)
    check_pattern(cache, b, 0, n, data)
    assert cache.stats()["swap_host_bytes"] == 0


def test_swap_in_while_the_sharer_is_alive_maps_the_same_pages(make_cache):
    cache = paged_cache(make_cache, pages=3)
    cfg = cache.config
    n = 2 * cfg.tokens_per_page
    parent = cache.alloc()
    cache.step({parent: n})
    data = fast_fill(cache, parent, 0, n, seed=4)
    child = cache.fork(parent)
    handle = cache.swap_out(child)
    assert cache.stats()["swap_host_bytes"] == 0  # every page is shared with the parent
    child = cache.swap_in(handle)
    stats = cache.stats()
    assert stats["swap_in_pages"] == 0
    assert stats["shared_pages"] == slot_pages(cache, n)
    check_pattern(cache, child, 0, n, data)
    cache.free(parent)
    cache.reclaim()
    check_pattern(cache, child, 0, n, data)


def test_swap_budget_exceeded_is_typed_and_changes_nothing(make_cache):
    cache = paged_cache(make_cache, pages=3, max_batch_size=2)
    cfg = cache.config
    n = cfg.tokens_per_page + 1
    cache.set_swap_budget(cfg.page_bytes * (slot_pages(cache, n) - 1))
    slot = cache.alloc()
    cache.step({slot: n})
    data = fast_fill(cache, slot, 0, n, seed=5)
    before = page_state(cache)
    with pytest.raises(vattention.SwapSpaceError) as info:
        cache.swap_out(slot)
    assert isinstance(info.value, MemoryError)
    assert info.value.bytes_needed == slot_pages(cache, n) * cfg.page_bytes
    assert info.value.bytes_available == (slot_pages(cache, n) - 1) * cfg.page_bytes
    assert page_state(cache) == before
    assert cache.stats()["swap_host_bytes"] == 0
    check_pattern(cache, slot, 0, n, data)
    cache.set_swap_budget(None)
    check_pattern(cache, cache.swap_in(cache.swap_out(slot)), 0, n, data)


def test_swap_budget_constructor_argument(device, layout):
    page = "64KB" if device == "cpu" else "2MB"
    cfg = vattention.KVCacheConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=64,
        max_batch_size=2,
        max_seq_len=1024,
        page_size=page,
        device=device,
        dtype=torch.float16,
        layout=layout,
    )
    with vattention.KVCache(cfg, swap_budget=page) as cache:
        assert cache.stats()["swap_budget"] == cfg.page_bytes
        slot = cache.alloc()
        cache.step({slot: 10})
        with pytest.raises(vattention.SwapSpaceError):
            cache.swap_out(slot)  # K and V: two pages
    with pytest.raises(vattention.ConfigError):
        vattention.KVCache(cfg, swap_budget="lots")


def test_swap_errors_leave_state_unchanged(make_cache):
    cache = paged_cache(make_cache, pages=2, max_batch_size=2)
    cfg = cache.config
    a = cache.alloc()
    cache.step({a: cfg.tokens_per_page})
    data = fast_fill(cache, a, 0, cfg.tokens_per_page, seed=6)
    handle = cache.swap_out(a)
    b, c = cache.alloc(), cache.alloc()
    before = page_state(cache)
    for error, call in [
        (vattention.InvalidSlotError, lambda: cache.swap_out(5)),
        (vattention.InvalidSlotError, lambda: cache.swap_in(handle + 100)),  # unknown
        (vattention.InvalidSlotError, lambda: cache.swap_in(handle)),  # no slot free
        (vattention.InvalidSlotError, lambda: cache.swap_drop(handle + 100)),
    ]:
        with pytest.raises(error):
            call()
        assert page_state(cache) == before
    cache.free(c)
    with pytest.raises(vattention.InvalidSlotError):
        cache.swap_out(c)  # not active
    restored = cache.swap_in(handle)
    check_pattern(cache, restored, 0, cfg.tokens_per_page, data)
    with pytest.raises(vattention.InvalidSlotError, match="already swapped in"):
        cache.swap_in(handle)  # consumed
    cache.free(b)


def test_swap_in_out_of_pages_changes_nothing(make_cache):
    cache = paged_cache(make_cache, pages=2, max_batch_size=2)
    cfg = cache.config
    length = 2 * cfg.tokens_per_page
    cache.set_memory_budget(slot_pages(cache, length) * cfg.page_bytes)
    a = cache.alloc()
    cache.step({a: length})
    data = fast_fill(cache, a, 0, length, seed=7)
    handle = cache.swap_out(a)
    b = cache.alloc()
    cache.step({b: length})  # the budget is full again
    before = page_state(cache)
    with pytest.raises(vattention.OutOfPagesError) as info:
        cache.swap_in(handle)
    assert info.value.pages_needed == slot_pages(cache, length)
    assert page_state(cache) == before
    cache.free(b)  # idle pages are reclaimed for the swap-in
    restored = cache.swap_in(handle)
    check_pattern(cache, restored, 0, length, data)


def test_swap_drop_and_close_release_everything(make_cache):
    cache = paged_cache(make_cache, pages=2)
    cfg = cache.config
    a = cache.alloc()
    cache.step({a: cfg.tokens_per_page})
    b = cache.fork(a)
    h1 = cache.swap_out(a)
    h2 = cache.swap_out(b)
    cache.swap_drop(h1)
    pages = slot_pages(cache, cfg.tokens_per_page)
    assert cache.stats()["swap_host_bytes"] == pages * cfg.page_bytes
    cache.swap_drop(h2)
    stats = cache.stats()
    assert (stats["swap_host_bytes"], stats["swap_handles"], stats["pages_mapped"]) == (0, 0, 0)
    c = cache.alloc()
    cache.step({c: cfg.tokens_per_page})
    d = cache.fork(c)
    cache.swap_out(c)  # a handle holding device references at close
    assert cache.stats()["swap_device_pages"] > 0
    assert cache._core.check_invariants() == ""
    cache.close()
    with pytest.raises(vattention.CacheClosedError):
        cache.swap_in(1)
    assert d is not None


# ---- pick_victims --------------------------------------------------------------------------------


def test_pick_victims_least_recently_stepped_then_fewest_tokens(make_cache):
    cache = paged_cache(make_cache, pages=4, max_batch_size=4)
    cfg = cache.config
    P, tpp = cfg.page_bytes, cfg.tokens_per_page
    a, b, c, d = (cache.alloc() for _ in range(4))
    cache.step({a: 3 * tpp, b: tpp, c: 2 * tpp})  # same step: ties by fewest tokens
    cache.step({d: 1})  # d was stepped last
    assert cache.pick_victims(0) == []
    assert cache.pick_victims(1) == [b]
    one = slot_pages(cache, tpp) * P
    assert cache.pick_victims(one) == [b]
    assert cache.pick_victims(one + 1) == [b, c]
    assert cache.pick_victims(10**15) == [b, c, a, d]  # not enough: everyone
    cache.step({b: tpp})  # b becomes the most recent
    assert cache.pick_victims(1) == [c]


def test_pick_victims_counts_only_pages_that_would_be_freed(make_cache):
    cache = paged_cache(make_cache, pages=3, max_batch_size=3)
    cfg = cache.config
    P, tpp = cfg.page_bytes, cfg.tokens_per_page
    parent = cache.alloc()
    cache.step({parent: 2 * tpp})
    child = cache.fork(parent)  # stepped never after fork: least recent
    cache.step({parent: 2 * tpp})
    # The child's pages are all shared with the parent: preempting it alone frees nothing.
    assert cache.pick_victims(1) == [child, parent]
    assert cache.pick_victims(slot_pages(cache, 2 * tpp) * P) == [child, parent]
    with pytest.raises(vattention.ConfigError):
        cache.pick_victims(-1)


# ---- driver failures part-way: rolled back -------------------------------------------------------


@pytest.mark.parametrize("op", ["map", "set_access"])
def test_driver_failure_in_fork_and_swap_in_rolls_back(make_cache, device, op):
    cache = paged_cache(make_cache, pages=3, max_batch_size=3)
    cfg = cache.config
    n = cfg.tokens_per_page + 3
    src = cache.alloc()
    cache.step({src: n})
    data = fast_fill(cache, src, 0, n, seed=8)
    mapped = cache.stats()["pages_mapped"]
    inject_backend_fault(cache, op, 2)
    with pytest.raises(vattention.DriverError):
        cache.fork(src)
    assert cache.active_slots() == [src] and cache.stats()["pages_mapped"] == mapped
    assert cache._core.check_invariants() == ""
    handle = cache.swap_out(src)
    inject_backend_fault(cache, op, 2)
    with pytest.raises(vattention.DriverError):
        cache.swap_in(handle)
    assert cache.active_slots() == [] and cache.stats()["pages_mapped"] == 0
    assert cache._core.check_invariants() == ""
    check_pattern(cache, cache.swap_in(handle), 0, n, data)  # the handle survived


def test_driver_failure_while_swapping_out_keeps_the_slot(make_cache, device):
    cache = paged_cache(make_cache, pages=2)
    cfg = cache.config
    a = cache.alloc()
    cache.step({a: cfg.tokens_per_page})
    data = fast_fill(cache, a, 0, cfg.tokens_per_page, seed=9)
    b = cache.fork(a)

    def state():  # call counters aside: the undone unmap was a call
        return {k: v for k, v in page_state(cache).items() if not k.endswith("_calls")}

    before = state()
    inject_backend_fault(cache, "unmap", 2)  # the slot's second tensor
    with pytest.raises(vattention.DriverError):
        cache.swap_out(b)
    assert state() == before
    stats = cache.stats()
    assert (stats["swap_handles"], stats["swap_host_bytes"]) == (0, 0)
    assert cache._core.check_invariants() == ""
    check_pattern(cache, b, 0, cfg.tokens_per_page, data)
