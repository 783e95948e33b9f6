"""KVCacheConfig(scrub=True) zeroes pages when they change owner.

A slot reused after free() (deferred reclamation hands its mapped pages to the next request) and a
page recycled through the pool both carry the previous request's K/V; fresh driver pages are
uninitialised on CUDA. With scrub=True every page a request receives reads as zeros; without it
(the default) the previous contents stay visible, which is the documented risk.
"""

from __future__ import annotations

import pytest
import torch

import vattention

from support.helpers import fill_pattern, kv_views


@pytest.fixture
def page_size():
    return "64KB"


def _rows(cache, slot, start, end):
    """Every layer's K and V of tokens [start, end) of slot, as CPU tensors."""
    out = []
    for layer in range(cache.config.num_layers):
        k, v = kv_views(cache, layer)
        out += [k[slot, start:end].cpu(), v[slot, start:end].cpu()]
    return out


def _all_zero(rows):
    return all(bool((r == 0).all()) for r in rows)


def _reused_idle_slot(cache, n):
    a = cache.alloc()
    cache.step({a: n})
    fill_pattern(cache, a, 0, n, seed=11)
    cache.free(a)
    b = cache.alloc()
    assert b == a  # deferred reclamation: the idle slot with pages is preferred
    assert cache.mapped_tokens(b) >= n  # and it still holds the previous request's pages
    return b


def _recycled_through_pool(cache, n, *, prefetch=False):
    a = cache.alloc()
    cache.step({a: n})
    fill_pattern(cache, a, 0, n, seed=12)
    cache.free(a)
    cache.reclaim()  # the pages go back to the pool, unmapped, contents intact
    b = cache.alloc()
    if prefetch:
        cache.prefetch({b: n})
        cache.wait()
    cache.step({b: n})
    return b


@pytest.mark.parametrize("path", ["idle_slot", "pool", "pool_prefetch"])
def test_scrub_zeroes_pages_that_change_owner(make_cache, path):
    cache = make_cache(scrub=True)
    n = 3 * cache.config.tokens_per_page
    if path == "idle_slot":
        b = _reused_idle_slot(cache, n)
    else:
        b = _recycled_through_pool(cache, n, prefetch=path == "pool_prefetch")
    assert _all_zero(_rows(cache, b, 0, cache.mapped_tokens(b)))
    assert cache.stats()["scrubbed_pages"] > 0


@pytest.mark.parametrize("path", ["idle_slot", "pool"])
def test_without_scrub_the_previous_contents_stay_visible(make_cache, path):
    cache = make_cache()  # the default: scrub=False
    assert cache.config.scrub is False
    n = 3 * cache.config.tokens_per_page
    b = _reused_idle_slot(cache, n) if path == "idle_slot" else _recycled_through_pool(cache, n)
    assert not _all_zero(_rows(cache, b, 0, n))
    assert cache.stats()["scrubbed_pages"] == 0


def test_scrub_zeroes_the_rest_of_a_forked_partial_page(make_cache):
    cache = make_cache(scrub=True)
    tpp = cache.config.tokens_per_page
    a = cache.alloc()
    cache.step({a: 4 * tpp})
    fill_pattern(cache, a, 0, 4 * tpp, seed=12)
    cache.free(a)
    cache.reclaim()  # the pool now holds a's used pages
    q = cache.alloc()
    cache.step({q: tpp + 5})
    written = fill_pattern(cache, q, 0, tpp + 5, seed=13)
    child = cache.fork(q)
    # The copied prefix is q's; the rest of the child's fresh partial page is zeros.
    rows = _rows(cache, child, 0, tpp + 5)
    expected = [t for kd, vd in written for t in (kd, vd)]
    assert all(torch.equal(r, e) for r, e in zip(rows, expected))
    assert _all_zero(_rows(cache, child, tpp + 5, 2 * tpp))


def test_scrub_must_be_a_bool():
    with pytest.raises(vattention.ConfigError, match="scrub='yes' must be True or False"):
        vattention.KVCacheConfig(
            num_layers=1,
            num_kv_heads=1,
            head_dim=64,
            max_batch_size=1,
            max_seq_len=64,
            dtype=torch.float16,
            scrub="yes",
        )
