"""Every bad input gets a typed exception naming the value and the limit, and changes nothing."""

from __future__ import annotations

import pytest
import torch

import vattention
from vattention import (
    CacheClosedError,
    ConfigError,
    InvalidSlotError,
    OutOfPagesError,
    SequenceTooLongError,
)

from support.helpers import check_pattern, fill_pattern, inject_backend_fault, page_state


@pytest.fixture
def busy_cache(make_cache):
    """Two active slots holding data, one idle slot holding pages, one free slot."""
    cache = make_cache(max_batch_size=4, max_seq_len=4096)
    a, b, c = cache.alloc(), cache.alloc(), cache.alloc()
    cache.step({a: 700, b: 300, c: 100})
    cache.free(c)
    written = {a: fill_pattern(cache, a, 0, 700, seed=1), b: fill_pattern(cache, b, 0, 300, seed=2)}
    return cache, written


def assert_unchanged(cache, before, written):
    assert page_state(cache) == before
    for slot, data in written.items():
        check_pattern(cache, slot, 0, len(data[0][0]), data)
    assert cache._core.check_invariants() == ""


@pytest.mark.parametrize(
    "length,match",
    [
        (4097, r"seq_lens\[slot=0\]=4097 exceeds max_seq_len.*\[0, 4096\]"),
        (-1, r"seq_lens\[slot=0\]=-1 is negative.*\[0, 4096\]"),
    ],
)
def test_bad_length(busy_cache, length, match):
    cache, written = busy_cache
    before = page_state(cache)
    with pytest.raises(SequenceTooLongError, match=match) as info:
        cache.step({0: length, 1: 4000})  # the valid entry must not be applied either
    assert info.value.seq_len == length and info.value.max_seq_len == 4096
    assert_unchanged(cache, before, written)


@pytest.mark.parametrize("call", ["step", "free", "mapped_tokens", "seq_len"])
@pytest.mark.parametrize("slot", [4, -1, 10**6])
def test_slot_out_of_range(busy_cache, call, slot):
    cache, written = busy_cache
    before = page_state(cache)
    with pytest.raises(InvalidSlotError, match=rf"slot={slot} is out of range \[0, 4\]?"):
        if call == "step":
            cache.step({slot: 1})
        else:
            getattr(cache, call)(slot)
    assert_unchanged(cache, before, written)


def test_step_on_unallocated_slot(busy_cache):
    cache, written = busy_cache
    before = page_state(cache)
    with pytest.raises(InvalidSlotError, match=r"slot=2 has length 5 but is not allocated"):
        cache.step({0: 800, 2: 5})  # slot 2 was freed (idle)
    with pytest.raises(InvalidSlotError, match=r"slot=3 has length 0 but is not allocated"):
        cache.step({3: 0})
    with pytest.raises(InvalidSlotError, match=r"slot=3 has length 9 but is not allocated"):
        cache.step([0, 0, 0, 9])
    assert_unchanged(cache, before, written)


def test_double_free_and_free_unallocated(busy_cache):
    cache, written = busy_cache
    before = page_state(cache)
    with pytest.raises(InvalidSlotError, match=r"slot=2 is not allocated \(already freed"):
        cache.free(2)
    with pytest.raises(InvalidSlotError, match=r"slot=3 is not allocated"):
        cache.free(3)
    assert_unchanged(cache, before, written)


def test_wrong_sequence_length_and_types(busy_cache):
    cache, written = busy_cache
    before = page_state(cache)
    with pytest.raises(InvalidSlotError, match=r"seq_lens has 3 entries.*max_batch_size=4"):
        cache.step([1, 2, 3])
    with pytest.raises(TypeError, match="must be integers"):
        cache.step({0: 1.5})
    with pytest.raises(TypeError, match="must be integers"):
        cache.step({"a": 1})
    with pytest.raises(ConfigError, match="1-D"):
        cache.step(torch.zeros(2, 2, dtype=torch.int64))
    assert_unchanged(cache, before, written)


def test_alloc_with_no_free_slot(busy_cache):
    cache, written = busy_cache
    cache.alloc(), cache.alloc()  # idle slot 2 and free slot 3
    before = page_state(cache)
    with pytest.raises(InvalidSlotError, match=r"no free slot: all max_batch_size=4 slots"):
        cache.alloc()
    assert_unchanged(cache, before, written)


