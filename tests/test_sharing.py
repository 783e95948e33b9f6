"""Prefix sharing: fork, share_prefix, ensure_private, and reclamation with shared pages."""

from __future__ import annotations

import pytest
import torch

import vattention

from support.helpers import kv_views, page_state
from support.rounding import fp32_attention_bound, sdpa_spread
from support.share_helpers import check_pattern, fast_fill as fill_pattern, paged_cache, prefix


def full_pages(cache, num_tokens):
    """Physical pages wholly below num_tokens, over all tensors: what a fork shares."""
    cfg = cache.config
    return num_tokens * cfg.tensor_token_bytes // cfg.page_bytes * cfg.num_tensors


def pages_for(cache, num_tokens):
    """Physical pages holding any of num_tokens, over all tensors (not what a tile rule maps
    past them: a fork copies the page its last token straddles, and shares the rest)."""
    geo = cache.config.geometry
    return geo.pages_for(num_tokens) * geo.columns


def test_fork_then_grow_parent_and_child_independently(make_cache):
    cache = paged_cache(make_cache)
    tpp = cache.config.tokens_per_page
    n = tpp + tpp // 3  # one full page and a partial one in every tensor
    parent = cache.alloc()
    cache.step({parent: n})
    prefix = fill_pattern(cache, parent, 0, n, seed=1)
    child = cache.fork(parent)
    assert child != parent and cache.seq_len(child) == n
    check_pattern(cache, child, 0, n, prefix)
    shared = full_pages(cache, n)
    stats = cache.stats()
    assert stats["shared_pages"] == shared > 0
    assert stats["bytes_saved_by_sharing"] == shared * cache.config.page_bytes
    assert stats["mappings"] == stats["pages_mapped"] + shared
    assert stats["pages_mapped"] == 2 * pages_for(cache, n) - shared
    cache.step({parent: 2 * tpp, child: 3 * tpp + 1})
    own_parent = fill_pattern(cache, parent, n, 2 * tpp, seed=2)
    own_child = fill_pattern(cache, child, n, 3 * tpp + 1, seed=3)
    for slot, own, end in ((parent, own_parent, 2 * tpp), (child, own_child, 3 * tpp + 1)):
        check_pattern(cache, slot, 0, n, prefix)
        check_pattern(cache, slot, n, end, own)
    assert cache._core.check_invariants() == ""


def test_fork_at_a_partial_page_copies_it(make_cache):
    cache = paged_cache(make_cache)
    cfg = cache.config
    tpp = cfg.tokens_per_page
    parent = cache.alloc()
    cache.step({parent: 3 * tpp})
    data = fill_pattern(cache, parent, 0, 3 * tpp, seed=4)
    n = tpp + tpp // 2
    child = cache.fork(parent, n)
    assert cache.seq_len(child) == n
    assert cache.stats()["cow_pages_copied"] == cfg.num_tensors
    assert cache.stats()["shared_pages"] == cfg.num_tensors
    # The child overwrites its copy of the partial page: the parent's tokens there stay as they
    # were.
    cache.step({child: 2 * tpp})
    fill_pattern(cache, child, n, 2 * tpp, seed=5)
    check_pattern(cache, parent, 0, 3 * tpp, data)
    check_pattern(cache, child, 0, n, prefix(data, n))


def test_partial_page_copy_count_is_exact(make_cache):
    # A token stride (96 or 192 bytes) that does not divide the page: tokens straddle pages.
    cache = paged_cache(make_cache, pages=3, num_kv_heads=1, head_dim=48)
    cfg = cache.config
    length = cfg.max_seq_len
    parent = cache.alloc()
    cache.step({parent: length})
    data = fill_pattern(cache, parent, 0, length, seed=6)
    for n in (0, 1, cfg.tokens_per_page, cfg.tokens_per_page + 1, length - 1, length):
        before = cache.stats()["cow_pages_copied"]
        child = cache.fork(parent, n)
        partial = pages_for(cache, n) - full_pages(cache, n)
        assert partial in (0, cfg.num_tensors)
        assert cache.stats()["cow_pages_copied"] - before == partial
        assert cache.stats()["shared_pages"] == full_pages(cache, n)
        check_pattern(cache, child, 0, n, prefix(data, n))
        cache.free(child)
        cache.reclaim()
        assert cache._core.check_invariants() == ""


