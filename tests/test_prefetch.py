"""Background pre-mapping: prefetch/wait, look-ahead, shortfalls, background errors, budgets."""

from __future__ import annotations

import time

import pytest

import vattention
from vattention import DriverError, OutOfPagesError

from support.helpers import check_pattern, fill_pattern, inject_backend_fault


def test_prefetched_pages_need_no_map_calls_in_step(make_cache):
    # page counts without the tile rule (test_read_tail.py)
    cache = make_cache(num_kv_heads=8, head_dim=128, kv_tile_tokens=0)
    cfg = cache.config
    a, b = cache.alloc(), cache.alloc()
    cache.step({a: 1, b: 1})
    target = {a: 3 * cfg.tokens_per_page + 5, b: cfg.tokens_per_page + 1}
    cache.prefetch(target)
    cache.wait()
    before = cache.stats()
    assert before["prefetch_map_calls"] > 0
    assert all(cache.mapped_tokens(s) >= n for s, n in target.items())
    cache.step(target)
    after = cache.stats()
    assert after["step_map_calls"] == before["step_map_calls"]  # zero synchronous maps
    assert after["map_calls"] == before["map_calls"]


def test_step_joins_outstanding_prefetch_and_maps_the_rest(make_cache):
    cache = make_cache(num_kv_heads=8, head_dim=128)
    cfg = cache.config
    s = cache.alloc()
    cache.prefetch({s: cfg.tokens_per_page})  # no wait(): step() must join it
    cache.step({s: 3 * cfg.tokens_per_page})  # and map what is still missing
    assert cache.mapped_tokens(s) >= 3 * cfg.tokens_per_page
    assert cache._core.check_invariants() == ""


def test_lookahead_from_config_and_per_call(make_cache):
    cache = make_cache(num_kv_heads=8, head_dim=128, lookahead_tokens=100)
    cfg = cache.config
    s = cache.alloc()
    cache.prefetch({s: cfg.tokens_per_page})  # + 100 from the config
    cache.wait()
    assert cache.mapped_tokens(s) >= cfg.tokens_per_page + 100
    t = cache.alloc()
    cache.prefetch({t: 1}, lookahead_tokens=2 * cfg.tokens_per_page)
    cache.wait()
    assert cache.mapped_tokens(t) >= 2 * cfg.tokens_per_page + 1
    assert cache.stats()["lookahead_tokens"] == 100


def test_lookahead_is_capped_at_max_seq_len(make_cache):
    cache = make_cache(lookahead_tokens=10**6)
    s = cache.alloc()
    cache.prefetch({s: 1})
    cache.wait()
    assert cache.mapped_tokens(s) == cache.config.max_seq_len


def test_prefetch_shortfall_is_recorded_not_raised(make_cache):
    # page counts without the tile rule (test_read_tail.py)
    cache = make_cache(num_kv_heads=8, head_dim=128, kv_tile_tokens=0)
    cfg = cache.config
    per_index = cfg.num_tensors
    cache.set_memory_budget(2 * per_index * cfg.page_bytes)
    s = cache.alloc()
    cache.prefetch({s: 3 * cfg.tokens_per_page})  # wants 3 page indices, 2 allowed
    cache.wait()
    stats = cache.stats()
    assert stats["prefetch_shortfall_pages"] == 3 * per_index
    assert stats["oom_events"] == 0
    cache.step({s: 2 * cfg.tokens_per_page})  # the current need fits: no error
    with pytest.raises(OutOfPagesError):
        cache.step({s: 2 * cfg.tokens_per_page + 1})  # this one does not


def test_prefetch_validates_input_at_call_time(make_cache):
    cache = make_cache()
    s = cache.alloc()
    with pytest.raises(vattention.SequenceTooLongError):
        cache.prefetch({s: cache.config.max_seq_len + 1})
    with pytest.raises(vattention.InvalidSlotError):
        cache.prefetch({s + 1: 5})
    with pytest.raises(vattention.ConfigError, match="lookahead_tokens=-3"):
        cache.prefetch({s: 5}, lookahead_tokens=-3)


def test_prefetch_of_a_slot_freed_meanwhile_is_skipped(make_cache):
    cache = make_cache()
    s = cache.alloc()
    cache.step({s: 1})
    cache.free(s)
    cache.prefetch({})
    cache.wait()
    assert cache._core.check_invariants() == ""


