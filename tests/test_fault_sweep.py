"""Fail every backend entry point at every call index of every public call.

For each scenario (a small cache brought into a state, then one public call) the call is first run
once to count how often it calls each entry point (host backend: its primitives; emulated CUDA:
the driver entry points). Then, for every entry point and every call index k, a fresh cache in the
same state runs the call with the k-th call of that entry point failing. Afterwards:

- the call raised a typed error (a VAttentionError), or succeeded (a failure absorbed by a retry);
- when it raised: the same stats() (less cumulative call counters and the pool's size, see
  STATE_EXEMPT), the same mapped tokens and lengths per slot, the same data;
- check_invariants() is clean, and the cache still works (a step that needs new pages succeeds);
- after close(): the emulated driver holds nothing (no handle, mapping, event, host allocation)
  and no driver rule was violated.

Configurations are small (one layer, 64 KB pages, a few pages per call) so the sweep stays a few
seconds per backend. The scenarios that map, copy or restore pages also run on a per-layer-shape
cache (two K-only layers of 512 and 256 bytes a token: 2 + 1 pages per page index), where one page
index is a run of several pages in a tensor.
"""

from __future__ import annotations

import gc

import pytest
import torch

import vattention

from support.cuda_setup import CUDA_MODE, cuda_emu
from support.helpers import check_pattern, fill_pattern

HOST_OPS = ("reserve", "create_page", "destroy_page", "map", "set_access", "unmap")
CUDA_ENTRIES = (
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuMemcpyAsync",
    "cuMemcpyDtoDAsync",
    "cuMemcpyDtoHAsync",
    "cuMemcpyHtoDAsync",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuStreamSynchronize",
    "cuMemAddressReserve",
    "cuMemsetD8Async",
    "cuStreamCreate",
    "cuStreamDestroy",
    "cuCtxSynchronize",
)
# Cumulative counters (they count the calls a failed call and its rollback made) and the pool's
# size (pages created for a failed call may stay in the pool as free pages, invisible to requests).
STATE_EXEMPT = {
    "map_calls",
    "unmap_calls",
    "set_access_calls",
    "step_map_calls",
    "prefetch_map_calls",
    "pages_created",
    "pages_destroyed",
    "pages_total",
    "pages_free",
    "bytes_reserved",
    "committed_bytes",
    "huge_page_bytes",
    "oom_events",
    "fence_waits",
    "reclaimed_pages",
    "cow_pages_copied",
    "swap_out_pages",
    "swap_in_pages",
    "prefetch_shortfall_pages",
    "steps",
    "scrubbed_pages",
    "tail_zero_calls",
    "tail_zeroed_bytes",
    "step_driver_calls",
    "prefetch_driver_calls",
    "prefetch_errors",
    "block_hits",
    "block_hits_in_place",
    "blocks_adopted",
    "blocks_reused",
    "blocks_detached",
    "step_pages_created",
    "step_page_create_ns",
    "background_pages_created",
    "background_page_create_ns",
    "page_destroy_ns",
}


def _config(device, shapes="uniform"):
    heads = dict(
        uniform=dict(num_layers=1, num_kv_heads=2),
        per_layer=dict(num_layers=2, num_kv_heads=(4, 2), value_cache=False),
        blocks=dict(num_layers=1, num_kv_heads=2, num_blocks=32, block_cache=True),
    )[shapes]
    return vattention.KVCacheConfig(
        **heads,
        head_dim=64,
        max_batch_size=3,
        max_seq_len=2048,
        dtype=torch.float16,
        device=device,
        page_size="64KB",
    )


TPP = 256  # tokens per 64 KB page index: 2 heads x 64 x fp16 = 256 bytes a token (the gcd of 512
# and 256 bytes with per-layer shapes)


# Each scenario: setup(cache) -> ctx (a dict), then call(cache, ctx). ctx["live"] lists the
# (slot, tokens) whose data must survive a failed call.
def _two_active(cache):
    a, b = cache.alloc(), cache.alloc()
    cache.step({a: TPP + 10, b: 20})
    return {"a": a, "b": b, "live": [(a, TPP + 10), (b, 20)]}


def _two_active_scrubbed(cache):
    cache._core.set_scrub(True)  # KVCacheConfig(scrub=True): zeroing runs inside the mapping calls
    return _two_active(cache)


def _idle_and_active_scrubbed(cache):
    cache._core.set_scrub(True)
    return _idle_and_active(cache)


