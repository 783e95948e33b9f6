"""Per-layer KV shapes: hybrid models whose layers differ in KV heads or head dim.

Each layer's tensors are shaped for it and all layers draw on one page pool. A slot grows by page
indices of `tokens_per_page` tokens; layer l maps `index_pages(l)` pages per index, exactly in
proportion to its bytes per token (geometry.h). Every path runs on the host backend and on the CUDA
backend (through the driver emulation here), at 64 KB and 2 MB pages.
"""

from __future__ import annotations

import pytest
import torch

import vattention

from support.cuda_setup import skip_below_gpu_pages
from support.helpers import PAGE_STATE_KEYS, check_pattern, kv_views
from support.share_helpers import bits, fast_fill

# fp16 token strides 512, 128, 256, 256 bytes: gcd 128, so 4, 1, 2, 2 pages per index and layer.
HYBRID = dict(num_layers=4, num_kv_heads=(4, 1, 2, 1), head_dim=(64, 64, 64, 128))
INDEX_PAGES = (4, 1, 2, 2)
UNIT = 128


@pytest.fixture
def make(device, page_size):
    """Factory for per-layer-shape caches (layer layout) on the parametrized device/page size."""
    caches = []

    def make_one(*, memory_budget=None, **kwargs):
        args = dict(
            HYBRID,
            max_batch_size=3,
            max_seq_len=4 * _tpp(page_size),
            dtype=torch.float16,
            device=device,
            page_size=page_size,
            layout="layer",
        )
        args.update(kwargs)
        skip_below_gpu_pages(device, args["page_size"])
        cache = vattention.KVCache(vattention.KVCacheConfig(**args), memory_budget=memory_budget)
        caches.append(cache)
        return cache

    yield make_one
    for cache in caches:
        if not cache.closed:
            assert cache._core.check_invariants() == ""
            cache.close()
    caches.clear()


def _tpp(page_size):
    return vattention.config.parse_size(page_size) // UNIT


def _state(cache):
    stats = cache.stats()
    state = {k: stats[k] for k in PAGE_STATE_KEYS}
    slots = range(cache.config.max_batch_size)
    state["lens"] = [(cache.seq_len(s), cache.mapped_tokens(s)) for s in slots]
    return state


# ---- configuration ----------------------------------------------------------------------------


def test_config_derives_page_indices_from_the_layer_shapes():
    cfg = vattention.KVCacheConfig(
        **HYBRID, max_batch_size=2, max_seq_len=1000, dtype=torch.float16, page_size="64KB"
    )
    assert cfg.per_layer_shapes
    assert cfg.layer_kv_heads == (4, 1, 2, 1) and cfg.layer_head_dims == (64, 64, 64, 128)
    assert [cfg.layer_token_bytes(i) for i in range(4)] == [512, 128, 256, 256]
    assert cfg.unit_bytes == UNIT
    assert tuple(cfg.index_pages(i) for i in range(4)) == INDEX_PAGES
    assert cfg.pages_per_index == 2 * sum(INDEX_PAGES) == 18
    assert cfg.tokens_per_page == 512
    assert cfg.bytes_per_token == 2 * (512 + 128 + 256 + 256)
    assert cfg.tensor_token_bytes == 512  # the largest layer's
    assert [cfg.pages_for_tokens(n) for n in (0, 1, 512, 513)] == [0, 18, 18, 36]
    assert cfg.pages_per_slot == 2  # 1000 tokens need 2 indices of 512
    assert cfg.virtual_bytes == 18 * 2 * 2 * 64 * 1024
    # One page index is exactly its tokens' bytes: no layer is padded to another's shape.
    assert cfg.pages_per_index * cfg.page_bytes == cfg.tokens_per_page * cfg.bytes_per_token


