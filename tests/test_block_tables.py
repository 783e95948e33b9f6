"""Pages named by an engine's block ids (csrc/core/block_tables.h).

A block-based engine gives each request a block table; a row of the cache maps the pages of its
table in order, a cache hit maps the same physical pages again (zero copy), and a block's pages
live with the block: past the row that filled them while the engine may still hit them
(``block_cache=True``), until the engine hands the id out fresh. Checked with exact page and call
counts, on the host backend and the CUDA backend (the driver emulation here), and against a small
engine (``Engine`` below: vLLM's block pool, prefix caching and window release in miniature) with
the data every row reads back.
"""

from __future__ import annotations

import collections
import random

import pytest
import torch

import vattention

from support.helpers import page_state

# The cuda cases run at 64 KB pages (the emulation's suite granularity) and read the rows from
# the CPU through host_alias: neither works on a GPU.
pytestmark = pytest.mark.not_on_gpu("64 KB pages (a GPU takes 2 MB) and CPU reads via host_alias")

TPP = 16  # tokens per page index: 1 KV head x 64 float32 in 4 KB pages (8 KB: mega, 2 layers)


@pytest.fixture
def page_size():
    return "4KB"


def _config(device, layout, **kw):
    # The emulated CUDA driver's granularity is 64 KB: 16 KV heads keep 16 tokens per page there.
    heads = 1 if device == "cpu" else 16
    base = dict(
        num_layers=2,
        num_kv_heads=heads,
        head_dim=64,
        max_batch_size=4,
        max_seq_len=512,
        dtype=torch.float32,
        device=device,
        layout=layout,
    )
    base.update(kw)
    base["page_size"] = f"{4 * heads * (base['num_layers'] if layout == 'mega' else 1)}KB"
    cfg = vattention.KVCacheConfig(**base)
    assert cfg.tokens_per_page == TPP
    return cfg


@pytest.fixture
def make(device, layout):
    caches = []

    def build(budget=None, **kw):
        cache = vattention.KVCache(_config(device, layout, **kw), memory_budget=budget)
        caches.append(cache)
        return cache

    yield build
    for cache in caches:
        assert cache.closed or cache._core.check_invariants() == ""
        cache.close()
    caches.clear()


def _views(cache, layer=0):
    return cache.host_alias(layer)


def _write(cache, slot, start, end, tag):
    """Token t of `slot` holds tag * 1000 + t in every layer's K and V."""
    values = (torch.arange(start, end, dtype=torch.float32) + tag * 1000).view(-1, 1, 1)
    for layer in range(cache.config.num_layers):
        for t in _views(cache, layer):
            t[slot, start:end] = values.expand(-1, t.shape[2], t.shape[3])


def _read(cache, slot, start, end, layer=0):
    k, _ = _views(cache, layer)
    return k[slot, start:end, 0, 0].tolist()


# ---- the basics: fresh blocks, hits, what stays and what goes ---------------------------------


def test_a_hit_maps_the_same_pages_again(make):
    cache = make(num_blocks=16, block_cache=True)
    per_block = cache.config.pages_per_index
    a = cache.alloc()
    cache.step({a: 40}, blocks={a: (0, [5, 6, 7], 0)})
    _write(cache, a, 0, 40, tag=1)
    created = cache.stats()["pages_created"]
    b = cache.alloc()
    cache.step({b: 36}, blocks={b: (0, [5, 6, 9], 2)})  # two hits, one fresh block
    stats = cache.stats()
    assert stats["pages_created"] == created + per_block  # only the fresh block's pages
    assert stats["block_hits"] == 2
    assert stats["pages_mapped"] == 4 * per_block
    assert stats["mappings"] == 6 * per_block
    assert stats["bytes_saved_by_sharing"] == 2 * per_block * cache.config.page_bytes
    assert _read(cache, b, 0, 32) == [1000.0 + t for t in range(32)]  # a's tokens, zero copy
    assert cache.block_table(b) == [[5, 6, 9]]


