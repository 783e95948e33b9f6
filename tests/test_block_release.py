"""Elastic memory for caches named by engine blocks: release_blocks(), the headroom, the budget.

An engine's scheduler decides which blocks keep pages (live blocks, cached ones up to a cap) and
tells the worker each step which blocks give their pages back (``release_blocks``) and its page
budget (``set_memory_budget``); the prefetch thread keeps a headroom of created but free pages
(``set_headroom``) so that page creation stays off the step's critical path. Checked on the host
backend and the CUDA backend (the driver emulation here), with exact page counts and the data
rows read back; tests/test_cuda_inflight.py has the fence against a kernel in flight, and
tests/test_sparse.py the memory the OS gets back.
"""

from __future__ import annotations

import pytest
import torch
from test_block_tables import TPP, _config, _read, _write

import vattention

from support.helpers import page_state

pytestmark = pytest.mark.not_on_gpu("64 KB pages (a GPU takes 2 MB) and CPU reads via host_alias")


@pytest.fixture
def make(device, layout):
    caches = []

    def build(budget=None, **kw):
        kw.setdefault("num_blocks", 16)
        kw.setdefault("block_cache", True)
        cache = vattention.KVCache(_config(device, layout, **kw), memory_budget=budget)
        caches.append(cache)
        return cache

    yield build
    for cache in caches:
        assert cache.closed or cache._core.check_invariants() == ""
        cache.close()
    caches.clear()


def _state(cache):
    """What a refused call must leave as it was: pages, lengths, every stats() key, the tables."""
    slots = range(cache.config.max_batch_size)
    return page_state(cache), cache.stats(), [cache.block_table(s) for s in slots]


# ---- release_blocks ---------------------------------------------------------------------------


def test_an_idle_row_unmaps_from_the_first_released_block(make):
    cache = make()
    per_block = cache.config.pages_per_index
    a = cache.alloc()
    cache.step({a: 3 * TPP}, blocks={a: (0, [1, 2, 3], 0)})
    _write(cache, a, 0, 3 * TPP, tag=4)
    cache.free(a)  # idle: the row still maps 1, 2, 3 for a prefix hit in place
    free = cache.stats()["pages_free"]
    assert cache.release_blocks([2]) == per_block  # 3 leaves the row but keeps its pages
    s = cache.stats()
    assert cache.mapped_tokens(a) == TPP
    assert s["pages_free"] == free + per_block
    assert (s["blocks_with_pages"], s["cached_blocks"]) == (2, 1)  # 1 (in the row) and 3
    assert (s["blocks_released"], s["pages_released_by_blocks"]) == (1, per_block)
    # The row still serves block 1 in place; block 3 is still a hit, from another row.
    b = cache.alloc(hits=[1])
    assert b == a
    maps = cache.stats()["map_calls"]
    cache.step({b: TPP + 1}, blocks={b: (0, [1, 9], 1)})
    assert cache.stats()["block_hits_in_place"] == 1
    assert cache.stats()["map_calls"] == maps + per_block  # block 9 only
    assert _read(cache, b, 0, TPP) == [4000.0 + t for t in range(TPP)]
    c = cache.alloc()
    cache.step({c: TPP}, blocks={c: (0, [3], 1)})
    assert _read(cache, c, 0, TPP) == [4000.0 + t for t in range(2 * TPP, 3 * TPP)]


def test_a_hit_on_a_released_block_is_refused_and_a_fresh_one_is_fine(make):
    cache = make()
    a = cache.alloc()
    cache.step({a: 2 * TPP}, blocks={a: (0, [1, 2], 0)})
    cache.free(a)
    cache.release_blocks([1, 2])
    b = cache.alloc(hits=[1])  # no row maps it any more: any slot will do
    before = _state(cache)
    with pytest.raises(vattention.ConfigError, match=r"block 1 .* holds no pages"):
        cache.step({b: TPP}, blocks={b: (0, [1], 1)})
    assert _state(cache) == before
    cache.step({b: TPP}, blocks={b: (0, [1], 0)})  # handed out fresh: new content
    _write(cache, b, 0, TPP, tag=2)
    assert _read(cache, b, 0, TPP) == [2000.0 + t for t in range(TPP)]