def test_parallel_sampling_children_and_freeing_the_parent(make_cache):
    cache = paged_cache(make_cache, max_batch_size=5)
    n = 2 * cache.config.tokens_per_page + 7
    parent = cache.alloc()
    cache.step({parent: n})
    prefix = fill_pattern(cache, parent, 0, n, seed=7)
    children = [cache.fork(parent) for _ in range(4)]
    shared = full_pages(cache, n)
    partial = pages_for(cache, n) - shared
    stats = cache.stats()
    assert stats["pages_mapped"] == shared + 5 * partial
    assert stats["bytes_saved_by_sharing"] == 4 * shared * cache.config.page_bytes
    cache.free(parent)
    assert cache.reclaim() == pages_for(cache, n)  # the parent's mappings go ...
    assert cache.stats()["pages_mapped"] == shared + 4 * partial  # ... but not shared pages
    for child in children:
        check_pattern(cache, child, 0, n, prefix)
        cache.free(child)
    cache.reclaim()
    stats = cache.stats()
    assert (stats["pages_mapped"], stats["mappings"], stats["shared_pages"]) == (0, 0, 0)
    assert stats["pages_free"] == stats["pages_total"]


def test_reclaiming_a_forked_parent_under_pressure_keeps_the_child(make_cache):
    cache = make_cache(max_seq_len=2048)
    cfg = cache.config
    per_slot = pages_for(cache, 2048)
    cache.set_memory_budget(2 * per_slot * cfg.page_bytes)
    parent = cache.alloc()
    cache.step({parent: 2048})
    prefix = fill_pattern(cache, parent, 0, 2048, seed=8)
    child = cache.fork(parent)
    cache.free(parent)  # idle, its pages shared with the child
    other = cache.alloc()  # the idle parent is preferred ...
    assert other == parent  # ... and must not inherit pages the child reads
    cache.step({other: 2048})  # needs the whole budget beyond the shared pages
    fill_pattern(cache, other, 0, 2048, seed=9)
    check_pattern(cache, child, 0, 2048, prefix)
    with pytest.raises(vattention.OutOfPagesError):
        cache.step({cache.alloc(): 2048})  # the shared pages are not reclaimable: still mapped


def test_share_prefix_into_a_fresh_slot(make_cache):
    cache = make_cache()
    src = cache.alloc()
    cache.step({src: 900})
    data = fill_pattern(cache, src, 0, 900, seed=10)
    dst = cache.alloc()
    cache.share_prefix(src, dst, 600)
    assert cache.seq_len(dst) == 600
    check_pattern(cache, dst, 0, 600, prefix(data, 600))
    cache.step({dst: 1200})
    fill_pattern(cache, dst, 600, 1200, seed=11)
    check_pattern(cache, src, 0, 900, data)


def test_share_prefix_into_a_slot_that_inherited_pages(make_cache):
    cache = make_cache(max_batch_size=2)
    src, old = cache.alloc(), cache.alloc()
    cache.step({src: 700, old: 3000})
    data = fill_pattern(cache, src, 0, 700, seed=12)
    cache.free(old)
    dst = cache.alloc()
    assert dst == old and cache.mapped_tokens(dst) >= 3000
    cache.share_prefix(src, dst, 700)
    assert cache.mapped_tokens(dst) == min(
        cache.config.max_seq_len,
        pages_for(cache, 700)
        // cache.config.num_tensors
        * cache.config.page_bytes
        // cache.config.tensor_token_bytes,
    )
    check_pattern(cache, dst, 0, 700, data)


def test_ensure_private_lets_a_child_rewrite_history(make_cache):
    cache = paged_cache(make_cache)
    tpp = cache.config.tokens_per_page
    parent = cache.alloc()
    n = 2 * tpp + 3
    cache.step({parent: n})
    data = fill_pattern(cache, parent, 0, n, seed=13)
    child = cache.fork(parent)
    start = tpp + 1  # inside the second page: pages 1.. become private, page 0 stays shared
    copied = cache.ensure_private(child, start)
    tensors = cache.config.num_tensors
    assert copied == tensors * (full_pages(cache, n) // tensors - 1)
    assert cache.stats()["shared_pages"] == cache.config.num_tensors
    check_pattern(cache, child, 0, n, data)  # copies hold the same bytes
    fill_pattern(cache, child, start, n, seed=14)  # rewrite the child's history ...
    check_pattern(cache, parent, 0, n, data)  # ... the parent does not see it
    assert cache.ensure_private(child, start) == 0  # nothing shared left there
    assert cache.ensure_private(parent, 0) == cache.config.num_tensors  # page 0, still shared
    assert cache.stats()["shared_pages"] == 0


def test_sdpa_over_forked_child_equals_sdpa_over_copied_prefix(make_cache):
    cache = paged_cache(make_cache, dtype=torch.float32)
    cfg = cache.config
    n = cfg.tokens_per_page + 37
    parent = cache.alloc()
    cache.step({parent: n + 50})
    fill_pattern(cache, parent, 0, n + 50, seed=15)
    copies = [
        (k[parent, :n].clone(), v[parent, :n].clone())
        for k, v in (kv_views(cache, i) for i in range(cfg.num_layers))
    ]
    child = cache.fork(parent, n)
    cache.step({parent: n + 100})
    fill_pattern(cache, parent, n, n + 100, seed=16)  # the parent moves on past the fork point
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, cfg.num_kv_heads, 1, cfg.head_dim, generator=gen)
    q = q.to(copies[0][0].device)  # the cache's device: a GPU's SDPA takes no CPU query
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for layer, (kc, vc) in enumerate(copies):
        k, v = kv_views(cache, layer)
        got = sdpa(q, k[child, :n].transpose(0, 1)[None], v[child, :n].transpose(0, 1)[None])
        want = sdpa(q, kc.transpose(0, 1)[None], vc.transpose(0, 1)[None])
        # Over the cache's own strides SDPA may take another path (summation order, vector
        # width: by CPU and library) than over the copy's: equal within fp32's rounding
        # (derived), below what a wrong page would change (its share of the n keys' weight).
        scale = cfg.head_dim**-0.5
        kt, vt = kc.transpose(0, 1)[None], vc.transpose(0, 1)[None]
        bound = fp32_attention_bound(q, kt, vt, n, scale, sdpa_spread(q, kt, vt, scale))
        assert (got - want).abs().max().item() <= bound
        # the same strides, shapes and values: the same path, bit for bit
        exact = sdpa(
            q,
            k[child, :n].contiguous().transpose(0, 1)[None],
            v[child, :n].contiguous().transpose(0, 1)[None],
        )
        assert torch.equal(exact, want)