def test_a_hit_on_a_block_filled_in_the_same_step(make):
    # vLLM caches a block when it schedules the step that fills it: a request scheduled after the
    # filler in that step hits it, and reads what the filler writes (appends come first).
    cache = make(num_blocks=16, block_cache=True)
    a, b = cache.alloc(), cache.alloc()
    cache.step({a: 32, b: 20}, blocks={a: (0, [1, 2], 0), b: (0, [1, 3], 1)})
    _write(cache, a, 0, 32, tag=7)
    assert _read(cache, b, 0, 16) == [7000.0 + t for t in range(16)]
    stats = cache.stats()
    assert stats["block_hits"] == 1
    assert stats["pages_created"] == 3 * cache.config.pages_per_index  # blocks 1, 2, 3


def test_with_block_cache_a_block_outlives_its_rows(make):
    cache = make(num_blocks=16, block_cache=True)
    a = cache.alloc()
    cache.step({a: 32}, blocks={a: (0, [3, 4], 0)})
    _write(cache, a, 0, 32, tag=2)
    cache.free(a)
    cache.reclaim()  # the row's mappings go
    stats = cache.stats()
    assert (stats["mappings"], stats["cached_blocks"]) == (0, 2)
    assert stats["pages_mapped"] == 2 * cache.config.pages_per_index  # held by the blocks
    b = cache.alloc()
    cache.step({b: 20}, blocks={b: (0, [3, 8], 1)})  # block 3 hit after its row went
    assert _read(cache, b, 0, 16) == [2000.0 + t for t in range(16)]


def test_without_block_cache_pages_go_with_the_last_mapping(make):
    cache = make(num_blocks=16)
    a = cache.alloc()
    cache.step({a: 32}, blocks={a: (0, [3, 4], 0)})
    cache.free(a)
    cache.reclaim()
    stats = cache.stats()
    assert (stats["pages_mapped"], stats["blocks_with_pages"]) == (0, 0)
    b = cache.alloc()
    with pytest.raises(vattention.ConfigError, match="block_cache=True"):
        cache.step({b: 20}, blocks={b: (0, [3, 8], 1)})  # no prefix cache, no hits


def test_a_fresh_id_reuses_its_old_pages_in_place(make):
    cache = make(num_blocks=16, block_cache=True)
    a = cache.alloc()
    cache.step({a: 16}, blocks={a: (0, [3], 0)})
    cache.free(a)
    cache.reclaim()
    created = cache.stats()["pages_created"]
    b = cache.alloc()
    cache.step({b: 16}, blocks={b: (0, [3], 0)})  # the engine evicted and reuses 3
    stats = cache.stats()
    assert stats["pages_created"] == created and stats["blocks_reused"] == 1
    assert stats["pages_mapped"] == cache.config.pages_per_index


def test_a_fresh_id_an_idle_row_maps_is_taken_from_it(make):
    cache = make(num_blocks=16, block_cache=True)
    a, c = cache.alloc(), cache.alloc()
    cache.step({a: 32}, blocks={a: (0, [3, 4], 0)})
    cache.free(a)  # idle: still maps 3 and 4
    assert cache.stats()["idle_slots_with_pages"] == 1
    cache.step({c: 16}, blocks={c: (0, [4], 0)})  # 4 handed out fresh
    assert cache.stats()["idle_slots_with_pages"] == 0  # a's row was unmapped first
    assert cache._core.check_invariants() == ""


def test_hits_an_idle_row_still_maps_cost_no_map_call(make):
    """A shared system prompt: the next request in a slot keeps the hit blocks its row still
    maps (zero map calls for them), and only the disagreeing tail is replaced."""
    cache = make(num_blocks=16, block_cache=True)
    a = cache.alloc()
    cache.step({a: 48}, blocks={a: (0, [1, 2, 3], 0)})
    _write(cache, a, 0, 48, tag=5)
    one = cache.stats()["map_calls"] // 3  # map calls of one block
    cache.free(a)
    b = cache.alloc()
    assert b == a  # the idle row is picked again
    before = cache.stats()
    cache.step({b: 40}, blocks={b: (0, [1, 2, 7], 2)})  # hits on 1 and 2, 7 fresh
    after = cache.stats()
    assert after["map_calls"] - before["map_calls"] == one  # block 7 only
    assert after["block_hits"] - before["block_hits"] == 2
    assert _read(cache, b, 0, 32) == [5000.0 + t for t in range(32)]
    assert cache.block_table(b) == [[1, 2, 7]]
    assert cache._core.check_invariants() == ""
    cache.free(b)
    c = cache.alloc()
    cache.step({c: 16}, blocks={c: (0, [9], 0)})  # disagrees at once: all replaced
    assert cache.block_table(c) == [[9]]
    assert cache._core.check_invariants() == ""


