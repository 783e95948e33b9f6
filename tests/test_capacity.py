"""KVCache.capacity(): step()'s accounting as a value, mapping nothing.

In random states (active slots, idle slots holding pages, prefetched look-ahead, released window
pages, a budget), capacity(lens, new_requests) must predict exactly what step() then does: it fits
iff step() (after alloc() of the new requests) succeeds, and when it does not, OutOfPagesError
reports the same numbers. It must change nothing: the page state is the same before and after.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vattention

from support.helpers import page_state


# The accounting is in pages, whatever their size: one page size keeps the suite short (device and
# layout stay parametrized).
@pytest.fixture
def page_size():
    return "64KB"


def _scenario(make_cache, rng, window):
    cache = make_cache(
        max_batch_size=6,
        max_seq_len=2048,
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        memory_budget=f"{int(rng.integers(12, 40)) * 64}KB",
        sliding_window=window,
    )
    tpp = cache.config.tokens_per_page
    active = {}
    for _ in range(int(rng.integers(1, 6))):
        slot = cache.alloc()
        try:
            length = int(rng.integers(1, 5 * tpp))
            cache.step({**active, slot: length})
            active[slot] = length
        except vattention.OutOfPagesError:
            cache.free(slot)
    for slot in list(active):
        if rng.random() < 0.3:  # idle slots keep their pages
            cache.free(slot)
            del active[slot]
    if active and rng.random() < 0.5:  # look-ahead beyond the lengths
        cache.prefetch(
            {s: n + 1 for s, n in active.items()}, lookahead_tokens=int(rng.integers(0, 3 * tpp))
        )
        cache.wait()
    for _ in range(int(rng.integers(0, 3))):  # decode steps (windows release pages)
        try:
            active = {s: min(2048, n + tpp // 2) for s, n in active.items()}
            cache.step(active)
        except vattention.OutOfPagesError:
            active = {s: cache.seq_len(s) for s in active}
    return cache, active


@pytest.mark.parametrize("window", [None, 300])
def test_capacity_predicts_step(make_cache, window):
    rng = np.random.default_rng(7 if window is None else 8)
    outcomes = set()
    for _ in range(40):
        cache, active = _scenario(make_cache, rng, window)
        tpp = cache.config.tokens_per_page
        lens = {s: min(2048, n + int(rng.integers(0, 4 * tpp))) for s, n in active.items()}
        free_slots = cache.config.max_batch_size - len(cache.active_slots())
        new = [int(rng.integers(1, 3 * tpp)) for _ in range(int(rng.integers(0, free_slots + 1)))]
        before = page_state(cache)
        cap = cache.capacity(lens, new_requests=new)
        assert page_state(cache) == before, "capacity() changed the cache"
        assert cap.pages_creatable is not None
        assert cap.fits == (cap.pages_short == 0)
        slots = [cache.alloc() for _ in new]
        try:
            cache.step({**lens, **dict(zip(slots, new))})
        except vattention.OutOfPagesError as e:
            outcomes.add("short")
            assert not cap.fits, f"capacity said it fits, step() ran out: {cap}, {e}"
            if window is None:  # with windows step() retries after releasing: other numbers
                assert e.pages_needed - e.pages_available == cap.pages_short, (cap, e)
        else:
            outcomes.add("fits")
            assert cap.fits, f"capacity said {cap.pages_short} short, step() succeeded: {cap}"
        assert cache._core.check_invariants() == ""
    assert outcomes == {"fits", "short"}, "the scenarios must cover both outcomes"


def test_capacity_counts_pages_and_the_budget(make_cache):
    probe = make_cache(max_batch_size=4, max_seq_len=4096)
    budget_pages = 8 * probe.config.pages_per_index
    cache = make_cache(
        max_batch_size=4, max_seq_len=4096, memory_budget=budget_pages * probe.config.page_bytes
    )
    cfg = cache.config
    per_index = cfg.pages_per_index
    a = cache.alloc()
    cache.step({a: 100})
    held = cfg.pages_for_tokens(100)
    cap = cache.capacity({a: 4096}, new_requests=[1])
    assert cap.pages_needed == cfg.pages_for_tokens(4096) - held + per_index
    assert cap.pages_free + cap.pages_creatable == budget_pages - held
    assert cap.pages_reclaimable == 0
    cache.free(a)  # idle: its pages become reclaimable
    cap = cache.capacity(new_requests=[1])
    assert (cap.pages_needed, cap.pages_reclaimable) == (per_index, held)


def test_capacity_without_a_budget_is_never_short(make_cache):
    cache = make_cache(max_batch_size=2, max_seq_len=4096)
    a = cache.alloc()
    cap = cache.capacity({a: 4096}, new_requests=[4096])
    assert cap.pages_creatable is None and cap.pages_short == 0 and cap.fits


def test_capacity_checks_its_arguments_like_step(make_cache):
    cache = make_cache(max_batch_size=2, max_seq_len=4096)
    a = cache.alloc()
    with pytest.raises(vattention.InvalidSlotError, match="not allocated"):
        cache.capacity({1 - a: 10})
    with pytest.raises(vattention.SequenceTooLongError, match="max_seq_len=4096"):
        cache.capacity({a: 4097})
    with pytest.raises(vattention.SequenceTooLongError, match=r"new_requests\[1\]=5000"):
        cache.capacity(new_requests=[10, 5000])
    with pytest.raises(vattention.ArgumentTypeError, match="new_requests"):
        cache.capacity(new_requests=[torch.tensor(1.5)])
