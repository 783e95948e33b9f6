"""Sliding-window release: KVCacheConfig(sliding_window=...).

Positions stay absolute; step() unmaps the pages of windowed tensors that lie wholly before the
first key any query of the step reads (a query at q reads keys (q - W, q]); every other path
(fork, swap, ensure_private, alloc of an idle slot, budgets) handles the released head.
"""

from __future__ import annotations

import pytest
import torch

import vattention

from support.helpers import kv_views

H, D = 2, 64  # float32 (marks up to 2^24 are exact): 512 bytes per token row, layer layout


def windowed(make_cache, window_pages=1.5, pages=8, **kwargs):
    """A cache whose window spans `window_pages` pages of one tensor and slots hold `pages`
    pages. Without the tile rule (the counts below are the window's alone; how a tile keeps the
    tile below a window's first key is tests/test_read_tail.py's)."""
    kwargs.setdefault("kv_tile_tokens", 0)
    probe = make_cache(
        num_kv_heads=H,
        head_dim=D,
        max_batch_size=1,
        max_seq_len=1,
        dtype=torch.float32,
        **{k: v for k, v in kwargs.items() if k == "value_cache"},
    )
    tpp = probe.config.tokens_per_page
    probe.close()
    window = int(window_pages * tpp)
    cache = make_cache(
        num_kv_heads=H,
        head_dim=D,
        max_seq_len=pages * tpp,
        dtype=torch.float32,
        sliding_window=kwargs.pop("sliding_window", window),
        **kwargs,
    )
    return cache, tpp, window


def released_pages(cfg, window, first_query):
    """Pages of one windowed tensor lying wholly before first_query - window + 1."""
    first_key = first_query - window + 1
    return max(0, first_key) * cfg.tensor_token_bytes // cfg.page_bytes if window else 0


def mark(cache, slot, start, end, layers=None):
    """Writes token index t into element [0, 0] of token t (K) and -t (V) for [start, end)."""
    for layer in range(cache.config.num_layers) if layers is None else layers:
        k, v = kv_views(cache, layer)
        marks = torch.arange(start, end, dtype=torch.float32)
        k[slot, start:end, 0, 0] = marks.to(k.dtype)
        if v is not None:
            v[slot, start:end, 0, 0] = (-marks).to(v.dtype)


def check_marks(cache, slot, start, end, layers=None):
    for layer in range(cache.config.num_layers) if layers is None else layers:
        k, v = kv_views(cache, layer)
        marks = torch.arange(start, end, dtype=torch.float32)
        assert torch.equal(k[slot, start:end, 0, 0].float().cpu(), marks), f"K of layer {layer}"
        if v is not None:
            got = v[slot, start:end, 0, 0].float().cpu()
            assert torch.equal(got, -marks), f"V of layer {layer}"


def decode(cache, slot, old, new, stride):
    """Steps slot from old to new tokens in `stride`-token steps, marking each step's tokens."""
    while old < new:
        nxt = min(new, old + stride)
        cache.step({slot: nxt})
        mark(cache, slot, old, nxt)
        old = nxt
    return old