def test_alloc_with_hits_takes_the_idle_row_that_still_maps_them(make):
    """Three system prompts, rows left idle by their last requests: a new request with hits on
    one of them gets the row mapping the longest run of its hits, and its step maps only its
    fresh block. Without hits, the idle row with the most pages."""
    cache = make(num_blocks=32, block_cache=True)
    prompts = {"x": [1, 2, 3], "y": [4, 5], "z": [6]}
    rows = {}
    for name, ids in prompts.items():
        rows[name] = cache.alloc()
        cache.step({rows[name]: TPP * len(ids)}, blocks={rows[name]: (0, ids, 0)})
        _write(cache, rows[name], 0, TPP * len(ids), tag=ord(name))
    for row in rows.values():
        cache.free(row)
    one = cache.stats()["map_calls"] // 6  # map calls of one block
    b = cache.alloc(hits=[4, 5])
    assert b == rows["y"]  # not x's row, which maps more
    before = cache.stats()
    cache.step({b: 2 * TPP + 3}, blocks={b: (0, [4, 5, 9], 2)})
    after = cache.stats()
    assert after["map_calls"] - before["map_calls"] == one  # block 9 only
    assert after["block_hits"] - before["block_hits"] == 2
    assert _read(cache, b, 0, 2 * TPP) == [ord("y") * 1000.0 + t for t in range(2 * TPP)]
    assert cache.alloc(hits=[1, 7]) == rows["x"]  # a run of one hit still counts
    assert cache.alloc() == rows["z"]  # the last idle row
    assert cache._core.check_invariants() == ""


def test_alloc_without_a_row_mapping_the_hits_falls_back(make):
    cache = make(num_blocks=16, block_cache=True)
    a = cache.alloc()
    cache.step({a: TPP}, blocks={a: (0, [3], 0)})
    cache.free(a)
    assert cache.alloc(hits=[8]) == a  # no row maps 8: the idle row with pages, as alloc()
    b = cache.alloc(hits=[])  # no hits at all: any slot
    assert b != a


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (
            dict(hits=[16]),
            vattention.ConfigError,
            r"block 16 at page index 0 \(group 0\) is outside "
            r"\[0, 16\) \(num_blocks=16",
        ),
        (dict(hits=[[1], [2]]), vattention.ConfigError, "2 groups of block ids; the cache has 1"),
        (dict(hits="12"), TypeError, "hits must be a sequence of block ids"),
        (dict(hits=[1.5]), TypeError, "block ids"),
    ],
)
def test_alloc_refuses_bad_hits_with_nothing_changed(make, kw, error, match):
    cache = make(num_blocks=16, block_cache=True)
    before = cache.stats()
    with pytest.raises(error, match=match):
        cache.alloc(**kw)
    assert cache.stats() == before


def test_alloc_hits_need_a_cache_named_by_blocks(make):
    cache = make()
    with pytest.raises(
        vattention.ConfigError,
        match=r"alloc\(hits=...\) needs a cache whose "
        r"pages are named by engine blocks",
    ):
        cache.alloc(hits=[1])
    assert cache.stats()["active_slots"] == 0