# ---- errors: typed, and nothing changed ----------------------------------------------------------


def test_fork_and_share_errors_leave_state_unchanged(make_cache):
    cache = make_cache(max_batch_size=3)
    src = cache.alloc()
    cache.step({src: 500})
    data = fill_pattern(cache, src, 0, 500, seed=17)
    dst = cache.alloc()
    cache.step({dst: 10})
    before = page_state(cache)
    cases = [
        (vattention.InvalidSlotError, lambda: cache.fork(99)),
        (vattention.InvalidSlotError, lambda: cache.fork(-1)),
        (vattention.InvalidSlotError, lambda: cache.fork(2)),  # not allocated
        (vattention.SequenceTooLongError, lambda: cache.fork(src, 501)),  # > src length
        (vattention.SequenceTooLongError, lambda: cache.fork(src, -2)),
        (vattention.InvalidSlotError, lambda: cache.share_prefix(src, dst, 100)),  # not fresh
        (vattention.InvalidSlotError, lambda: cache.share_prefix(src, src, 100)),
        (vattention.InvalidSlotError, lambda: cache.share_prefix(src, 2, 100)),  # not active
        (vattention.SequenceTooLongError, lambda: cache.share_prefix(dst, src, 11)),
        (vattention.InvalidSlotError, lambda: cache.ensure_private(2, 0)),
        (vattention.SequenceTooLongError, lambda: cache.ensure_private(src, 501)),
    ]
    for error, call in cases:
        with pytest.raises(error) as info:
            call()
        assert isinstance(info.value, vattention.VAttentionError)
        assert page_state(cache) == before, info.value
    check_pattern(cache, src, 0, 500, data)
    assert cache.fork(src, 100) == 2
    with pytest.raises(vattention.InvalidSlotError, match="no free slot"):
        cache.fork(src)  # all slots active


def test_fork_out_of_pages_changes_nothing(make_cache):
    cache = paged_cache(make_cache, max_batch_size=3)
    cfg = cache.config
    src = cache.alloc()
    n = cfg.tokens_per_page + 1
    cache.step({src: n})
    cache.set_memory_budget(cache.stats()["pages_total"] * cfg.page_bytes)
    data = fill_pattern(cache, src, 0, n, seed=18)
    before = page_state(cache)
    with pytest.raises(vattention.OutOfPagesError) as info:
        cache.fork(src)  # the partial page needs fresh pages: none left
    assert info.value.pages_needed == cfg.num_tensors
    assert page_state(cache) == before
    assert cache.stats()["oom_events"] == 1
    check_pattern(cache, src, 0, n, data)
    cache.set_memory_budget(None)
    child = cache.fork(src)
    check_pattern(cache, child, 0, n, data)


def test_stats_report_mappings_and_physical_pages_separately(make_cache):
    cache = paged_cache(make_cache)
    cfg = cache.config
    a = cache.alloc()
    cache.step({a: cfg.tokens_per_page * 2})
    b = cache.fork(a)
    s = cache.stats()
    assert s["pages_mapped"] == 2 * cfg.num_tensors
    assert s["mappings"] == 4 * cfg.num_tensors
    assert s["shared_pages"] == 2 * cfg.num_tensors
    assert s["pages_free"] + s["pages_mapped"] == s["pages_total"]
    assert cache.seq_len(b) == cache.seq_len(a)
