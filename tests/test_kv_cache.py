"""KVCache behaviour: data, growth, reuse, deferred reclamation, pool management."""

from __future__ import annotations

import torch

import vattention

from support.helpers import check_pattern, fill_pattern, kv_views


def _all_layers(cache):
    """k_cache/v_cache where torch can wrap the memory; host aliases on the CUDA emulation."""
    if cache.config.device == "cpu" or torch.cuda.is_available():
        return list(zip(cache.k_cache, cache.v_cache))
    return [kv_views(cache, i) for i in range(cache.config.num_layers)]


def test_tensor_shapes_strides_and_stable_addresses(make_cache):
    cache = make_cache()
    cfg = cache.config
    for i in range(cfg.num_layers):
        k, v = kv_views(cache, i)
        assert k.shape == (cfg.max_batch_size, cfg.max_seq_len, cfg.num_kv_heads, cfg.head_dim)
        assert k.dtype == cfg.dtype and v.dtype == cfg.dtype
        token_stride = cfg.tensor_token_bytes // cfg.element_bytes
        assert k.stride() == (cfg.slot_bytes // cfg.element_bytes, token_stride, cfg.head_dim, 1)
        assert (k.data_ptr(), v.data_ptr()) == cache.layer_ptrs(i)
    before = [(k.data_ptr(), v.data_ptr()) for k, v in _all_layers(cache)]
    slot = cache.alloc()
    cache.step({slot: 3000})
    after = [(k.data_ptr(), v.data_ptr()) for k, v in _all_layers(cache)]
    assert before == after
    assert len(set(p for pair in after for p in pair)) == 2 * cfg.num_layers


def test_data_persists_across_growth_other_frees_and_reuse(make_cache):
    cache = make_cache(max_seq_len=8192)
    a, b = cache.alloc(), cache.alloc()
    cache.step({a: 100, b: 50})
    wa = fill_pattern(cache, a, 0, 100, seed=1)
    wb = fill_pattern(cache, b, 0, 50, seed=2)
    for length in (700, 2500, 8192):  # growth across page boundaries, up to max_seq_len
        cache.step({a: length})
        check_pattern(cache, a, 0, 100, wa)
        check_pattern(cache, b, 0, 50, wb)
    wa2 = fill_pattern(cache, a, 100, 8192, seed=3)
    cache.free(b)  # another slot's free ...
    c = cache.alloc()  # ... and reuse of its (still mapped) pages
    assert c == b
    cache.step({c: 5000})
    wc = fill_pattern(cache, c, 0, 5000, seed=4)
    cache.reclaim()
    check_pattern(cache, a, 0, 100, wa)
    check_pattern(cache, a, 100, 8192, wa2)
    check_pattern(cache, c, 0, 5000, wc)


def test_step_backs_at_least_length_and_rounds_to_pages(make_cache):
    cache = make_cache()
    cfg = cache.config
    slot = cache.alloc()
    lengths = (0, 1, cfg.tokens_per_page, cfg.tokens_per_page + 1, cfg.max_seq_len)
    for length in sorted(min(n, cfg.max_seq_len) for n in lengths):
        cache.step({slot: length})
        pages = cfg.pages_for_tokens(length) // cfg.num_tensors
        expected = min(cfg.max_seq_len, pages * cfg.page_bytes // cfg.tensor_token_bytes)
        assert cache.mapped_tokens(slot) == expected
        assert cache.mapped_tokens(slot) >= length
        assert cache.seq_len(slot) == length
    assert cache.stats()["pages_mapped"] == cfg.pages_for_tokens(cfg.max_seq_len)


def test_step_accepts_dict_sequence_and_tensor(make_cache):
    cache = make_cache()
    s0, s1 = cache.alloc(), cache.alloc()
    cache.step({s0: 10})
    cache.step([0, 300, 0, 0])
    assert cache.seq_len(s0) == 10 and cache.seq_len(s1) == 300  # 0 = idle: s0 untouched
    cache.step(torch.tensor([400, 0, 0, 0]))
    assert cache.seq_len(s0) == 400 and cache.seq_len(s1) == 300
    import numpy as np

    cache.step(np.array([401, 301, 0, 0]))
    assert (cache.seq_len(s0), cache.seq_len(s1)) == (401, 301)


def test_deferred_reclamation_reuses_mapped_pages_without_map_calls(make_cache):
    cache = make_cache()
    slot = cache.alloc()
    cache.step({slot: 2000})
    before = cache.stats()
    cache.free(slot)
    idle = cache.stats()
    assert idle["idle_slots_with_pages"] == 1 and idle["pages_mapped"] == before["pages_mapped"]
    again = cache.alloc()
    assert again == slot
    cache.step({again: 2000})
    after = cache.stats()
    assert after["map_calls"] == before["map_calls"]
    assert after["unmap_calls"] == before["unmap_calls"] == 0
    assert after["pages_created"] == before["pages_created"]


def test_alloc_prefers_idle_slot_with_most_pages(make_cache):
    cache = make_cache(num_kv_heads=8, head_dim=128)  # 2 MB pages: 1024 (layer) / 512 (mega) tokens
    slots = [cache.alloc() for _ in range(3)]
    cache.step({slots[0]: 100, slots[1]: 3000, slots[2]: 1500})
    for s in slots:
        cache.free(s)
    assert cache.alloc() == slots[1]
    assert cache.alloc() == slots[2]


def test_idle_pages_are_taken_least_recently_freed_first(make_cache):
    cfg_pages = vattention.KVCacheConfig(
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        max_batch_size=4,
        max_seq_len=4096,
        dtype=torch.float16,
        page_size="64KB",
    ).pages_for_tokens(256)
    cache = make_cache(page_size="64KB", memory_budget=3 * cfg_pages * 65536 // 1)
    a, b, c = cache.alloc(), cache.alloc(), cache.alloc()
    cache.step({a: 256, b: 256, c: 256})
    cache.free(b)
    cache.free(a)  # freed after b
    d = cache.alloc()  # reuses an idle slot (equal pages: any); take the other idle one's pages
    assert d in (a, b)
    other = b if d == a else a
    e = cache.alloc()
    assert e not in (a, b, c, d) or e == other
    cache.step({d: 256})
    assert cache.stats()["oom_events"] == 0


def test_eviction_order_without_reuse(make_cache):
    cache = make_cache(page_size="64KB", max_batch_size=4)
    cfg = cache.config
    per_slot = cfg.pages_for_tokens(cfg.tokens_per_page)
    cache.set_memory_budget(3 * per_slot * cfg.page_bytes)
    a, b, c = cache.alloc(), cache.alloc(), cache.alloc()
    cache.step({a: 1, b: 1, c: 1})
    cache.free(b)
    cache.free(a)
    # c needs one more page index: taken from b, the least recently freed idle slot.
    cache.step({c: cfg.tokens_per_page + 1})
    assert cache.mapped_tokens(b) == 0 and cache.mapped_tokens(a) == cfg.tokens_per_page
    assert cache.stats()["reclaimed_pages"] == per_slot


def test_reclaim_and_shrink(make_cache):
    cache = make_cache()
    slot = cache.alloc()
    cache.step({slot: 1000})
    mapped = cache.stats()["pages_mapped"]
    assert cache.reclaim() == 0  # active slots are never reclaimed
    cache.free(slot)
    assert cache.reclaim() == mapped
    stats = cache.stats()
    assert stats["pages_mapped"] == 0 and stats["pages_free"] == mapped
    assert stats["idle_slots_with_pages"] == 0 and stats["free_slots"] == 4
    assert cache.mapped_tokens(slot) == 0
    assert cache.shrink(keep_bytes=cache.config.page_bytes) == mapped - 1
    assert cache.stats()["pages_total"] == 1
    assert cache.shrink() == 1
    assert cache.stats()["pages_total"] == 0


def test_reserve_precreates_pages_and_step_uses_them(make_cache):
    cache = make_cache()
    cfg = cache.config
    cache.reserve(8 * cfg.page_bytes)
    assert cache.stats()["pages_total"] == 8 and cache.stats()["pages_created"] == 8
    cache.reserve(4 * cfg.page_bytes)  # already holds more: nothing to do
    assert cache.stats()["pages_created"] == 8
    slot = cache.alloc()
    cache.step({slot: 1})
    assert cache.stats()["pages_created"] == 8  # taken from the free list, none created


def test_sdpa_over_virtual_cache_equals_contiguous_copy(make_cache):
    cache = make_cache(num_kv_heads=2, head_dim=64, max_seq_len=4096)
    cfg = cache.config
    lengths = {cache.alloc(): 777, cache.alloc(): 1500}
    cache.step(lengths)
    for slot, n in lengths.items():
        fill_pattern(cache, slot, 0, n, seed=slot)
    gen = torch.Generator().manual_seed(0)
    for layer in range(cfg.num_layers):
        k, v = kv_views(cache, layer)
        for slot, n in lengths.items():
            q = torch.randn(1, cfg.num_kv_heads, 1, cfg.head_dim, generator=gen)
            q = q.to(cfg.dtype).float()
            q = q.to(k.device)  # a real GPU gives cuda tensors
            kv_k = k[slot, :n].transpose(0, 1).unsqueeze(0).float()  # [1, H, n, D], strided
            kv_v = v[slot, :n].transpose(0, 1).unsqueeze(0).float()
            virtual = torch.nn.functional.scaled_dot_product_attention(q, kv_k, kv_v)
            contiguous = torch.nn.functional.scaled_dot_product_attention(
                q, kv_k.contiguous().clone(), kv_v.contiguous().clone()
            )
            assert torch.equal(virtual, contiguous)


def test_mega_layout_layers_are_disjoint_views():
    cfg = vattention.KVCacheConfig(
        num_layers=3,
        num_kv_heads=2,
        head_dim=32,
        max_batch_size=2,
        max_seq_len=512,
        dtype=torch.float32,
        page_size="64KB",
        layout="mega",
    )
    with vattention.KVCache(cfg) as cache:
        slot = cache.alloc()
        cache.step({slot: 300})
        for layer in range(3):
            k, v = cache.layer(layer)
            k[slot, :300] = layer + 1
            v[slot, :300] = -(layer + 1)
        big_k, big_v = cache.mega_tensors()
        assert big_k.shape == (2, 512, 3, 2, 32)
        for layer in range(3):
            assert torch.all(big_k[slot, :300, layer] == layer + 1)
            assert torch.all(big_v[slot, :300, layer] == -(layer + 1))
        # One page index covers all layers: 2 pages (K and V) back 300 tokens of 3 layers.
        assert cache.stats()["pages_mapped"] == 2 * cfg.pages_for_tokens(300) // 2


def test_stats_accounting(make_cache):
    cache = make_cache()
    cfg = cache.config
    a, b = cache.alloc(), cache.alloc()
    cache.step({a: 100, b: 1000})
    stats = cache.stats()
    assert stats["bytes_used_by_tokens"] == 1100 * cfg.bytes_per_token
    assert stats["pages_mapped"] == cfg.pages_for_tokens(100) + cfg.pages_for_tokens(1000)
    assert stats["bytes_mapped"] == stats["pages_mapped"] * cfg.page_bytes
    assert stats["pages_free"] + stats["pages_mapped"] == stats["pages_total"]
    assert stats["active_slots"] == 2 and stats["free_slots"] == 2
    assert stats["map_calls"] == stats["pages_mapped"]
    assert stats["set_access_calls"] == 2 * cfg.num_tensors  # one per (slot, tensor) run
    assert stats["virtual_bytes"] == cfg.virtual_bytes


def test_eager_reclaim_unmaps_on_free(make_cache):
    cache = make_cache(reclaim="eager")
    slot = cache.alloc()
    cache.step({slot: 1000})
    cache.free(slot)
    stats = cache.stats()
    assert stats["pages_mapped"] == 0 and stats["idle_slots_with_pages"] == 0
    assert stats["pages_free"] == stats["pages_total"] > 0


def test_tensors_outlive_close_without_aliasing(make_cache):
    cache = make_cache()
    k, _ = kv_views(cache, 0)
    ptr = k.data_ptr()
    cache.close()
    assert cache.closed
    assert k.data_ptr() == ptr  # reservation still held by the tensor; touching it would fault
    del k