def test_out_of_pages_is_transactional(make_cache):
    cache = make_cache(
        num_kv_heads=8, head_dim=128, max_batch_size=4, max_seq_len=4096, kv_tile_tokens=0
    )  # page counts without the tile rule (test_read_tail.py)
    cfg = cache.config
    per_index = cfg.num_tensors
    budget_pages = cfg.pages_for_tokens(cfg.tokens_per_page) * 3  # 3 page indices in all
    cache.set_memory_budget(budget_pages * cfg.page_bytes)
    a, b = cache.alloc(), cache.alloc()
    cache.step({a: 1, b: 1})
    written = {a: fill_pattern(cache, a, 0, 1, seed=1), b: fill_pattern(cache, b, 0, 1, seed=2)}
    before = page_state(cache)
    # a fits (one more page index), b does not: the whole call fails, a is not grown either.
    with pytest.raises(OutOfPagesError, match=r"needs \d+ more pages.*only \d+ can be had") as info:
        cache.step({a: cfg.tokens_per_page + 1, b: 2 * cfg.tokens_per_page + 1})
    assert info.value.pages_needed == 3 * per_index
    assert info.value.pages_available == 1 * per_index
    assert isinstance(info.value, MemoryError)
    assert_unchanged(cache, before, written)
    assert cache.stats()["oom_events"] == 1
    cache.step({a: cfg.tokens_per_page + 1})  # still usable: the part that fits succeeds
    assert cache.mapped_tokens(a) >= cfg.tokens_per_page + 1


def test_out_of_pages_does_not_touch_idle_slots(make_cache):
    # page counts without the tile rule (test_read_tail.py)
    cache = make_cache(num_kv_heads=8, head_dim=128, max_batch_size=4, kv_tile_tokens=0)
    cfg = cache.config
    cache.set_memory_budget(2 * cfg.pages_for_tokens(1) * cfg.page_bytes)
    a, b = cache.alloc(), cache.alloc()
    cache.step({a: 1, b: 1})
    cache.free(b)  # idle with one page index
    written = {a: fill_pattern(cache, a, 0, 1, seed=1)}
    before = page_state(cache)
    with pytest.raises(OutOfPagesError):
        cache.step({a: 3 * cfg.tokens_per_page})  # needs 2 more indices; 1 reclaimable
    assert_unchanged(cache, before, written)
    assert cache.stats()["idle_slots_with_pages"] == 1


@pytest.mark.parametrize("op", ["map", "set_access", "create_page"])
def test_backend_failure_mid_step_rolls_back(make_cache, op):
    cache = make_cache(max_batch_size=4)
    a, b = cache.alloc(), cache.alloc()
    cache.step({a: 10})
    written = {a: fill_pattern(cache, a, 0, 10, seed=1)}
    before = page_state(cache)
    call, match = inject_backend_fault(cache, op, 2 if op != "create_page" else 1)
    with pytest.raises(vattention.DriverError, match=match) as info:
        cache.step({a: 3000, b: 2000})
    assert info.value.call == call
    after = page_state(cache)
    # Mapped state is as before; pages obtained for the call are back in the pool as free pages.
    for key in ("pages_mapped", "mappings", "mapped_tokens", "seq_lens", "active_slots"):
        assert after[key] == before[key], key
    check_pattern(cache, a, 0, 10, written[a])
    assert cache._core.check_invariants() == ""
    cache.step({a: 3000, b: 2000})  # and the cache keeps working
    assert cache.mapped_tokens(b) >= 2000


def test_reserve_beyond_budget(make_cache):
    cache = make_cache(memory_budget="1MB", page_size="64KB")
    before = page_state(cache)
    with pytest.raises(OutOfPagesError, match=r"exceeds the memory budget of 1048576 bytes"):
        cache.reserve("2MB")
    assert page_state(cache) == before
    cache.reserve("1MB")
    assert cache.stats()["pages_total"] == 16


def test_bad_constructor_arguments():
    cfg = vattention.KVCacheConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=64,
        max_batch_size=1,
        max_seq_len=64,
        dtype=torch.float16,
        page_size="64KB",
    )
    import dataclasses

    with pytest.raises(ConfigError, match="reclaim='lazy'"):
        dataclasses.replace(cfg, reclaim="lazy")
    with pytest.raises(ConfigError, match="memory_budget='lots'"):
        vattention.KVCache(cfg, memory_budget="lots")
    with pytest.raises(ConfigError, match="lookahead_tokens=-4 must be an int >= 0"):
        dataclasses.replace(cfg, lookahead_tokens=-4)
    with pytest.raises(ConfigError, match="KVCacheConfig"):
        vattention.KVCache({"num_layers": 1})


def test_layer_index_out_of_range(make_cache):
    cache = make_cache(num_layers=2)
    with pytest.raises(ConfigError, match=r"layer=2 is out of range \[0, 2\) \(num_layers=2\)"):
        cache.layer(2)
    with pytest.raises(ConfigError, match=r"layer=-1 is out of range"):
        cache.layer(-1)


def test_use_after_close(make_cache):
    cache = make_cache()
    slot = cache.alloc()
    cache.step({slot: 10})
    cache.close()
    cache.close()  # idempotent
    for call in (
        lambda: cache.alloc(),
        lambda: cache.step({slot: 11}),
        lambda: cache.free(slot),
        lambda: cache.stats(),
        lambda: cache.layer(0),
        lambda: cache.reserve(1),
        lambda: cache.reclaim(),
        lambda: cache.shrink(),
        lambda: cache.mapped_tokens(0),
        lambda: cache.prefetch({slot: 12}),
        lambda: cache.wait(),
        lambda: cache.set_memory_budget(None),
    ):
        with pytest.raises(CacheClosedError, match="closed"):
            call()