def _idle_and_active(cache):
    ctx = _two_active(cache)
    cache.free(ctx["b"])
    ctx["live"] = [(ctx["a"], TPP + 10)]
    return ctx


def _idle_under_budget(cache):
    ctx = _idle_and_active(cache)
    cache.set_memory_budget(cache.stats()["pages_mapped"] * 64 * 1024)  # growth needs the idle's
    return ctx


def _headroom_short(cache):
    """A headroom of 3 pages whose pages went (shrink): the next call that checks refills it."""
    ctx = _two_active(cache)
    cache.set_headroom(3 * 64 * 1024)
    cache.wait()
    cache.shrink(0)
    return ctx


def _reclaimed(cache):
    ctx = _idle_and_active(cache)
    cache.reclaim()
    return ctx


def _fresh_third(cache):
    ctx = _idle_and_active(cache)
    ctx["c"] = cache.alloc()  # the idle slot: it still holds a page
    return ctx


def _forked(cache):
    a = cache.alloc()
    cache.step({a: 2 * TPP + 10})
    child = cache.fork(a)
    # Only the parent's data is written: the child's prefix is read-only (shared pages).
    return {"a": a, "child": child, "live": [(a, 2 * TPP + 10)]}


def _swapped(cache):
    ctx = _forked(cache)
    ctx["handle"] = cache.swap_out(ctx["child"])
    ctx["live"] = [(ctx["a"], 2 * TPP + 10)]
    return ctx


def _swapped_orphan(cache):
    """A handle whose device pages no active slot maps, and another active slot to swap out."""
    ctx = _swapped(cache)
    cache.free(ctx["a"])
    ctx["other"] = cache.alloc()
    cache.step({ctx["other"]: 30})
    ctx["live"] = [(ctx["other"], 30)]
    return ctx


def _blocks_two_active(cache):
    a, b = cache.alloc(), cache.alloc()
    cache.step({a: TPP + 10, b: 20}, blocks={a: (0, [1, 2], 0), b: (0, [3], 0)})
    return {"a": a, "b": b, "live": [(a, TPP + 10), (b, 20)]}


def _blocks_full_and_fresh(cache):
    """a holds two full blocks (1, 2) the engine caches; c is a new request."""
    a = cache.alloc()
    cache.step({a: 2 * TPP}, blocks={a: (0, [1, 2], 0)})
    return {"a": a, "c": cache.alloc(), "live": [(a, 2 * TPP)]}


def _blocks_idle_rows(cache):
    """a runs with blocks 1, 2; b and c finished (idle, still mapping 3, 4 and 5)."""
    a, b, c = cache.alloc(), cache.alloc(), cache.alloc()
    cache.step(
        {a: TPP + 10, b: 2 * TPP, c: 20},
        blocks={a: (0, [1, 2], 0), b: (0, [3, 4], 0), c: (0, [5], 0)},
    )
    cache.free(b)
    cache.free(c)
    return {"a": a, "b": b, "c": c, "live": [(a, TPP + 10)]}


def _blocks_idle_row(cache):
    """b finished (idle, still mapping block 3); a runs; c, another slot, is a new request."""
    ctx = _blocks_two_active(cache)
    ctx["c"] = cache.alloc()
    cache.free(ctx["b"])
    ctx["live"] = [(ctx["a"], TPP + 10)]
    return ctx