def test_equal_entries_collapse_to_one_shape():
    cfg = vattention.KVCacheConfig(
        num_layers=3,
        num_kv_heads=[2, 2, 2],
        head_dim=(64, 64, 64),
        max_batch_size=1,
        max_seq_len=16,
        dtype=torch.float16,
    )
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 64 and not cfg.per_layer_shapes
    assert cfg == vattention.KVCacheConfig(
        num_layers=3,
        num_kv_heads=2,
        head_dim=64,
        max_batch_size=1,
        max_seq_len=16,
        dtype=torch.float16,
    )
    assert cfg.pages_per_index == cfg.num_tensors == 6


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(num_kv_heads=(4, 1, 2)),
            r"num_kv_heads has 3 entries; it needs one per layer \(num_layers=4\)",
        ),
        (dict(head_dim=(64, 64, 64, 64, 64)), r"head_dim has 5 entries; it needs one per layer"),
        (dict(num_kv_heads=(4, 0, 2, 1)), r"num_kv_heads\[1\]=0 must be a positive int"),
        (dict(head_dim=(64, -64, 64, 64)), r"head_dim\[1\]=-64 must be a positive int"),
        (dict(num_kv_heads=(4, True, 2, 1)), r"num_kv_heads\[1\]=True must be a positive int"),
        (dict(head_dim=(64, 64.0, 64, 64)), r"head_dim\[1\]=64.0 must be a positive int"),
        (dict(num_kv_heads="4"), r"num_kv_heads='4' must be a positive int, or a sequence"),
        (dict(layout="mega"), r"per-layer shapes need layout='layer'"),
        (
            dict(num_kv_heads=(1, 1, 1, 64), head_dim=64, dtype=torch.float32, page_size="4KB"),
            r"holds less than one token: a token row of one 'layer'-layout tensor is 16384 bytes",
        ),
    ],
)
def test_bad_per_layer_shapes_are_config_errors(kwargs, message):
    args = dict(HYBRID, max_batch_size=2, max_seq_len=64, dtype=torch.float16)
    args.update(kwargs)
    with pytest.raises(vattention.ConfigError, match=message):
        vattention.KVCacheConfig(**args)


def test_coarse_page_indices_are_reported(caplog):
    # 576 and 512 bytes a token (fp8 latents): gcd 64, so 9 and 8 pages per index and tensor.
    cfg = vattention.KVCacheConfig(
        num_layers=2,
        num_kv_heads=1,
        head_dim=(576, 512),
        max_batch_size=1,
        max_seq_len=64,
        dtype=torch.float8_e4m3fn,
        page_size="4KB",
        value_cache=False,
    )
    with caplog.at_level("WARNING", logger="vattention.cache"):
        vattention.KVCache(cfg).close()
    assert "gcd of 64 bytes, so one page index holds 64 tokens and takes 17 pages" in caplog.text
    caplog.clear()
    fine = vattention.KVCacheConfig(
        **HYBRID, max_batch_size=1, max_seq_len=64, dtype=torch.float16, page_size="64KB"
    )
    with caplog.at_level("WARNING", logger="vattention.cache"):
        vattention.KVCache(fine).close()
    assert caplog.text == ""


def test_the_core_checks_per_layer_shapes_itself():
    # The Python config normalizes first; the core's geometry must not trust its caller either.
    base = dict(
        num_layers=4,
        num_kv_heads=1,
        head_dim=64,
        element_bytes=2,
        max_batch=2,
        max_seq=64,
        page_bytes=65536,
    )
    with pytest.raises(vattention.ConfigError, match=r"num_kv_heads has 3 entries"):
        vattention._C.CacheGeometry(**base, layer_kv_heads=[4, 1, 2])
    with pytest.raises(vattention.ConfigError, match=r"head_dim\[2\]=0 must be a positive"):
        vattention._C.CacheGeometry(**base, layer_head_dims=[64, 64, 0, 64])
    with pytest.raises(vattention.ConfigError, match=r"per-layer shapes need layout='layer'"):
        vattention._C.CacheGeometry(**base, mega=True, layer_kv_heads=[4, 1, 2, 1])


# ---- tensors and pages ------------------------------------------------------------------------


def test_each_layer_gets_its_own_shape_in_disjoint_reservations(make):
    cache = make()
    cfg = cache.config
    ranges = []
    for layer in range(cfg.num_layers):
        h, d = cfg.layer_kv_heads[layer], cfg.layer_head_dims[layer]
        k, v = kv_views(cache, layer)
        row = cfg.pages_per_slot * cfg.page_bytes * INDEX_PAGES[layer] // cfg.element_bytes
        for t in (k, v):
            assert tuple(t.shape) == (3, cfg.max_seq_len, h, d)
            assert t.stride() == (row, h * d, d, 1)
            assert t.dtype == torch.float16
        assert (k.data_ptr(), v.data_ptr()) == cache.layer_ptrs(layer)
        for ptr in cache.layer_ptrs(layer):
            ranges.append((ptr, ptr + 3 * row * cfg.element_bytes))
    ranges.sort()
    assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), "reservations overlap"
    assert cache.stats()["virtual_bytes"] == cfg.virtual_bytes