def test_an_active_row_keeps_released_pages_until_it_unmaps_them(make):
    cache = make()
    per_block = cache.config.pages_per_index
    a = cache.alloc()
    cache.step({a: 2 * TPP}, blocks={a: (0, [1, 2], 0)})
    _write(cache, a, 0, 2 * TPP, tag=5)
    free = cache.stats()["pages_free"]
    assert cache.release_blocks([1, 2]) == 0  # the request may still read them
    s = cache.stats()
    assert s["blocks_with_pages"] == 0 and s["blocks_detached"] == 2
    assert s["pages_free"] == free and cache.mapped_tokens(a) == 2 * TPP
    assert cache.block_table(a) == [[1, 2]]  # the engine's table, as it gave it
    cache.step({a: 2 * TPP + 1}, blocks={a: (2, [3], 0)})
    assert _read(cache, a, 0, 2 * TPP) == [5000.0 + t for t in range(2 * TPP)]
    assert cache.stats()["blocks_with_pages"] == 1  # 3: nor 1 nor 2 came back to the row
    free = cache.stats()["pages_free"]
    cache.free(a)
    cache.reclaim()  # the row unmaps: the anonymous pages go, block 3 stays cached
    assert cache.stats()["pages_free"] == free + 2 * per_block
    assert cache.stats()["blocks_with_pages"] == 1


def test_a_released_window_block_goes_with_the_rows_window(make):
    # vLLM frees the blocks a window passed, and may evict them before the row (not scheduled
    # meanwhile) released them: the row keeps them until its own window release.
    cache = make(sliding_window=32)
    per_block = cache.config.pages_per_index
    a = cache.alloc()
    cache.step({a: 64}, blocks={a: (0, [1, 2, 3, 4], 0)})
    assert cache.release_blocks([1]) == 0
    released = cache.stats()["window_released_pages"]
    cache.step({a: 65}, blocks={a: (4, [5], 0)})  # the row's window release: index 0 goes
    s = cache.stats()
    assert cache.window_start(a, 0) >= TPP
    assert s["window_released_pages"] == released + per_block  # 1's pages, to the free list
    assert s["pages_mapped"] == 4 * per_block and s["blocks_with_pages"] == 4  # 2, 3, 4, 5


def test_blocks_without_pages_and_duplicates(make):
    cache = make()
    per_block = cache.config.pages_per_index
    a = cache.alloc()
    cache.step({a: TPP}, blocks={a: (0, [4], 0)})
    cache.free(a)
    before = _state(cache)
    assert cache.release_blocks([]) == 0
    assert cache.release_blocks([7, 0, 15]) == 0  # never filled
    assert _state(cache) == before
    assert cache.release_blocks([4, 4, 4]) == per_block
    assert cache.stats()["blocks_released"] == 1
    assert cache.release_blocks(torch.tensor([4])) == 0  # it has no pages any more
    assert cache.stats()["blocks_released"] == 1


BAD_IDS = [
    ([-1], vattention.ConfigError, r"block -1 \(ids\[0\]\) is negative.*num_blocks=16"),
    ([3, -7], vattention.ConfigError, r"block -7 \(ids\[1\]\) is negative"),
    ([16], vattention.ConfigError, r"block 16 \(ids\[0\]\) is outside \[0, 16\)"),
    ([2, 2**40], vattention.ConfigError, r"block 1099511627776 .* outside \[0, 16\)"),
    ([2**70], vattention.ConfigError, r"block 1180591620717411303424 is outside \[0, 16\)"),
    ([1.0], vattention.ArgumentTypeError, r"ids\[\]=1.0 must be an int"),
    ([True], vattention.ArgumentTypeError, r"got a bool"),
    ("12", vattention.ArgumentTypeError, r"sequence of block ids"),
    (7, vattention.ArgumentTypeError, r"sequence of block ids"),
    (torch.tensor([1.0]), vattention.ArgumentTypeError, r"1-D integer tensor"),
]