def test_scrub_keeps_the_hits_an_idle_row_hands_on_and_clears_its_fresh_ids(make):
    """scrub=True zeroes what changes owner. An idle row's blocks stay the engine's (a hit on
    them reads their tokens, in that row or another); a block the engine hands out fresh to the
    row that already maps it is cleared."""
    cache = make(num_blocks=16, block_cache=True, scrub=True)
    a = cache.alloc()
    cache.step({a: 2 * TPP}, blocks={a: (0, [1, 2], 0)})
    _write(cache, a, 0, 2 * TPP, tag=7)
    cache.free(a)
    b = cache.alloc(hits=[1])
    assert b == a
    cache.step({b: 2 * TPP}, blocks={b: (0, [1, 2], 1)})  # 1 hit, 2 fresh again (evicted)
    assert _read(cache, b, 0, TPP) == [7000.0 + t for t in range(TPP)]
    assert _read(cache, b, TPP, 2 * TPP) == [0.0] * TPP
    c = cache.alloc()
    cache.step({c: TPP + 1}, blocks={c: (0, [1, 3], 1)})  # the hit from another row
    assert _read(cache, c, 0, TPP) == [7000.0 + t for t in range(TPP)]
    assert cache._core.check_invariants() == ""


def test_a_fresh_block_adopts_prefetched_pages_without_a_map_call(make):
    cache = make(num_blocks=16, block_cache=True)
    a = cache.alloc()
    cache.step({a: 16}, blocks={a: (0, [2], 0)})
    cache.prefetch({a: 17})  # next step's page, anonymous
    cache.wait()
    before = cache.stats()
    cache.step({a: 17}, blocks={a: (1, [9], 0)})  # the engine's next block
    after = cache.stats()
    assert after["step_map_calls"] == before["step_map_calls"]
    assert after["blocks_adopted"] == 1
    assert cache.block_table(a) == [[2, 9]]
    cache.step({a: 32})  # block 9 full: the engine caches it
    _write(cache, a, 16, 32, tag=3)
    b = cache.alloc()
    cache.step({b: 33}, blocks={b: (0, [2, 9, 10], 2)})  # hits on the adopted block too
    assert _read(cache, b, 16, 32) == [3000.0 + t for t in range(16, 32)]


def test_a_replaced_table_remaps_from_the_first_disagreement(make):
    cache = make(num_blocks=16, block_cache=True)
    a = cache.alloc()
    cache.step({a: 48}, blocks={a: (0, [1, 2, 3], 0)})
    _write(cache, a, 0, 48, tag=4)
    b = cache.alloc()
    cache.step({b: 48}, blocks={b: (0, [1, 2, 5], 0 + 2)})
    cache.step({b: 48}, blocks={b: (0, [1, 6, 7], 1)})  # resumed: a new table
    assert cache.block_table(b) == [[1, 6, 7]]
    assert _read(cache, b, 0, 16) == [4000.0 + t for t in range(16)]  # block 1 kept
    assert cache._core.check_invariants() == ""