def test_pages_follow_each_layers_bytes_exactly(make):
    cache = make()
    cfg = cache.config
    tpp = cfg.tokens_per_page
    slot = cache.alloc()
    for n in (1, tpp, tpp + 1, 3 * tpp - 1, 4 * tpp):
        cache.step({slot: n})
        stats = cache.stats()
        indices = -(-n // tpp)
        assert stats["pages_mapped"] == cfg.pages_for_tokens(n) == indices * 18
        assert cache.mapped_tokens(slot) == min(indices * tpp, cfg.max_seq_len)
        # Physical bytes are the tokens' bytes rounded up to one page index, in every layer.
        assert stats["bytes_mapped"] == cache.mapped_tokens(slot) * cfg.bytes_per_token
        assert stats["bytes_used_by_tokens"] == n * cfg.bytes_per_token
        assert stats["tokens_per_page"] == tpp
    assert cache._core.check_invariants() == ""


def test_a_padded_uniform_cache_would_hold_more(make):
    # The alternative without per-layer shapes: every layer at the largest shape (4 x 128).
    hybrid = make()
    padded = make(num_kv_heads=4, head_dim=128)
    n = 2 * hybrid.config.tokens_per_page
    for cache in (hybrid, padded):
        cache.step({cache.alloc(): n})
    held = hybrid.stats()["bytes_mapped"], padded.stats()["bytes_mapped"]
    assert held[0] == n * hybrid.config.bytes_per_token
    assert held[1] == n * 2 * 4 * 4 * 128 * 2
    assert held[1] / held[0] == pytest.approx(2 * 4 * 1024 / hybrid.config.bytes_per_token)


def test_data_survives_growth_other_slots_and_reuse(make):
    cache = make()
    tpp = cache.config.tokens_per_page
    a, b = cache.alloc(), cache.alloc()
    cache.step({a: tpp - 3, b: 5})
    wa = fast_fill(cache, a, 0, tpp - 3, seed=1)
    wb = fast_fill(cache, b, 0, 5, seed=2)
    cache.step({a: 2 * tpp + 7, b: tpp + 1})
    wa += []  # the first tokens must be unchanged by the growth
    check_pattern(cache, a, 0, tpp - 3, wa)
    check_pattern(cache, b, 0, 5, wb)
    wa2 = fast_fill(cache, a, tpp - 3, 2 * tpp + 7, seed=3)
    cache.free(b)
    maps = cache.stats()["map_calls"]
    c = cache.alloc()
    assert c == b  # the idle slot with pages: deferred reclamation
    cache.step({c: tpp + 1})
    assert cache.stats()["map_calls"] == maps  # inherited mapped memory, no map call
    check_pattern(cache, a, tpp - 3, 2 * tpp + 7, wa2)
    check_pattern(cache, a, 0, tpp - 3, wa)


def test_prefetch_maps_every_layer_for_the_next_step(make):
    cache = make()
    tpp = cache.config.tokens_per_page
    slot = cache.alloc()
    cache.step({slot: 10})
    cache.prefetch({slot: 2 * tpp + 1})
    cache.wait()
    stats = cache.stats()
    assert stats["prefetch_map_calls"] == 2 * 18
    assert stats["pages_mapped"] == 3 * 18
    cache.step({slot: 2 * tpp + 1})
    assert cache.stats()["step_map_calls"] == 18  # the first index only; the rest was prefetched
    written = fast_fill(cache, slot, 0, 2 * tpp + 1, seed=4)
    check_pattern(cache, slot, 0, 2 * tpp + 1, written)


def test_running_out_of_pages_is_all_or_nothing(make):
    page = vattention.config.parse_size(make().config.page_size)
    cache = make(memory_budget=2 * 18 * page + 17 * page)  # 2 indices and 17 pages: not a third
    tpp = cache.config.tokens_per_page
    a, b = cache.alloc(), cache.alloc()
    cache.step({a: tpp + 1})
    written = fast_fill(cache, a, 0, tpp + 1, seed=5)
    before = _state(cache)
    with pytest.raises(vattention.OutOfPagesError) as err:
        cache.step({a: tpp + 2, b: 1})
    assert err.value.pages_needed == 18 and err.value.pages_available == 17
    assert _state(cache) == before
    check_pattern(cache, a, 0, tpp + 1, written)
    cache.free(a)
    cache.step({b: tpp + 1})  # takes the idle slot's pages
    assert cache._core.check_invariants() == ""


def test_fork_swap_and_copy_on_write_are_bit_exact(make):
    cache = make()
    cfg = cache.config
    tpp = cfg.tokens_per_page
    src = cache.alloc()
    n = tpp + tpp // 2  # one full index shared, half an index copied
    cache.step({src: n})
    written = fast_fill(cache, src, 0, n, seed=6)
    child = cache.fork(src)
    check_pattern(cache, child, 0, n, written)
    stats = cache.stats()
    # The partial index: half of each tensor's run, so ceil(index_pages / 2) pages per tensor.
    assert stats["cow_pages_copied"] == 2 * sum(-(-p // 2) for p in INDEX_PAGES)
    assert stats["pages_mapped"] == 3 * 18  # src's 2 indices + the child's fresh partial index
    assert cache.ensure_private(child, 0) == 18  # the shared index, every layer's pages
    for layer in range(cfg.num_layers):
        k, v = kv_views(cache, layer)
        k[child, :n] = 0
        v[child, :n] = 0
    check_pattern(cache, src, 0, n, written)
    handle = cache.swap_out(src)
    assert cache.stats()["pages_mapped"] == 2 * 18
    back = cache.swap_in(handle)
    check_pattern(cache, back, 0, n, written)
    assert cache.seq_len(back) == n


def test_windows_release_each_layers_own_pages(make):
    cache = make(sliding_window=(None, 64, None, 64), max_seq_len=8 * _tpp(make().config.page_size))
    cfg = cache.config
    tpp = cfg.tokens_per_page
    slot = cache.alloc()
    cache.step({slot: 1})
    for n in range(2, 5 * tpp, tpp // 4):
        cache.step({slot: n})
    n = cache.seq_len(slot)
    indices = -(-n // tpp)
    full = 2 * (INDEX_PAGES[0] + INDEX_PAGES[2])  # layers 0 and 2 keep everything
    windowed = 2 * (INDEX_PAGES[1] + INDEX_PAGES[3])
    kept = indices - (n - 64) // tpp  # windowed layers keep the indices from (n - 64) on
    assert cache.stats()["pages_mapped"] == indices * full + kept * windowed
    assert cache.stats()["window_released_pages"] == (indices - kept) * windowed
    assert [cache.window_start(slot, layer) for layer in range(4)] == [
        0,
        (indices - kept) * tpp,
        0,
        (indices - kept) * tpp,
    ]
    gen = torch.Generator().manual_seed(7)
    written = {}
    for layer in range(4):  # full layers from token 0, windowed ones from their window start
        start = cache.window_start(slot, layer)
        k, _ = kv_views(cache, layer)
        written[layer] = torch.randn(n - start, *k.shape[2:], generator=gen).to(cfg.dtype)
        k[slot, start:n] = written[layer]
    handle = cache.swap_out(slot)
    back = cache.swap_in(handle)
    assert cache.stats()["pages_mapped"] == indices * full + kept * windowed
    for layer in range(4):
        start = cache.window_start(back, layer)
        k, _ = kv_views(cache, layer)
        assert torch.equal(bits(k[back, start:n]), bits(written[layer])), f"layer {layer}"


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float16], ids=str)
def test_k_only_latent_caches_with_per_layer_widths(make, dtype):
    # MLA-style latents of two widths, K only: 576 and 512 elements per token.
    cache = make(num_kv_heads=1, head_dim=(576, 512, 576, 512), value_cache=False, dtype=dtype)
    cfg = cache.config
    e = cfg.element_bytes
    assert cfg.unit_bytes == 64 * e and [cfg.index_pages(i) for i in range(4)] == [9, 8, 9, 8]
    assert cfg.pages_per_index == 34
    slot = cache.alloc()
    n = cfg.tokens_per_page + 3
    cache.step({slot: n})
    assert cache.stats()["pages_mapped"] == 2 * 34
    gen = torch.Generator().manual_seed(8)
    data = []
    for layer in range(4):
        k, v = kv_views(cache, layer)
        head_dim = cfg.layer_head_dims[layer]
        assert v is None and k.dtype == dtype and tuple(k.shape[2:]) == (1, head_dim)
        raw = torch.randint(0, 127, (n, 1, head_dim), generator=gen, dtype=torch.uint8)
        x = raw.view(dtype) if e == 1 else raw.to(dtype)
        k[slot, :n] = x
        data.append(x)
    child = cache.fork(slot)
    for layer in range(4):
        k, _ = kv_views(cache, layer)
        assert torch.equal(bits(k[child, :n]), bits(data[layer]))
        assert torch.equal(bits(k[slot, :n]), bits(data[layer]))


def test_scrub_zeroes_every_layers_pages(make):
    cache = make(scrub=True)
    tpp = cache.config.tokens_per_page
    a = cache.alloc()
    cache.step({a: tpp + 1})
    fast_fill(cache, a, 0, tpp + 1, seed=9)
    cache.free(a)
    b = cache.alloc()
    assert b == a  # the idle slot: its pages are handed over, zeroed
    cache.step({b: 2 * tpp + 1})  # and one fresh index from the pool
    for layer in range(4):
        for t in kv_views(cache, layer):
            assert not t[b, : 2 * tpp + 1].any(), f"layer {layer} not zeroed"
    assert cache.stats()["scrubbed_pages"] == 2 * 18 + 3 * 18


def test_bad_input_leaves_a_per_layer_cache_unchanged(make):
    cache = make()
    slot = cache.alloc()
    cache.step({slot: 10})
    before = _state(cache)
    with pytest.raises(vattention.SequenceTooLongError):
        cache.step({slot: cache.config.max_seq_len + 1})
    with pytest.raises(vattention.ConfigError, match=r"layer=4 is out of range \[0, 4\)"):
        cache.layer(4)
    assert _state(cache) == before
