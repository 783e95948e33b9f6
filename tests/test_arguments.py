"""Every argument is checked at the boundary with a typed error naming it, nothing is truncated or
wrapped around, and a refused call changes nothing."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import vattention
from vattention import (
    ArgumentTypeError,
    CacheClosedError,
    ConfigError,
    InvalidSlotError,
    SequenceTooLongError,
    VAttentionError,
)

from support.helpers import check_pattern, fill_pattern, page_state

HUGE = 2**70


# Argument checks happen before the core's layout or page size matter: one of each keeps the suite
# short (the device stays parametrized: host and emulated CUDA).
@pytest.fixture
def layout():
    return "layer"


@pytest.fixture
def page_size():
    return "64KB"


def _host_cache(**kw):
    return vattention.KVCache(
        vattention.KVCacheConfig(
            num_layers=2,
            num_kv_heads=2,
            head_dim=64,
            max_batch_size=4,
            max_seq_len=4096,
            dtype=torch.float16,
            page_size="64KB",
            **kw,
        )
    )


@pytest.fixture
def busy(make_cache):
    """Slot a holds 700 tokens of data, b holds 300, a swap handle exists."""
    cache = make_cache(max_batch_size=4, max_seq_len=4096)
    a, b, c = cache.alloc(), cache.alloc(), cache.alloc()
    cache.step({a: 700, b: 300, c: 64})
    handle = cache.swap_out(c)
    written = {a: fill_pattern(cache, a, 0, 700, seed=1), b: fill_pattern(cache, b, 0, 300, seed=2)}
    return cache, a, b, handle, written


def unchanged(cache, before, written):
    assert page_state(cache) == before
    for slot, data in written.items():
        check_pattern(cache, slot, 0, len(data[0][0]), data)
    assert cache._core.check_invariants() == ""


# ---- floats and bools are refused, never truncated --------------------------------------------

FLOAT_CALLS = {
    "swap_in": lambda c, a, b, h: c.swap_in(h + 0.5),
    "swap_drop": lambda c, a, b, h: c.swap_drop(float(h)),
    "fork": lambda c, a, b, h: c.fork(a, 50.5),
    "fork_src": lambda c, a, b, h: c.fork(float(a)),
    "share_prefix": lambda c, a, b, h: c.share_prefix(a, b, 10.5),
    "ensure_private": lambda c, a, b, h: c.ensure_private(a, 2.5),
    "prefetch_lookahead": lambda c, a, b, h: c.prefetch({a: 800}, lookahead_tokens=2.5),
    "step_float_tensor": lambda c, a, b, h: c.step(torch.tensor([900.0, 300.0, 0.0, 0.0])),
    "step_bool_tensor": lambda c, a, b, h: c.step(torch.tensor([True, True, False, False])),
    "prefetch_float_tensor": lambda c, a, b, h: c.prefetch(torch.tensor([900.5, 0, 0, 0])),
    "step_bool_value": lambda c, a, b, h: c.step({a: True}),
    "step_numpy_float": lambda c, a, b, h: c.step(np.array([900.0, 300.0, 0.0, 0.0])),
    "layer_ptrs": lambda c, a, b, h: c.layer_ptrs(0.5),
    "layer": lambda c, a, b, h: c.layer(0.0),
    "host_alias": lambda c, a, b, h: c.host_alias(True),
    "free": lambda c, a, b, h: c.free(float(b)),
    "free_bool": lambda c, a, b, h: c.free(True),
    "mapped_tokens": lambda c, a, b, h: c.mapped_tokens(0.0),
    "seq_len": lambda c, a, b, h: c.seq_len(True),
    "swap_out": lambda c, a, b, h: c.swap_out(1.0),
    "capacity_lens": lambda c, a, b, h: c.capacity({a: 800.0}),
    "capacity_new": lambda c, a, b, h: c.capacity({a: 800}, new_requests=[10.5]),
}


@pytest.mark.parametrize("call", sorted(FLOAT_CALLS))
def test_floats_and_bools_are_refused_not_truncated(busy, call):
    cache, a, b, handle, written = busy
    before = page_state(cache)
    with pytest.raises(TypeError) as info:
        FLOAT_CALLS[call](cache, a, b, handle)
    assert isinstance(info.value, VAttentionError), (
        f"untyped {type(info.value).__name__}: {info.value}"
    )
    assert isinstance(info.value, ArgumentTypeError)
    message = str(info.value)
    assert any(
        word in message
        for word in (
            "slot",
            "handle",
            "num_tokens",
            "start_token",
            "lookahead_tokens",
            "seq_lens",
            "layer",
            "src_slot",
            "new_requests",
        )
    ), message
    unchanged(cache, before, written)


def test_integer_tensors_and_numpy_ints_are_accepted(busy):
    cache, a, b, handle, written = busy
    i64 = np.int64
    cache.step(
        torch.tensor([800 if s == a else 300 if s == b else 0 for s in range(4)], dtype=torch.int32)
    )
    assert cache.seq_len(a) == 800
    child = cache.fork(i64(a), i64(512))
    assert cache.seq_len(child) == 512
    assert cache.ensure_private(child, torch.tensor(0)) >= 0
    cache.prefetch({a: 900}, lookahead_tokens=np.int32(16))
    cache.wait()
    assert cache.layer_ptrs(i64(1)) == cache.layer_ptrs(1)
    assert cache.mapped_tokens(i64(a)) == cache.mapped_tokens(a)
    slot = cache.swap_in(i64(handle))
    assert cache.seq_len(slot) == 64
    cache.free(np.int16(child))
    cache.reserve(np.int64(cache.config.page_bytes))


# ---- huge ints become the documented error types ---------------------------------------------

HUGE_CALLS = {
    "free": (lambda c, a, h: c.free(HUGE), InvalidSlotError),
    "free_neg": (lambda c, a, h: c.free(-HUGE), InvalidSlotError),
    "mapped_tokens": (lambda c, a, h: c.mapped_tokens(HUGE), InvalidSlotError),
    "seq_len": (lambda c, a, h: c.seq_len(HUGE), InvalidSlotError),
    "swap_out": (lambda c, a, h: c.swap_out(HUGE), InvalidSlotError),
    "fork_src": (lambda c, a, h: c.fork(HUGE), InvalidSlotError),
    "fork_tokens": (lambda c, a, h: c.fork(a, HUGE), SequenceTooLongError),
    "share_prefix": (lambda c, a, h: c.share_prefix(a, 1, HUGE), SequenceTooLongError),
    "ensure_private": (lambda c, a, h: c.ensure_private(a, HUGE), SequenceTooLongError),
    "swap_in": (lambda c, a, h: c.swap_in(HUGE), InvalidSlotError),
    "swap_drop": (lambda c, a, h: c.swap_drop(-HUGE), InvalidSlotError),
    "step_len": (lambda c, a, h: c.step({a: HUGE}), SequenceTooLongError),
    "step_neg_len": (lambda c, a, h: c.step({a: -HUGE}), SequenceTooLongError),
    "step_slot": (lambda c, a, h: c.step({HUGE: 5}), InvalidSlotError),
    "step_list": (lambda c, a, h: c.step([HUGE, 0, 0, 0]), SequenceTooLongError),
    "prefetch_len": (lambda c, a, h: c.prefetch({a: HUGE}), SequenceTooLongError),
    "reserve": (lambda c, a, h: c.reserve(HUGE), ConfigError),
    "shrink": (lambda c, a, h: c.shrink(HUGE), ConfigError),
    "set_memory_budget": (lambda c, a, h: c.set_memory_budget(HUGE), ConfigError),
    "set_swap_budget": (lambda c, a, h: c.set_swap_budget(HUGE), ConfigError),
    "pick_victims": (lambda c, a, h: c.pick_victims(HUGE), ConfigError),
    "layer_ptrs": (lambda c, a, h: c.layer_ptrs(HUGE), ConfigError),
    "capacity_len": (lambda c, a, h: c.capacity({a: HUGE}), SequenceTooLongError),
    "capacity_new": (lambda c, a, h: c.capacity(new_requests=[HUGE]), SequenceTooLongError),
    "capacity_slot": (lambda c, a, h: c.capacity({HUGE: 5}), InvalidSlotError),
    "stream": (lambda c, a, h: c.free(a, stream=HUGE), ConfigError),
}


@pytest.mark.parametrize("call", sorted(HUGE_CALLS))
def test_huge_ints_get_typed_errors_naming_the_value(busy, call):
    cache, a, b, handle, written = busy
    fn, error = HUGE_CALLS[call]
    before = page_state(cache)
    with pytest.raises(error) as info:
        fn(cache, a, handle)
    assert str(abs(HUGE)) in str(info.value), str(info.value)
    unchanged(cache, before, written)


# ---- sizes are checked against the budget and the address space, overflow-safe ---------------


@pytest.mark.parametrize("size", [2**64 - 1, 2**63 - 1, 2**62])
def test_reserve_beyond_the_address_space_is_refused(make_cache, size):
    cache = make_cache()
    before = page_state(cache)
    with pytest.raises(ConfigError, match=rf"{size}") as info:
        cache.reserve(size)
    assert "bytes" in str(info.value)
    assert page_state(cache) == before
    assert cache.stats()["pages_total"] == 0


def test_reserve_the_whole_virtual_size_works_and_one_more_page_does_not(make_cache):
    cache = make_cache(num_layers=1, max_batch_size=1, max_seq_len=512, memory_budget=None)
    cfg = cache.config
    with pytest.raises(ConfigError, match=r"exceeds what this cache can ever hold"):
        cache.reserve(cfg.virtual_bytes + 1)
    cache.reserve(cfg.virtual_bytes)
    assert cache.stats()["pages_total"] * cfg.page_bytes == cfg.virtual_bytes


def test_a_block_cache_may_reserve_its_cached_blocks_pages_beyond_its_virtual_size(make_cache):
    # Engine blocks keep their pages while cached (block_pages.h): a vLLM budget of more blocks
    # than the rows can map at once is a pool that large.
    cache = make_cache(
        num_layers=1,
        max_batch_size=1,
        max_seq_len=512,
        memory_budget=None,
        num_blocks=64,
        block_cache=True,
    )
    cfg = cache.config
    width = cfg.pages_per_index  # pages a block names
    limit = cfg.virtual_bytes + 64 * width * cfg.page_bytes
    with pytest.raises(ConfigError, match=rf"plus {64 * width} pages its engine blocks may keep"):
        cache.reserve(limit + 1)
    assert cache.stats()["pages_total"] == 0
    cache.reserve(limit)
    assert cache.stats()["pages_total"] * cfg.page_bytes == limit


# ---- streams -----------------------------------------------------------------------------------


class FakeStream:
    cuda_stream = 0


@pytest.mark.parametrize("stream", ["x", 1.5, True, [0], object()])
@pytest.mark.parametrize(
    "call", ["free", "step", "fork", "swap_out", "ensure_private", "swap_in", "share_prefix"]
)
def test_bad_stream_is_a_typed_error_naming_stream(call, stream):
    cache = _host_cache()
    a, b = cache.alloc(), cache.alloc()
    cache.step({a: 100})
    handle = cache.swap_out(cache.fork(a))
    calls = {
        "free": lambda: cache.free(a, stream=stream),
        "step": lambda: cache.step({a: 200}, stream=stream),
        "fork": lambda: cache.fork(a, stream=stream),
        "swap_out": lambda: cache.swap_out(a, stream=stream),
        "ensure_private": lambda: cache.ensure_private(a, 0, stream=stream),
        "swap_in": lambda: cache.swap_in(handle, stream=stream),
        "share_prefix": lambda: cache.share_prefix(a, b, 10, stream=stream),
    }
    before = page_state(cache)
    with pytest.raises(ArgumentTypeError, match=r"stream=.*must be None, an int stream handle"):
        calls[call]()
    assert page_state(cache) == before
    cache.close()


def test_stream_objects_and_handles_are_accepted():
    with _host_cache() as cache:
        a = cache.alloc()
        cache.step({a: 100}, stream=FakeStream())
        cache.step({a: 200}, stream=np.int64(0))
        cache.free(a, stream=FakeStream())


# ---- after close() -------------------------------------------------------------------------------

CLOSED_CALLS = {
    "alloc": lambda c: c.alloc(),
    "free": lambda c: c.free(0),
    "step": lambda c: c.step({0: 1}),
    "prefetch": lambda c: c.prefetch({0: 1}),
    "wait": lambda c: c.wait(),
    "reserve": lambda c: c.reserve(1),
    "reclaim": lambda c: c.reclaim(),
    "shrink": lambda c: c.shrink(),
    "set_memory_budget": lambda c: c.set_memory_budget(None),
    "set_headroom": lambda c: c.set_headroom(0),
    "release_blocks": lambda c: c.release_blocks([0]),
    "mapped_tokens": lambda c: c.mapped_tokens(0),
    "seq_len": lambda c: c.seq_len(0),
    "window_start": lambda c: c.window_start(0, 0),
    "active_slots": lambda c: c.active_slots(),
    "stats": lambda c: c.stats(),
    "layer": lambda c: c.layer(0),
    "k_cache": lambda c: c.k_cache,
    "v_cache": lambda c: c.v_cache,
    "mega_tensors": lambda c: c.mega_tensors(),
    "layer_ptrs": lambda c: c.layer_ptrs(0),
    "host_alias": lambda c: c.host_alias(0),
    "fork": lambda c: c.fork(0),
    "share_prefix": lambda c: c.share_prefix(0, 1, 1),
    "ensure_private": lambda c: c.ensure_private(0, 0),
    "swap_out": lambda c: c.swap_out(0),
    "swap_in": lambda c: c.swap_in(1),
    "swap_drop": lambda c: c.swap_drop(1),
    "set_swap_budget": lambda c: c.set_swap_budget(None),
    "pick_victims": lambda c: c.pick_victims(0),
    "capacity": lambda c: c.capacity(),
    "block_table": lambda c: c.block_table(0),
}


def _public_methods():
    return sorted(
        name
        for name in dir(vattention.KVCache)
        if not name.startswith("_") and name not in ("close", "closed", "config")
    )


def test_every_public_method_is_covered_after_close():
    assert _public_methods() == sorted(CLOSED_CALLS)


@pytest.mark.parametrize("call", sorted(CLOSED_CALLS))
def test_every_method_raises_cache_closed_after_close(make_cache, call):
    cache = make_cache()
    slot = cache.alloc()
    cache.step({slot: 10})
    cache.close()
    with pytest.raises(CacheClosedError, match="closed"):
        CLOSED_CALLS[call](cache)


def _memfds():
    fd_dir = "/proc/self/fd"
    found = []
    for fd in os.listdir(fd_dir):
        try:
            if "vattention-kv" in os.readlink(os.path.join(fd_dir, fd)):
                found.append(fd)
        except OSError:
            pass
    return len(found)


def test_close_releases_descriptors_while_the_cache_and_a_view_are_still_referenced():
    before = _memfds()
    cache = _host_cache()
    slot = cache.alloc()
    cache.step({slot: 100})
    k, _ = cache.layer(0)
    assert _memfds() == before + 1
    cache.close()
    assert _memfds() == before  # at once, not when `cache` and `k` are collected
    assert cache.stats  # still referenced
    del k


# ---- a budget below one page ---------------------------------------------------------------------


@pytest.mark.parametrize("budget", [0, 1, "32KB", 65535])
def test_budget_below_one_page_is_refused_naming_the_page_size(budget):
    cfg = vattention.KVCacheConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=64,
        max_batch_size=1,
        max_seq_len=64,
        dtype=torch.float16,
        page_size="64KB",
    )
    with pytest.raises(
        ConfigError, match=r"smaller than one page \(page_size='64KB', 65536 bytes\)"
    ):
        vattention.KVCache(cfg, memory_budget=budget)
    with vattention.KVCache(cfg, memory_budget="128KB") as cache:  # K and V: one page each
        cache.step({cache.alloc(): 1})