@pytest.mark.parametrize("case", range(len(BAD_IDS)))
def test_bad_ids_are_refused_with_nothing_changed(make, case):
    cache = make()
    a, b = cache.alloc(), cache.alloc()
    cache.step({a: 2 * TPP, b: TPP}, blocks={a: (0, [2, 3], 0), b: (0, [5], 0)})
    cache.free(b)
    before = _state(cache)
    ids, error, message = BAD_IDS[case]
    with pytest.raises(error, match=message) as info:
        cache.release_blocks(ids)
    if error is vattention.ConfigError and ids[-1] < 2**63:
        assert (info.value.block, info.value.num_blocks) == (ids[-1], 16)
    assert _state(cache) == before


def test_release_blocks_needs_a_cache_named_by_blocks(device, layout):
    with vattention.KVCache(_config(device, layout)) as cache:
        for ids in ([1], [-1], [2**70]):
            with pytest.raises(
                vattention.ConfigError, match=r"release_blocks\(\) needs .*num_blocks"
            ):
                cache.release_blocks(ids)
    with pytest.raises(vattention.CacheClosedError):
        cache.release_blocks([1])


def test_without_block_cache_an_idle_rows_blocks_go_with_it(make):
    cache = make(block_cache=False)
    per_block = cache.config.pages_per_index
    a = cache.alloc()
    cache.step({a: 3 * TPP}, blocks={a: (0, [1, 2, 3], 0)})
    cache.free(a)
    assert cache.release_blocks([2]) == 2 * per_block  # 2, and 3 which the row alone held
    assert cache.mapped_tokens(a) == TPP and cache.stats()["blocks_with_pages"] == 1


def test_release_waits_for_a_slot_the_prefetch_thread_maps(make):
    # The prefetch thread may be mapping a's look-ahead when a is freed; release_blocks may unmap
    # that idle row, so it waits for the mapping to publish (rule R). Repeated for timing.
    cache = make(lookahead_tokens=4 * TPP)
    for _ in range(20):
        a = cache.alloc()
        cache.step({a: TPP}, blocks={a: (0, [1], 0)})
        cache.prefetch({a: TPP})
        cache.free(a)
        cache.release_blocks([1])
        assert cache._core.check_invariants() == ""
        cache.wait()
        cache.reclaim()
        assert cache._core.check_invariants() == ""


# ---- the budget: what a step may take ---------------------------------------------------------


def test_a_step_under_a_tight_budget_takes_another_rows_look_ahead(make):
    # Row a holds prefetched look-ahead (anonymous pages beyond its length); c is idle and maps
    # cached blocks (kept for hits in place). With the budget full, the step that gives b a new
    # block takes a's look-ahead: the only pages it can free.
    cache = make(lookahead_tokens=2 * TPP)
    per_block = cache.config.pages_per_index
    a, b, c = cache.alloc(), cache.alloc(), cache.alloc()
    cache.step({a: TPP, c: 2 * TPP}, blocks={a: (0, [1], 0), c: (0, [2, 3], 0)})
    cache.free(c)
    cache.prefetch({a: TPP})
    cache.wait()
    assert cache.mapped_tokens(a) == 3 * TPP  # two page indices of look-ahead
    cache.set_memory_budget(cache.stats()["pages_total"] * cache.config.page_bytes)
    assert cache.stats()["pages_free"] == 0
    cache.step({a: TPP, b: TPP}, blocks={b: (0, [4], 0)})
    assert cache.mapped_tokens(a) == 2 * TPP  # one page index of look-ahead went to b
    assert cache.mapped_tokens(c) == 2 * TPP  # the cached blocks stay mapped in c
    assert cache.stats()["step_pages_created"] == 3 * per_block  # a's and c's first step only
    cache.step({a: TPP, b: 2 * TPP}, blocks={b: (1, [5], 0)})  # the rest of a's look-ahead
    assert cache.mapped_tokens(a) == TPP and cache.mapped_tokens(c) == 2 * TPP
    with pytest.raises(vattention.OutOfPagesError) as info:
        cache.step({a: TPP, b: 3 * TPP}, blocks={b: (2, [6], 0)})
    assert info.value.pages_available == 0  # c's pages are blocks 2 and 3's
    assert cache.release_blocks([3]) == per_block  # the scheduler evicts one: it pays
    cache.step({a: TPP, b: 3 * TPP}, blocks={b: (2, [6], 0)})
    assert cache.mapped_tokens(c) == TPP