SCENARIOS = {
    "alloc_idle": (_idle_and_active, lambda c, x: c.alloc()),
    "free": (_two_active, lambda c, x: c.free(x["a"])),
    "step_grow": (_two_active, lambda c, x: c.step({x["a"]: 3 * TPP, x["b"]: 2 * TPP})),
    "step_grow_scrub": (
        _two_active_scrubbed,
        lambda c, x: c.step({x["a"]: 3 * TPP, x["b"]: 2 * TPP}),
    ),
    "alloc_idle_scrub": (_idle_and_active_scrubbed, lambda c, x: c.alloc()),
    "step_reclaiming_idle": (_idle_under_budget, lambda c, x: c.step({x["a"]: 3 * TPP})),
    "prefetch_wait": (_two_active, lambda c, x: (c.prefetch({x["a"]: 3 * TPP}), c.wait())),
    "reserve": (_two_active, lambda c, x: c.reserve(20 * 64 * 1024)),
    "reclaim": (_idle_and_active, lambda c, x: c.reclaim()),
    "shrink": (_reclaimed, lambda c, x: c.shrink(0)),
    "set_memory_budget": (_idle_and_active, lambda c, x: c.set_memory_budget(4 * 64 * 1024)),
    # The prefetch thread refills the headroom (a prefetch with nothing to map asks it to); its
    # failure is raised by wait().
    "headroom_refill": (
        _headroom_short,
        lambda c, x: (c.prefetch({x["a"]: TPP + 10}, lookahead_tokens=0), c.wait()),
    ),
    "fork": (_two_active, lambda c, x: c.fork(x["a"])),
    "share_prefix": (_fresh_third, lambda c, x: c.share_prefix(x["a"], x["c"], TPP + 5)),
    "ensure_private": (_forked, lambda c, x: c.ensure_private(x["child"], 0)),
    "swap_out": (_forked, lambda c, x: c.swap_out(x["child"])),
    "swap_out_copying_orphans": (_swapped_orphan, lambda c, x: c.swap_out(x["other"])),
    "swap_in": (_swapped, lambda c, x: c.swap_in(x["handle"])),
    "swap_drop": (_swapped, lambda c, x: c.swap_drop(x["handle"])),
    "close": (_swapped, lambda c, x: c.close()),
}
# Pages named by an engine's block ids: tables grow, hit, take an idle row's block.
BLOCK_SCENARIOS = {
    "blocks_grow": (
        _blocks_two_active,
        lambda c, x: c.step(
            {x["a"]: 3 * TPP, x["b"]: 2 * TPP}, blocks={x["a"]: (2, [4], 0), x["b"]: (1, [5], 0)}
        ),
    ),
    "blocks_hit_and_fresh": (
        _blocks_full_and_fresh,
        lambda c, x: c.step(
            {x["a"]: 2 * TPP, x["c"]: 2 * TPP + 5}, blocks={x["c"]: (0, [1, 2, 6], 2)}
        ),
    ),
    "blocks_fresh_from_idle_row": (
        _blocks_idle_row,
        lambda c, x: c.step({x["a"]: TPP + 10, x["c"]: 20}, blocks={x["c"]: (0, [3], 0)}),
    ),
    # Two idle rows unmap from a released block (after a fence on the stream), the active row
    # keeps block 2's pages.
    "blocks_release": (_blocks_idle_rows, lambda c, x: c.release_blocks([2, 4, 5])),
}
# Calls whose failure is reported but need not leave the state as it was: close() closes anyway.
NOT_TRANSACTIONAL = {"close"}
# Calls that may reclaim pages holding no tokens (an idle slot's; a slot's pages beyond its length,
# as share_prefix's fresh destination) before the failing backend call: a failure may leave them
# reclaimed, as reclaim() would. For these, every slot's length and backing of that length are
# compared instead of its exact mapped tokens.
MAY_RECLAIM_UNUSED = {
    "set_memory_budget",
    "step_reclaiming_idle",
    "share_prefix",
    "blocks_fresh_from_idle_row",
    "blocks_release",
}
UNUSED_STATE = (
    "pages_mapped",
    "bytes_mapped",
    "mappings",
    "idle_slots_with_pages",
    "free_slots",
    "cached_blocks",
    "blocks_with_pages",
)


class Faults:
    """Counting and injection for one backend."""

    def __init__(self, device):
        self.device = device
        if device == "cpu":
            self.entries = HOST_OPS
        else:
            self.emu = cuda_emu.Emulator.load()
            self.entries = CUDA_ENTRIES

    def counts(self, cache):
        if self.device == "cpu":
            return {op: cache._core.host_backend_calls(op) for op in self.entries}
        return {e: self.emu.counter(e) for e in self.entries}

    def inject(self, cache, entry, nth):
        if self.device == "cpu":
            cache._core.inject_host_fault(entry, nth)
        else:
            self.emu.inject_fault(entry, nth, cuda_emu.CUDA_ERROR_UNKNOWN)

    def disarm(self, cache, entry):
        if self.device == "cpu":
            cache._core.inject_host_fault(entry, 0)
        else:
            self.emu.inject_fault(entry, 0, 0)

    def assert_released(self):
        if self.device == "cpu":
            return
        live = self.emu.live()
        if any(live.values()):  # only when needed: a full collection costs ~0.15-0.4 s here
            gc.collect()
            live = self.emu.live()
        assert self.emu.violations == 0, f"CUDA rule violated: {self.emu.last_violation()}"
        assert live == {k: 0 for k in live}, f"driver objects left after close(): {live}"