@pytest.mark.parametrize("op", ["map", "set_access", "create_page"])
def test_background_driver_error_surfaces_typed_on_next_call(make_cache, op):
    # page counts without the tile rule (test_read_tail.py)
    cache = make_cache(num_kv_heads=8, head_dim=128, kv_tile_tokens=0)
    s = cache.alloc()
    cache.step({s: 1})
    written = fill_pattern(cache, s, 0, 1, seed=3)
    call, match = inject_backend_fault(cache, op, 1)
    cache.prefetch({s: 3 * cache.config.tokens_per_page})
    with pytest.raises(DriverError, match=match) as info:
        cache.wait()
    assert info.value.call == call
    cache.wait()  # reported once, then cleared
    check_pattern(cache, s, 0, 1, written)
    assert cache._core.check_invariants() == ""
    cache.step({s: 3 * cache.config.tokens_per_page})  # and the cache keeps working


def test_background_error_raised_by_next_call_of_any_kind(make_cache):
    cache = make_cache(num_kv_heads=8, head_dim=128)
    s = cache.alloc()
    _, match = inject_backend_fault(cache, "map", 1)
    cache.prefetch({s: 2 * cache.config.tokens_per_page})
    # stats() never raises background errors; prefetch_errors counts them when they are recorded.
    deadline = time.monotonic() + 10
    while cache.stats()["prefetch_errors"] == 0:
        assert time.monotonic() < deadline, "the prefetch thread never ran"
        time.sleep(0.005)
    with pytest.raises(DriverError, match=match):
        cache.alloc()
    assert cache.alloc() != s  # reported once; the cache works on


def test_set_memory_budget_shrinks_reclaims_and_reports_excess(make_cache):
    # page counts without the tile rule (test_read_tail.py)
    cache = make_cache(num_kv_heads=8, head_dim=128, kv_tile_tokens=0)
    cfg = cache.config
    P, T = cfg.page_bytes, cfg.num_tensors
    a, b, c = cache.alloc(), cache.alloc(), cache.alloc()
    cache.step({a: 2 * cfg.tokens_per_page, b: cfg.tokens_per_page, c: cfg.tokens_per_page})
    cache.free(c)  # idle: 1 index
    cache.reserve((4 + 2) * T * P)  # 2 free indices
    assert cache.stats()["pages_total"] == 6 * T
    # Lower to 4 indices: the 2 free ones go; nothing else has to.
    assert cache.set_memory_budget(4 * T * P) == 0
    assert cache.stats()["pages_total"] == 4 * T and cache.stats()["idle_slots_with_pages"] == 1
    # Lower to 3: the idle slot's pages go.
    assert cache.set_memory_budget(3 * T * P) == 0
    assert cache.stats()["pages_total"] == 3 * T and cache.stats()["idle_slots_with_pages"] == 0
    # Lower to 1: active tokens need 3 indices; 2 indices' worth cannot be freed without preemption.
    assert cache.set_memory_budget(1 * T * P) == 2 * T * P
    assert cache.stats()["pages_total"] == 3 * T
    with pytest.raises(OutOfPagesError):
        cache.step({a: 3 * cfg.tokens_per_page})
    # Raising it allows growth again.
    assert cache.set_memory_budget(None) == 0
    cache.step({a: 3 * cfg.tokens_per_page})
    assert cache.stats()["memory_budget"] == -1


def test_set_memory_budget_trims_lookahead_of_active_slots(make_cache):
    # page counts without the tile rule (test_read_tail.py)
    cache = make_cache(num_kv_heads=8, head_dim=128, kv_tile_tokens=0)
    cfg = cache.config
    T, P = cfg.num_tensors, cfg.page_bytes
    s = cache.alloc()
    cache.step({s: 1})
    cache.prefetch({s: 1}, lookahead_tokens=3 * cfg.tokens_per_page)  # 4 indices mapped
    cache.wait()
    assert cache.stats()["pages_mapped"] == 4 * T
    assert cache.set_memory_budget(2 * T * P) == 0
    assert cache.stats()["pages_total"] == 2 * T
    assert cache.mapped_tokens(s) >= 1