def test_a_step_under_a_tight_budget_takes_an_idle_rows_anonymous_pages(make):
    cache = make(lookahead_tokens=TPP)
    a, b, d = cache.alloc(), cache.alloc(), cache.alloc()
    cache.step({a: TPP, d: TPP}, blocks={a: (0, [1], 0), d: (0, [2], 0)})
    cache.prefetch({d: TPP})
    cache.wait()
    cache.free(d)  # idle: block 2 (cached), then a page index of anonymous look-ahead
    assert cache.mapped_tokens(d) == 2 * TPP
    cache.set_memory_budget(cache.stats()["pages_total"] * cache.config.page_bytes)
    cache.step({a: TPP, b: TPP}, blocks={b: (0, [5], 0)})
    assert cache.mapped_tokens(d) == TPP  # its block stays mapped for a hit in place
    _write(cache, b, 0, TPP, tag=3)
    assert _read(cache, b, 0, TPP) == [3000.0 + t for t in range(TPP)]
    assert cache.stats()["step_pages_created"] == 2 * cache.config.pages_per_index


# ---- the headroom -----------------------------------------------------------------------------


def test_the_prefetch_thread_keeps_the_headroom_within_the_budget(make):
    cache = make()
    P, per_block = cache.config.page_bytes, cache.config.pages_per_index
    cache.set_memory_budget(8 * per_block * P)
    cache.set_headroom(2 * per_block * P)
    cache.wait()
    s = cache.stats()
    assert s["pages_free"] == 2 * per_block and s["headroom_bytes"] == 2 * per_block * P
    assert s["background_pages_created"] == 2 * per_block and s["step_pages_created"] == 0
    a = cache.alloc()
    cache.step({a: 2 * TPP}, blocks={a: (0, [1, 2], 0)})  # takes the headroom's pages
    assert cache.stats()["step_pages_created"] == 0
    cache.wait()  # the refill ran behind the step
    s = cache.stats()
    assert s["pages_free"] == 2 * per_block and s["background_pages_created"] == 4 * per_block
    b = cache.alloc()
    cache.step({b: 5 * TPP}, blocks={b: (0, [3, 4, 5, 6, 7], 0)})  # more than the headroom
    s = cache.stats()
    assert s["step_pages_created"] == 3 * per_block and s["step_page_create_ns"] > 0
    cache.wait()
    s = cache.stats()
    assert s["pages_total"] == 8 * per_block  # the budget caps the refill
    assert s["pages_free"] == per_block
    cache.set_memory_budget(None)
    cache.wait()
    assert cache.stats()["pages_free"] == 2 * per_block