def _state(cache, name):
    stats = {k: v for k, v in cache.stats().items() if k not in STATE_EXEMPT}
    slots = range(cache.config.max_batch_size)
    stats["mapped_tokens"] = [cache.mapped_tokens(s) for s in slots]
    if name in MAY_RECLAIM_UNUSED:
        stats["mapped_tokens"] = [cache.mapped_tokens(s) >= cache.seq_len(s) for s in slots]
        for key in UNUSED_STATE:
            stats.pop(key, None)  # the block keys exist on caches whose pages blocks name
    stats["seq_lens"] = [cache.seq_len(s) for s in range(cache.config.max_batch_size)]
    return stats


def _prepare(device, setup, shapes):
    cache = vattention.KVCache(_config(device, shapes))
    ctx = setup(cache)
    ctx["data"] = [
        (slot, n, fill_pattern(cache, slot, 0, n, seed=slot + 1)) for slot, n in ctx["live"]
    ]
    return cache, ctx


def _sweep(device, name, shapes="uniform"):
    if device == "cuda:0":
        if CUDA_MODE != "emulated":
            pytest.skip("faults are injected through the CUDA emulation only")
        em = cuda_emu.Emulator.load()
        if any(em.live().values()):  # an earlier test's cache may await a collection
            gc.collect()
        assert not any(em.live().values()), f"earlier test left driver objects: {em.live()}"
        em.reset_for_suite()
    faults = Faults(device)
    setup, call = {**SCENARIOS, **BLOCK_SCENARIOS}[name]

    cache, ctx = _prepare(device, setup, shapes)
    before = faults.counts(cache)
    call(cache, ctx)
    after = faults.counts(cache)
    cache.close()
    del cache
    faults.assert_released()
    plan = [
        (entry, k) for entry in faults.entries for k in range(1, after[entry] - before[entry] + 1)
    ]
    if not plan:
        pytest.skip(f"{name} makes no call to this backend")

    for entry, k in plan:
        cache, ctx = _prepare(device, setup, shapes)
        state = _state(cache, name)
        faults.inject(cache, entry, k)
        try:
            call(cache, ctx)
            raised = None
        except vattention.VAttentionError as e:
            raised = e
        except Exception as e:  # noqa: BLE001 - an untyped error is the failure reported here
            pytest.fail(
                f"{name}: failing call {k} of {entry} raised untyped {type(e).__name__}: {e}"
            )
        faults.disarm(cache, entry)
        where = f"{name}: failing call {k} of {entry}"
        if raised is not None:
            if name not in NOT_TRANSACTIONAL:
                assert _state(cache, name) == state, f"{where}: state changed ({raised})"
        if not cache.closed:
            assert cache._core.check_invariants() == "", where
            if raised is not None:
                for slot, n, written in ctx["data"]:
                    check_pattern(cache, slot, 0, n, written)
            active = cache.active_slots()
            if active:  # still usable: a step that needs a new page
                slot = active[0]
                grow = {slot: min(cache.seq_len(slot) + TPP, 2048)}
                blocks = None
                if cache.config.num_blocks:  # a fresh block for the page index it needs
                    size = len(cache.block_table(slot)[0]) if cache.block_table(slot) else 0
                    need = cache.config.geometry.pages_for(grow[slot])
                    blocks = {slot: (size, list(range(20, 20 + need - size)), 0)}
                cache.step(grow, blocks=blocks)
                assert cache._core.check_invariants() == "", where
        cache.close()
        del cache, ctx, raised  # the exception's traceback holds frames that hold the cache
        faults.assert_released()


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_fault_at_every_call_index(device, name):
    _sweep(device, name)


PER_LAYER_SCENARIOS = [
    (device, name)
    for device in ("cpu", "cuda:0")
    for name in (
        "step_grow",
        "step_reclaiming_idle",
        "prefetch_wait",
        "share_prefix",
        "ensure_private",
        "swap_in",
    )
]


@pytest.mark.parametrize("device, name", PER_LAYER_SCENARIOS)
def test_fault_at_every_call_index_with_per_layer_shapes(device, name):
    _sweep(device, name, "per_layer")


@pytest.mark.parametrize("name", sorted(BLOCK_SCENARIOS))
@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_fault_at_every_call_index_with_engine_blocks(device, name):
    _sweep(device, name, "blocks")