def test_decode_holds_pages_bounded_by_the_window(make_cache):
    cache, tpp, window = windowed(make_cache)
    cfg = cache.config
    T = cfg.num_tensors
    slot = cache.alloc()
    seq, peak = 0, 0
    stride = max(1, tpp // 4)
    for target in range(stride, 8 * tpp + 1, stride):
        old = seq
        seq = decode(cache, slot, seq, target, stride)
        gone = released_pages(cfg, window, old)
        stats = cache.stats()
        assert stats["pages_mapped"] == T * (cfg.pages_for_tokens(seq) // T - gone)
        assert stats["window_released_pages"] == T * gone
        start = -(-gone * cfg.page_bytes // cfg.tensor_token_bytes)
        assert [cache.window_start(slot, layer) for layer in range(cfg.num_layers)] == [
            start
        ] * cfg.num_layers
        assert start <= old - window + 1 or start == 0  # every key of this step's queries is kept
        check_marks(cache, slot, max(start, seq - window), seq)
        peak = max(peak, stats["pages_mapped"])
    # O(W): the window plus the page being written, in every tensor, whatever the length.
    assert peak <= T * (-(-window // tpp) + 2)
    assert cache.stats()["mappings"] == cache.stats()["pages_mapped"]


def test_prefill_releases_nothing_and_decode_releases_before_len_minus_window(make_cache):
    cache, tpp, window = windowed(make_cache)
    cfg = cache.config
    slot = cache.alloc()
    n = 5 * tpp
    cache.step({slot: n})  # a prefill: its first query (0) reads keys from token 0
    assert cache.stats()["window_released_pages"] == 0
    assert cache.window_start(slot, 0) == 0
    cache.step({slot: n + 1})  # decode: the query at n reads (n - W, n]
    gone = (n + 1 - window) * cfg.tensor_token_bytes // cfg.page_bytes
    assert cache.stats()["window_released_pages"] == cfg.num_tensors * gone
    assert cache.window_start(slot, 0) <= n + 1 - window


def test_per_layer_windows_release_only_windowed_layers(make_cache, layout):
    if layout == "mega":
        with pytest.raises(vattention.ConfigError, match="per-layer windows need layout='layer'"):
            windowed(make_cache, sliding_window=[64, None])
        # The same window everywhere is fine in the mega layout, as a sequence too.
        cache, _, _ = windowed(make_cache, sliding_window=[64, 64])
        assert cache.config.layer_windows == (64, 64)
        return
    probe, tpp, window = windowed(make_cache)
    probe.close()
    cache, _, _ = windowed(make_cache, sliding_window=[window, None])
    cfg = cache.config
    slot = cache.alloc()
    seq = decode(cache, slot, 0, 6 * tpp, max(1, tpp // 2))
    full = cfg.pages_for_tokens(seq) // cfg.num_tensors
    assert cache.window_start(slot, 1) == 0
    assert cache.window_start(slot, 0) > 0
    check_marks(cache, slot, 0, seq, layers=[1])  # full layer: everything
    check_marks(cache, slot, cache.window_start(slot, 0), seq, layers=[0])
    gone = cache.stats()["window_released_pages"]
    assert gone > 0 and gone % 2 == 0  # K and V of layer 0
    assert cache.stats()["pages_mapped"] == 4 * full - gone


def test_rewind_into_the_released_window_is_typed_and_changes_nothing(make_cache):
    cache, tpp, window = windowed(make_cache)
    slot = cache.alloc()
    seq = decode(cache, slot, 0, 5 * tpp, max(1, tpp // 2))
    start = cache.window_start(slot, 0)
    before = cache.stats()
    with pytest.raises(vattention.SequenceTooLongError, match="were released") as info:
        cache.step({slot: start + window - 1})
    assert info.value.window_start == start
    assert cache.seq_len(slot) == seq and cache.stats() == before
    cache.step({slot: start + window})  # the smallest length whose window is still backed
    assert cache.seq_len(slot) == start + window


def test_alloc_of_an_idle_windowed_slot_starts_from_token_zero(make_cache):
    cache, tpp, _ = windowed(make_cache, max_batch_size=1)
    slot = cache.alloc()
    decode(cache, slot, 0, 5 * tpp, max(1, tpp // 2))
    cache.free(slot)
    again = cache.alloc()
    assert again == slot and cache.window_start(again, 0) == 0
    cache.step({again: 3})
    mark(cache, again, 0, 3)  # token 0 is backed again (would fault if the hole were kept)
    check_marks(cache, again, 0, 3)


def test_fork_of_a_windowed_slot_shares_only_what_is_mapped(make_cache):
    cache, tpp, window = windowed(make_cache)
    cfg = cache.config
    src = cache.alloc()
    seq = decode(cache, src, 0, 5 * tpp + tpp // 2, max(1, tpp // 2))
    start = cache.window_start(src, 0)
    mapped = cache.stats()["pages_mapped"]
    child = cache.fork(src)
    # Only the partial last page is new memory; the released head is not mapped again.
    assert cache.stats()["pages_mapped"] == mapped + cfg.num_tensors
    assert cache.window_start(child, 0) == start
    check_marks(cache, child, start, seq)
    cache.step({child: seq + 1})  # the child's own steps release its head further
    mark(cache, child, seq, seq + 1)
    start = cache.window_start(child, 0)
    assert cache.ensure_private(child, start) > 0  # copies the shared pages of the window
    check_marks(cache, child, start, seq + 1)
    check_marks(cache, src, cache.window_start(src, 0), seq)
    with pytest.raises(vattention.SequenceTooLongError, match="were released"):
        cache.fork(src, cache.window_start(src, 0) + window - 1)
    assert cache._core.check_invariants() == ""


def test_a_slot_first_filled_by_fork_releases_its_window(make_cache):
    # fork() takes a slot alloc() never handed out: the row's first release point must still be
    # known, or its decode would keep every page it passes.
    cache, tpp, window = windowed(make_cache)
    src = cache.alloc()
    seq = decode(cache, src, 0, tpp // 2, max(1, tpp // 4))  # nothing released in src
    child = cache.fork(src)
    assert child != src and cache.window_start(child, 0) == 0
    released = cache.stats()["window_released_pages"]
    seq = decode(cache, child, seq, 5 * tpp, max(1, tpp // 2))
    assert cache.window_start(child, 0) > 0
    assert cache.stats()["window_released_pages"] > released
    check_marks(cache, child, max(cache.window_start(child, 0), seq - window), seq)


def test_swap_of_a_windowed_slot_saves_only_the_window(make_cache):
    cache, tpp, _ = windowed(make_cache, pages=10)
    slot = cache.alloc()
    seq = decode(cache, slot, 0, 6 * tpp + 3, max(1, tpp // 2))
    start = cache.window_start(slot, 0)
    live = cache.stats()["pages_mapped"]
    handle = cache.swap_out(slot)
    stats = cache.stats()
    assert stats["swap_host_bytes"] == live * cache.config.page_bytes  # not the released head
    assert stats["pages_mapped"] == 0
    back = cache.swap_in(handle)
    assert cache.seq_len(back) == seq and cache.window_start(back, 0) == start
    assert cache.stats()["pages_mapped"] == live
    check_marks(cache, back, start, seq)
    decode(cache, back, seq, seq + 2 * tpp, max(1, tpp // 2))  # releasing continues after swap-in
    assert cache.window_start(back, 0) > start


def test_window_pages_cover_a_step_under_a_tight_budget(make_cache):
    probe, tpp, window = windowed(make_cache)
    cfg = probe.config
    probe.close()
    # Exactly the steady state of one decoding request: window + the page being written.
    per_tensor = -(-window // tpp) + 1
    budget = cfg.num_tensors * per_tensor * cfg.page_bytes
    cache, _, _ = windowed(make_cache, memory_budget=budget)
    slot = cache.alloc()
    seq = decode(cache, slot, 0, 8 * tpp, 1 if tpp <= 64 else tpp // 8)
    assert cache.seq_len(slot) == seq
    assert cache.stats()["oom_events"] == 0
    assert cache.stats()["bytes_mapped"] <= budget


def test_window_config_errors_name_the_value():
    base = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        max_batch_size=1,
        max_seq_len=64,
        dtype=torch.float16,
        page_size="4KB",
    )
    for bad, match in [
        (0, r"sliding_window=0 must be an int >= 1"),
        (True, r"sliding_window=True"),
        ([64], r"sliding_window has 1 entries; it needs one per layer"),
        ([64, -1], r"sliding_window\[1\]=-1 must be an int >= 1"),
        ("64", r"sliding_window='64' must be an int"),
    ]:
        with pytest.raises(vattention.ConfigError, match=match):
            vattention.KVCacheConfig(**base, sliding_window=bad)
    cfg = vattention.KVCacheConfig(**base, sliding_window=[None, 16])
    assert cfg.sliding_window == (None, 16) and cfg.layer_windows == (0, 16)
    assert vattention.KVCacheConfig(**base, sliding_window=16).layer_windows == (16, 16)