def test_lowering_the_budget_trims_the_headroom_and_raising_it_refills(make):
    cache = make()
    P, per_block = cache.config.page_bytes, cache.config.pages_per_index
    cache.set_headroom(4 * per_block * P)
    cache.wait()
    a = cache.alloc()
    cache.step({a: TPP}, blocks={a: (0, [1], 0)})
    cache.wait()
    assert cache.stats()["pages_total"] == 5 * per_block
    destroyed = cache.stats()["pages_destroyed"]
    assert cache.set_memory_budget(3 * per_block * P) == 0
    s = cache.stats()
    assert s["pages_total"] == 3 * per_block and s["pages_free"] == 2 * per_block
    assert s["pages_destroyed"] == destroyed + 2 * per_block and s["page_destroy_ns"] > 0
    cache.step({a: 2 * TPP}, blocks={a: (1, [2], 0)})
    cache.wait()
    assert cache.stats()["pages_total"] == 3 * per_block  # no refill beyond the budget
    cache.set_memory_budget(6 * per_block * P)
    cache.wait()
    assert cache.stats()["pages_free"] == 4 * per_block
    cache.set_headroom(0)
    cache.step({a: 4 * TPP}, blocks={a: (2, [3, 4], 0)})
    cache.wait()
    assert cache.stats()["pages_free"] == 2 * per_block  # a headroom of 0 creates nothing


@pytest.mark.parametrize(
    "size, error, message",
    [
        (-1, vattention.ConfigError, r"headroom=-1 must be >= 0 bytes"),
        ("-2MB", vattention.ConfigError, r"headroom='-2MB' is not a size"),
        (1.5, vattention.ConfigError, r"headroom must be an int"),
        (True, vattention.ConfigError, r"headroom must be an int"),
        ("1TB", vattention.ConfigError, r"headroom=1099511627776 bytes .* exceeds what this"),
    ],
)
def test_bad_headroom_is_refused_with_nothing_changed(make, size, error, message):
    cache = make()
    cache.set_headroom(cache.config.page_bytes)
    cache.wait()
    before = _state(cache)
    with pytest.raises(error, match=message):
        cache.set_headroom(size)
    cache.wait()
    assert _state(cache) == before


def test_the_worker_loop_creates_no_page_inline_once_the_headroom_covers_a_step(make):
    # The vLLM worker's loop in miniature: each step the scheduler releases what it evicted,
    # sets the budget to (blocks with pages + headroom) x pages per block and steps; the prefetch
    # thread keeps the headroom. Steps after the first never create a page themselves.
    cache = make(max_batch_size=4)
    P, per_block = cache.config.page_bytes, cache.config.pages_per_index
    headroom = 3  # blocks: what one step's rows may need at most
    cache.set_headroom(headroom * per_block * P)
    cache.wait()
    tables = {}
    lens = {}
    cached = []  # (block): evictable, oldest first
    next_id = 0
    for step in range(40):
        if len(tables) < 3:
            slot = cache.alloc()
            tables[slot], lens[slot] = [], 0
        updates = {}
        for slot in tables:
            lens[slot] += 8
            if cache.config.geometry.pages_for(lens[slot]) > len(tables[slot]):
                block = next_id % 16
                while block in cached or any(block in t for t in tables.values()):
                    next_id += 1
                    block = next_id % 16
                next_id += 1
                updates[slot] = (len(tables[slot]), [block], 0)
                tables[slot].append(block)
        evict = cached[:-2]  # the scheduler keeps two cached blocks
        del cached[:-2]
        cache.release_blocks(evict)
        with_pages = cache.stats()["blocks_with_pages"]
        budget = (with_pages + len(updates) + headroom) * per_block * P
        assert cache.set_memory_budget(budget) == 0
        created = cache.stats()["step_pages_created"]
        cache.step(dict(lens), blocks=updates)
        if step > 0:
            assert cache.stats()["step_pages_created"] == created, step
        done = [s for s in tables if lens[s] >= 3 * TPP]
        for slot in done:
            cache.free(slot)
            cached.extend(tables.pop(slot))
            del lens[slot]
        cache.wait()  # the next step's scheduling: the refill ran meanwhile
        assert cache._core.check_invariants() == ""
    s = cache.stats()
    assert s["blocks_released"] > 0 and s["background_pages_created"] > 0