def test_tables_grow_by_appends_across_steps(make):
    cache = make(num_blocks=32)
    a = cache.alloc()
    cache.step({a: 10}, blocks={a: (0, [4], 0)})
    for n in range(11, 70):
        update = {a: (len(cache.block_table(a)[0]), [10 + n // TPP], 0)} if n % TPP == 1 else None
        cache.step({a: n}, blocks=update)
    assert cache.block_table(a) == [[4, 11, 12, 13, 14]]
    assert cache.stats()["pages_mapped"] == 5 * cache.config.pages_per_index


def test_a_fresh_id_an_active_row_still_maps_is_detached(make):
    # The engine freed block 1 from a's window (a was not scheduled, so its row did not release
    # it yet) and hands it fresh to c: a keeps its pages as anonymous ones, 1 gets new pages.
    cache = make(num_blocks=16, block_cache=True, sliding_window=32)
    a, c = cache.alloc(), cache.alloc()
    cache.step({a: 64}, blocks={a: (0, [1, 2, 3, 4], 0)})
    _write(cache, a, 0, 64, tag=5)
    cache.step({c: 16}, blocks={c: (0, [1], 0)})
    assert cache.stats()["blocks_detached"] == 1
    _write(cache, c, 0, 16, tag=6)
    assert _read(cache, a, 0, 64) == [5000.0 + t for t in range(64)]  # a's pages untouched
    assert _read(cache, c, 0, 16) == [6000.0 + t for t in range(16)]
    cache.step({a: 65}, blocks={a: (4, [5], 0)})  # a's own release drops them
    assert cache.window_start(a, 0) >= 16 and cache._core.check_invariants() == ""


# ---- hybrid groups and windows ----------------------------------------------------------------


def test_groups_follow_their_own_tables_and_windows_release_blocks(device):
    # Layer 0 is a sliding-window layer (group 1), layer 1 full attention (group 0), as vLLM's
    # hybrid KV cache manager groups a Gemma-3-like model.
    cfg = _config(
        device,
        "layer",
        sliding_window=[32, None],
        layer_groups=[1, 0],
        num_blocks=64,
        block_cache=True,
    )
    with vattention.KVCache(cfg) as cache:
        assert (cfg.num_groups, cfg.geometry.group_width) == (2, 2)
        a = cache.alloc()
        cache.step({a: 16}, blocks={a: (0, [[1], [2]], 0)})
        nxt = 3
        for n in range(17, 129):
            update = None
            if n % TPP == 1:
                size = len(cache.block_table(a)[0])
                update = {a: (size, [[nxt], [nxt + 1]], 0)}
                nxt += 2
            cache.step({a: n}, blocks=update)
        assert cache.window_start(a, 1) == 0 and cache.window_start(a, 0) >= 96 - TPP
        stats = cache.stats()
        # The full group maps all 8 blocks, the windowed one the 2 holding keys 96..127 (the last
        # query, 127, reads (127 - 32, 127]; vLLM frees blocks below (127 - 32 + 1) // 16 = 6).
        assert stats["mappings"] == (8 + 2) * 2
        assert stats["cached_blocks"] == 6  # released window blocks kept
        assert cache._core.check_invariants() == ""


def test_a_block_moves_between_groups_of_different_widths(device):
    # vLLM pads a KV cache group short of layers (Gemma 3: six groups of 4 local layers and one
    # of 2): a block then holds the pages of the group that filled it; handed to a wider group it
    # takes new pages, to a group as wide it reuses its own.
    cfg = _config(
        device, "layer", num_layers=3, layer_groups=[0, 0, 1], num_blocks=16, block_cache=True
    )
    with vattention.KVCache(cfg) as cache:
        assert cfg.geometry.group_width == 4  # group 0: 2 layers x K,V; group 1: 2
        a = cache.alloc()
        cache.step({a: 16}, blocks={a: (0, [[1], [2]], 0)})
        created = cache.stats()["pages_created"]
        b = cache.alloc()
        cache.step({b: 16}, blocks={b: (0, [[2], [1]], 0)})  # ids swap groups, fresh
        assert cache.stats()["blocks_reused"] == 0
        assert cache.stats()["pages_created"] == created + 6  # a still maps both: all new
        c = cache.alloc()  # an empty row
        cache.free(b)  # b's row still maps block 1
        cache.step({c: 16}, blocks={c: (0, [[5], [1]], 0)})  # 1 (2 pages) in a 2-wide group
        assert cache.stats()["blocks_reused"] == 1  # b's idle row gave it up
        assert cache._core.check_invariants() == ""


def test_groups_keep_one_window_and_layout(device):
    with pytest.raises(vattention.ConfigError, match="share one window"):
        _config(
            device,
            "layer",
            num_layers=4,
            sliding_window=[8, None, 8, 8],
            layer_groups=[0, 0, 1, 1],
            num_blocks=4,
        )
    with pytest.raises(vattention.ConfigError, match="need layout='layer'"):
        _config(device, "mega", layer_groups=[0, 1], num_blocks=4)


# ---- bad input and running out ----------------------------------------------------------------

BAD_UPDATES = [
    (lambda a, b: {a: (0, [1, 2, 99], 0)}, r"outside \[0, 16\)"),
    (lambda a, b: {a: (3, [1], 0)}, r"starts at page index 3 but its table has 2"),
    (lambda a, b: {a: (0, [1, 2, 3], 1)}, r"is a cache hit but holds no pages"),
    (lambda a, b: {a: (0, [1, 5, 5], 0)}, r"handed out fresh twice"),
    (lambda a, b: {a: (0, [-1, 2, 3], 0)}, r"null block .* leading cache hits"),
    (lambda a, b: {a: (0, [1], 0)}, r"needs page indices \[0, 3\)"),
    (lambda a, b: {b: (0, [1], 0)}, r"comes with no length"),
    (lambda a, b: {a: (0, [[1, 2, 3], [4, 5, 6]], 0)}, r"has 2 groups of block ids"),
    (lambda a, b: {a: (2, [3], 5)}, r"says 5 of its 1 blocks are cache hits"),
]


@pytest.mark.parametrize("case", range(len(BAD_UPDATES)))
def test_bad_tables_are_refused_with_nothing_changed(make, case):
    cache = make(num_blocks=16, block_cache=True)
    a, b = cache.alloc(), cache.alloc()
    cache.step({a: 20}, blocks={a: (0, [7, 8], 0)})
    before, table = page_state(cache), cache.block_table(a)
    update, message = BAD_UPDATES[case]
    with pytest.raises(vattention.ConfigError, match=message):
        cache.step({a: 40}, blocks=update(a, b))
    assert page_state(cache) == before and cache.block_table(a) == table


def test_tables_need_a_cache_named_by_blocks(make):
    cache = make()
    a = cache.alloc()
    with pytest.raises(vattention.ConfigError, match="num_blocks"):
        cache.step({a: 16}, blocks={a: (0, [1], 0)})


def test_a_swap_budget_is_refused_on_a_block_cache(device, layout):
    with pytest.raises(vattention.ConfigError, match="swap_budget="):
        vattention.KVCache(_config(device, layout, num_blocks=16), swap_budget="1MB")


@pytest.mark.parametrize("call", ["fork", "share_prefix", "swap_out", "ensure_private"])
def test_sharing_and_swap_are_refused_on_a_block_cache(make, call):
    cache = make(num_blocks=16)
    a, b = cache.alloc(), cache.alloc()
    cache.step({a: 16}, blocks={a: (0, [1], 0)})
    args = {"fork": (a,), "share_prefix": (a, b, 8), "swap_out": (a,), "ensure_private": (a, 0)}
    with pytest.raises(vattention.ConfigError, match="named by engine blocks"):
        getattr(cache, call)(*args[call])


def test_running_out_maps_nothing_new(make):
    cache = make(num_blocks=16, block_cache=True)
    cache.set_memory_budget(6 * cache.config.pages_per_index * cache.config.page_bytes)
    a = cache.alloc()
    cache.step({a: 64}, blocks={a: (0, [1, 2, 3, 4], 0)})
    b = cache.alloc()
    with pytest.raises(vattention.OutOfPagesError) as info:
        cache.step({a: 64, b: 48}, blocks={b: (0, [5, 6, 7], 0)})
    assert info.value.pages_needed == 3 * cache.config.pages_per_index
    assert cache.mapped_tokens(b) == 0 and cache.seq_len(a) == 64
    cache.step({a: 64, b: 48}, blocks={b: (0, [1, 2, 5], 2)})  # hits need no new pages
    assert cache._core.check_invariants() == ""


def test_running_out_after_replacing_a_table_leaves_the_row_backing_its_length(make):
    # The new table cuts the row's old tail before the step runs out of pages: those tokens are
    # named by no table any more, so the row's length becomes what it still backs (it stayed
    # longer before, over unmapped memory).
    cache = make(num_blocks=16, block_cache=True)
    cache.set_memory_budget(4 * cache.config.pages_per_index * cache.config.page_bytes)
    a = cache.alloc()
    cache.step({a: 2 * TPP}, blocks={a: (0, [1, 2], 0)})
    with pytest.raises(vattention.OutOfPagesError):
        cache.step({a: 3 * TPP}, blocks={a: (0, [3, 4, 5], 0)})
    assert cache.block_table(a) == [[3, 4, 5]]  # the tables stay recorded
    assert cache.seq_len(a) <= cache.mapped_tokens(a)
    assert cache._core.check_invariants() == ""
    cache.step({a: 2 * TPP}, blocks={a: (0, [3, 4], 0)})  # the engine goes on with a new table
    assert cache.mapped_tokens(a) >= 2 * TPP and cache._core.check_invariants() == ""


def test_a_failed_map_undoes_every_row(layout):
    # Host fault injection; tests/test_fault_sweep.py fails every driver call of block steps on
    # the emulated CUDA backend too.
    cfg = _config("cpu", layout, num_blocks=16, block_cache=True)
    with vattention.KVCache(cfg) as cache:
        a, b = cache.alloc(), cache.alloc()
        cache.step({a: 16}, blocks={a: (0, [1], 0)})
        before = page_state(cache)
        cache._core.inject_host_fault("map", cache.config.pages_per_index * 2 + 1)
        with pytest.raises(vattention.DriverError):
            cache.step({a: 40, b: 40}, blocks={a: (1, [2, 3], 0), b: (0, [1, 4, 5], 1)})
        assert cache._core.check_invariants() == ""
        assert page_state(cache)["mapped_tokens"] == before["mapped_tokens"]
        cache.step({a: 40, b: 40}, blocks={a: (1, [2, 3], 0), b: (0, [1, 4, 5], 1)})
        assert cache._core.check_invariants() == ""


# ---- a small engine: what every row reads back ------------------------------------------------


class Engine:
    """vLLM's block accounting in miniature: a pool of ids (0 is the null block), an LRU free
    queue, prefix caching by content hash of full blocks, window release (blocks wholly before
    the window are freed when the request is scheduled again; a freed block keeps its hash and
    may be hit until it is handed out fresh), preemption. Tokens are ints; K/V of token t of a
    request with tokens `toks` is toks[t] (so equal prefixes have equal K/V, as in a model)."""

    def __init__(self, cache, num_blocks, caching, window, rng):
        self.cache, self.caching, self.window, self.rng = cache, caching, window, rng
        self.free = collections.OrderedDict((b, None) for b in range(1, num_blocks))
        self.hash_of, self.by_hash = {}, {}
        self.ref = collections.Counter()
        self.reqs = {}  # rid -> dict(tokens, table, computed, slot)
        self.next_rid = 0

    def _take(self):
        if not self.free:
            return None
        b, _ = self.free.popitem(last=False)
        h = self.hash_of.pop(b, None)  # evicted from the prefix cache: its content is dead
        if h is not None:
            del self.by_hash[h]
        self.ref[b] += 1
        return b

    def _release(self, b):
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free[b] = None  # the tail: least recently used first out

    def add(self, prefix_pool):
        toks = list(self.rng.choice(prefix_pool)) + [
            self.rng.randrange(10**6) for _ in range(self.rng.randrange(1, 40))
        ]
        self.reqs[self.next_rid] = dict(
            tokens=toks,
            table=[],
            computed=0,
            slot=None,
            target=len(toks) + self.rng.randrange(1, 60),
        )
        self.next_rid += 1

    def _hits(self, toks):
        out = []
        if not self.caching:
            return out
        for i in range((len(toks) - 1) // TPP):
            h = tuple(toks[: (i + 1) * TPP])
            b = self.by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def step(self):
        lens, updates = {}, {}
        for r in list(self.reqs.values()):
            if r["slot"] is None:  # admission
                if len(lens) >= self.cache.config.max_batch_size:
                    continue
                hits = self._hits(r["tokens"])
                for b in hits:
                    if self.ref[b] == 0:
                        del self.free[b]
                    self.ref[b] += 1
                computed = len(hits) * TPP
                need = -(-len(r["tokens"]) // TPP) - len(hits)
                fresh = [self._take() for _ in range(need)]
                if None in fresh:
                    for b in hits + [b for b in fresh if b is not None]:
                        self._release(b)
                    continue
                # As the plugin does: the row that still maps the hits, if any (half the time).
                slot = self.cache.alloc(hits=hits if self.rng.random() < 0.5 else None)
                r.update(table=hits + fresh, computed=computed, slot=slot)
                updates[r["slot"]] = (0, list(r["table"]), len(hits))
                r["new_from"] = computed
                lens[r["slot"]] = len(r["tokens"])
                self._cache_full_blocks(r, lens[r["slot"]])
                continue
            # running: one token more
            n = len(r["tokens"])
            if self.window:
                dead = max(0, r["computed"] - self.window + 1) // TPP
                for i in range(dead):
                    if r["table"][i] != 0:
                        self._release(r["table"][i])
                        r["table"][i] = 0  # the engine's copy; the worker's keeps the id
            r["tokens"].append(self.rng.randrange(10**6))
            if (n + 1) > len(r["table"]) * TPP:
                b = self._take()
                if b is None:  # preempt it
                    self.cache.free(r["slot"])
                    for x in r["table"]:
                        if x:
                            self._release(x)
                    r.update(slot=None, table=[], computed=0)
                    continue
                r["table"].append(b)
                updates[r["slot"]] = (len(r["table"]) - 1, [b], 0)
            r["new_from"] = n
            lens[r["slot"]] = n + 1
            self._cache_full_blocks(r, n + 1)
        return lens, updates

    def _cache_full_blocks(self, r, length):
        """As vLLM does when it schedules a step: blocks full by its end get their hash now, so
        a request scheduled later in the same step may hit them."""
        if not self.caching:
            return
        for i in range(length // TPP):
            b = r["table"][i]
            h = tuple(r["tokens"][: (i + 1) * TPP])
            if b and b not in self.hash_of and h not in self.by_hash:
                self.hash_of[b], self.by_hash[h] = h, b

    def after_step(self, lens):
        for rid, r in list(self.reqs.items()):
            if r["slot"] is None or r["slot"] not in lens:
                continue
            r["computed"] = lens[r["slot"]]
            if r["computed"] >= r["target"]:
                self.cache.free(r["slot"])
                for b in r["table"]:
                    if b:
                        self._release(b)
                del self.reqs[rid]


def _write_tokens(cache, slot, toks, start, end):
    values = torch.tensor(toks[start:end], dtype=torch.float32).view(-1, 1, 1)
    for layer in range(cache.config.num_layers):
        for t in _views(cache, layer):
            t[slot, start:end] = values.expand(-1, t.shape[2], t.shape[3])


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("window", [None, 40])
def test_rows_read_back_what_the_engine_wrote(device, caching, window):
    rng = random.Random(11 + caching + (window or 0))
    # scrub: an idle row's pages go to the next request, the hits among them must not be zeroed.
    cfg = _config(
        device,
        "mega" if window is None else "layer",
        num_layers=2,
        max_batch_size=6,
        max_seq_len=256,
        sliding_window=window,
        num_blocks=40,
        block_cache=caching,
        scrub=window is None,
    )
    with vattention.KVCache(cfg, memory_budget=40 * cfg.pages_per_index * cfg.page_bytes) as cache:
        engine = Engine(cache, 40, caching, window, rng)
        prefixes = [[rng.randrange(10**6) for _ in range(n)] for n in (0, 16, 35, 48)]
        checked = hits_seen = 0
        for step in range(300):
            if len(engine.reqs) < 8 and rng.random() < 0.5:
                engine.add(prefixes)
            lens, updates = engine.step()
            if not lens:
                continue
            cache.step(lens, blocks=updates or None)
            if rng.random() < 0.3:
                cache.prefetch({s: min(256, n + 1) for s, n in lens.items()})
            for r in engine.reqs.values():
                s = r["slot"]
                if s is None or s not in lens:
                    continue
                _write_tokens(cache, s, r["tokens"], r["new_from"], lens[s])
                lo = cache.window_start(s, 0) if window else 0
                got = _read(cache, s, lo, lens[s])
                assert got == [float(x) for x in r["tokens"][lo : lens[s]]], (step, s)
                checked += 1
            engine.after_step(lens)
            assert cache._core.check_invariants() == ""
        hits_seen = cache.stats()["block_hits"]
        assert checked > 500
        assert (hits_seen > 0) == caching
        cache.wait()
