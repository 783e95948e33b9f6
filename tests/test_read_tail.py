"""The tile rule (kv_tile_tokens): what a kernel that loads whole key tiles reads past a row's
length is mapped and finite (csrc/core/read_tail.h).

A row of ``len`` tokens maps ``read_end(len)`` = ``len`` rounded up to the tile, and tokens
``[len, read_end)`` hold finite values (the row's own, or zeros ``step()`` wrote) whenever a
kernel may read them, without zeroing whole pages. Every case that matters is checked with the
rule on and off: off, a tile reaches an unmapped page (a SIGSEGV on the host backend, checked in
a child process) or a NaN the page held before it came to the row.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import vattention

from support.helpers import kv_views

ROOT = Path(__file__).resolve().parent.parent
TILE = 128


def config(device="cpu", layout="layer", tile=TILE, **kw):
    """A small cache: on the host 4 KB pages (16 tokens a page index in the mega layout, 32 in
    the layer layout); on the CUDA backend 2 MB pages."""
    args = dict(
        num_layers=2,
        num_kv_heads=1,
        head_dim=64,
        max_batch_size=4,
        max_seq_len=2048,
        dtype=torch.float16,
        device=device,
        page_size="4KB" if device == "cpu" else "2MB",
        layout=layout,
        kv_tile_tokens=tile,
    )
    args.update(kw)
    return vattention.KVCacheConfig(**args)


# ---- configuration --------------------------------------------------------------------------


def test_the_default_is_128_on_cuda_caches_and_0_on_the_cpu_and_with_engine_blocks():
    cpu = vattention.KVCacheConfig(
        num_layers=1, num_kv_heads=1, head_dim=64, max_batch_size=1, max_seq_len=64,
        dtype=torch.float16,
    )  # fmt: skip
    assert cpu.kv_tile_tokens == 0
    cuda = vattention.KVCacheConfig(
        num_layers=1, num_kv_heads=1, head_dim=64, max_batch_size=1, max_seq_len=64,
        dtype=torch.float16, device="cuda",
    )  # fmt: skip
    assert cuda.kv_tile_tokens == 128 and cuda.geometry.tile_tokens == 128
    blocks = vattention.KVCacheConfig(
        num_layers=1, num_kv_heads=1, head_dim=64, max_batch_size=1, max_seq_len=64,
        dtype=torch.float16, device="cuda", num_blocks=8,
    )  # fmt: skip
    assert blocks.kv_tile_tokens == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "128"])
def test_a_tile_that_is_not_an_int_or_is_negative_is_refused(bad):
    with pytest.raises(vattention.ConfigError, match=f"kv_tile_tokens={bad!r} must be an int"):
        config(tile=bad)


def test_a_tile_beyond_2_to_the_30_is_refused_by_the_core():
    with pytest.raises(vattention.ConfigError, match=r"kv_tile_tokens=1073741825 must be in"):
        config(tile=2**30 + 1)


def test_a_tile_with_engine_blocks_is_refused():
    with pytest.raises(vattention.ConfigError, match="kv_tile_tokens=64 needs a cache whose slots"):
        config(tile=64, num_blocks=16)


@pytest.mark.parametrize(
    "length, end", [(0, 0), (1, 128), (127, 128), (128, 128), (129, 256), (2000, 2048)]
)
def test_read_end_rounds_up_to_the_tile_and_stops_at_max_seq_len(length, end):
    geo = config().geometry
    assert geo.read_end(length) == end
    assert config(tile=0).geometry.read_end(length) == length
    assert config(tile=4096).geometry.read_end(length) == min(length, 1) * 2048


# ---- mapping ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, tpp", [("layer", 32), ("mega", 16)])
def test_a_row_maps_its_length_rounded_up_to_the_tile(layout, tpp):
    for tile, mapped in ((TILE, 128), (0, tpp)):
        with vattention.KVCache(config(layout=layout, tile=tile)) as cache:
            assert cache.config.tokens_per_page == tpp
            slot = cache.alloc()
            cache.step({slot: tpp - 1})  # ends just before a page boundary
            assert cache.mapped_tokens(slot) == mapped
            end = 256 if tile else 130  # read_end(130)
            indices = -(-end // tpp) - mapped // tpp
            assert (
                cache.capacity({slot: 130}).pages_needed == indices * cache.config.pages_per_index
            )
            assert cache._core.check_invariants() == ""


def test_capacity_counts_a_new_requests_rounded_pages():
    with vattention.KVCache(config(layout="mega")) as cache:
        need = cache.capacity(new_requests=[1]).pages_needed
        assert need == 128 // 16 * cache.config.pages_per_index
    with vattention.KVCache(config(layout="mega", tile=0)) as cache:
        assert cache.capacity(new_requests=[1]).pages_needed == cache.config.pages_per_index


def test_the_prefetch_thread_maps_the_rounded_length():
    with vattention.KVCache(config(layout="mega")) as cache:
        slot = cache.alloc()
        cache.step({slot: 1})
        cache.prefetch({slot: 130})
        cache.wait()
        assert cache.mapped_tokens(slot) == 256
        stats = cache.stats()
        assert stats["prefetch_map_calls"] > 0
        # The thread zeroed the pages it mapped (the row was finite up to its mapped end), so
        # the step that reaches them has nothing to do: no map, no zero.
        assert stats["tail_zero_calls"] == 2 * cache.config.num_tensors
        assert stats["tail_zeroed_bytes"] == (256 - 1) * cache.config.bytes_per_token
        cache.step({slot: 130})
        after = cache.stats()
        for key in ("tail_zero_calls", "map_calls", "step_driver_calls"):
            assert after[key] == stats[key], key
        assert cache._core.check_invariants() == ""


def test_trimming_look_ahead_keeps_the_rounded_length():
    with vattention.KVCache(config(layout="mega"), memory_budget="4MB") as cache:
        slot = cache.alloc()
        cache.step({slot: 1})
        cache.prefetch({slot: 600})
        cache.wait()
        assert cache.mapped_tokens(slot) == 640
        # As low as it goes: every look-ahead page is trimmed, the tile of token 0 stays
        # (8 page indices of K and V: 16 pages of 4 KB), so that much stays over the budget.
        assert cache.set_memory_budget(0) == 16 * 4096
        assert cache.mapped_tokens(slot) == 128  # not 16
        assert cache._core.check_invariants() == ""


# ---- an unmapped tile faults without the rule (host backend: a child process) -----------------

MEGA_BOUNDARY = """
import torch, vattention
from support.fa4_stand_in import FA4StandIn
from vattention.integrations import flash_attn4
cfg = vattention.KVCacheConfig(num_layers=2, num_kv_heads=1, head_dim=64, max_batch_size=2,
                               max_seq_len=2048, dtype=torch.float16, page_size="4KB",
                               layout="mega", kv_tile_tokens={tile})
cache = vattention.KVCache(cfg)
slot = cache.alloc()
cache.step({{slot: 15}})        # 16 tokens a page: the row ends just before a page boundary
k, v = cache.layer(1)
k[slot, :15].normal_(); v[slot, :15].normal_()
q = torch.randn(1, 2, 64, dtype=torch.float16)
fa4 = FA4StandIn(arch=90)       # loads 128-key tiles whole, as FA4 on Hopper at head_dim 64
out, _ = flash_attn4.flash_attn_varlen_func(
    q, k[:1], v[:1], cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
    seqused_k=torch.tensor([15], dtype=torch.int32), causal=True,
    kernel=fa4.flash_attn_varlen_func, check_reads=False)
print("finite" if bool(out.isfinite().all()) else "nan")
"""


def _child(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    env.pop("PYTHONFAULTHANDLER", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.parametrize("tile", [TILE, 0])
def test_a_mega_row_ending_before_a_page_boundary_maps_the_tile_a_kernel_loads(tile):
    proc = _child(MEGA_BOUNDARY.format(tile=tile))
    if tile:
        assert proc.returncode == 0 and proc.stdout.strip() == "finite", proc.stderr[-2000:]
    else:  # the tile reaches the unmapped next page: the process dies there
        assert proc.returncode != 0 and "finite" not in proc.stdout
        assert "vattention: fatal memory access to KV cache #" in proc.stderr, proc.stderr[-2000:]
        assert "slot 0, token 16." in proc.stderr, proc.stderr[-2000:]


# ---- the tail is finite: a NaN the page held is zero after step() ----------------------------


def _plant_nan_in_recycled_pages(cache, layout):
    """A first request fills its pages with NaN (K and V of every layer) and ends; its pages go
    back to the pool (reclaim): the next request gets them, NaN and all."""
    first = cache.alloc()
    tokens = min(4 * cache.config.tokens_per_page, cache.config.max_seq_len)
    cache.step({first: tokens})
    for layer in range(cache.config.num_layers):
        k, v = kv_views(cache, layer)
        k[first, :tokens] = float("nan")
        v[first, :tokens] = float("nan")
    cache.free(first)
    assert cache.reclaim() > 0


@pytest.mark.parametrize("device", ["cpu", "cuda"], indirect=True)
@pytest.mark.parametrize("layout", ["layer", "mega"])
@pytest.mark.parametrize("tile", [TILE, 0])
def test_nan_planted_in_a_reused_page_past_the_length_is_zero_after_step(device, layout, tile):
    cfg = config(device, layout, tile, max_seq_len=4096)
    with vattention.KVCache(cfg) as cache:
        _plant_nan_in_recycled_pages(cache, layout)
        slot = cache.alloc()
        length = 40  # mid-tile, mid-page on the host; a few tokens of a 2 MB page on CUDA
        zeroed = cache.stats()["tail_zeroed_bytes"]
        cache.step({slot: length})
        zeroed = cache.stats()["tail_zeroed_bytes"] - zeroed
        for layer in range(cfg.num_layers):
            k, v = kv_views(cache, layer)
            k[slot, :length] = 1.0  # the request writes its own tokens
            v[slot, :length] = 1.0
        k, v = kv_views(cache, 1)
        end = min(TILE, cache.mapped_tokens(slot))  # without the rule: the rest of the page
        tail = v[slot, length:end].cpu()
        if tile:
            assert bool(tail.eq(0).all())
            assert bool(k[slot, length:TILE].cpu().eq(0).all())
            # every tensor's tokens [length, what the row maps): bytes_per_token covers them all
            assert zeroed == (cache.mapped_tokens(slot) - length) * cfg.bytes_per_token
        else:
            assert bool(tail.isnan().all())
        assert cache._core.check_invariants() == ""


@pytest.mark.parametrize("device", ["cpu", "cuda"], indirect=True)
def test_a_slot_reused_by_a_new_request_gets_its_tail_zeroed_again(device):
    # Deferred reclamation: the next request inherits the idle row's pages, and what the old
    # request wrote past the new one's length (here NaN) is not the new request's.
    with vattention.KVCache(config(device, "mega", max_seq_len=4096)) as cache:
        slot = cache.alloc()
        cache.step({slot: 300})
        k, v = kv_views(cache, 0)
        v[slot, :300] = float("nan")
        cache.free(slot)
        again = cache.alloc()
        assert again == slot
        mapped = cache.mapped_tokens(again)
        assert mapped >= 384  # inherited: 300 tokens' read end (the whole row at 2 MB)
        cache.step({again: 100})
        # Past its length the row's inherited pages are zeroed, in one call a tensor; the new
        # request's own tokens it writes itself.
        assert bool(v[slot, 100:mapped].cpu().eq(0).all())
        assert bool(v[slot, :100].cpu().isnan().all())
        assert cache._core.check_invariants() == ""


def test_decode_zeroes_one_tile_per_tile_of_tokens_and_never_what_the_row_wrote():
    with vattention.KVCache(config(layout="mega", max_seq_len=4096)) as cache:
        slot = cache.alloc()
        cache.step({slot: 100})  # prefill: zeroes [100, 128)
        k, v = cache.layer(0)
        v[slot, :100] = 7.0
        per_call = cache.stats()["tail_zero_calls"]
        assert per_call == cache.config.num_tensors
        for length in range(101, 300):
            cache.step({slot: length})
            v[slot, length - 1] = 7.0  # the decode writes its token
        stats = cache.stats()
        assert stats["tail_zero_calls"] == 3 * per_call  # at 129 and at 257: one tile each
        token = cache.config.geometry.token_bytes(0)
        assert stats["tail_zeroed_bytes"] == (28 + 127 + 127) * token * cache.config.num_tensors
        assert bool(v[slot, :299].eq(7.0).all()) and bool(v[slot, 299:384].eq(0).all())


def test_a_step_within_the_finite_tail_does_nothing_new():
    with vattention.KVCache(config(layout="mega")) as cache:
        slot = cache.alloc()
        cache.step({slot: 100})
        before = cache.stats()
        for length in (101, 127, 128, 120):
            cache.step({slot: length})
        after = cache.stats()
        for key in ("tail_zero_calls", "map_calls", "step_driver_calls"):
            assert after[key] == before[key], key


# ---- fork, swap, rollback ---------------------------------------------------------------------


def test_fork_maps_the_read_end_and_zeroes_the_tail_of_its_own_pages():
    with vattention.KVCache(config(layout="mega", max_seq_len=4096)) as cache:
        src = cache.alloc()
        cache.step({src: 300})
        k, v = cache.layer(0)
        v[src, :300] = 3.0  # past 100 too: the fork must not carry it into its tail
        dst = cache.fork(src, 100)
        assert cache.mapped_tokens(dst) == 128
        assert bool(v[dst, :100].eq(3.0).all()) and bool(v[dst, 100:128].eq(0).all())
        assert bool(v[src, :300].eq(3.0).all())  # the shared pages were not touched
        assert cache._core.check_invariants() == ""


@pytest.mark.parametrize("tile", [16, 0])
def test_a_fork_zeroes_its_own_tail_once_and_nothing_without_a_tile(tile):
    # 32 tokens a page: a fork of 40 tokens reads to 48 (tile 16) and maps 64 (two pages).
    with vattention.KVCache(config(layout="layer", tile=tile, max_seq_len=4096)) as cache:
        src = cache.alloc()
        cache.step({src: 300})
        k, v = cache.layer(0)
        v[src, :300] = 3.0
        before = cache.stats()["tail_zero_calls"]
        dst = cache.fork(src, 40)
        assert cache.mapped_tokens(dst) == 64
        calls = cache.stats()["tail_zero_calls"]
        if tile:  # the whole copied page past the prefix, not just the tile: one call a tensor
            assert calls - before == cache.config.num_tensors
            assert bool(v[dst, 40:64].eq(0).all())
        else:  # no kernel reads past the length: nothing zeroes
            assert calls == 0
        cache.step({dst: 50})  # within what the fork made finite
        assert cache.stats()["tail_zero_calls"] == calls
        assert cache._core.check_invariants() == ""


def test_swap_keeps_the_zeroed_tail():
    with vattention.KVCache(config(layout="mega", max_seq_len=4096)) as cache:
        slot = cache.alloc()
        cache.step({slot: 100})
        k, v = cache.layer(0)
        v[slot, :100] = 5.0
        handle = cache.swap_out(slot)
        back = cache.swap_in(handle)
        v = cache.layer(0)[1]
        assert bool(v[back, :100].eq(5.0).all()) and bool(v[back, 100:128].eq(0).all())
        before = cache.stats()["tail_zero_calls"]
        cache.step({back: 101})
        assert cache.stats()["tail_zero_calls"] == before  # known finite: nothing to redo
        assert cache._core.check_invariants() == ""


def test_a_failed_step_leaves_the_tail_state_as_it_was():
    with vattention.KVCache(config(layout="mega"), memory_budget="64KB") as cache:
        slot = cache.alloc()
        cache.step({slot: 10})
        before = cache.stats()
        with pytest.raises(vattention.OutOfPagesError):
            cache.step({slot: 500})
        assert cache.mapped_tokens(slot) == 128 and cache.seq_len(slot) == 10
        cache.step({slot: 20})  # within what was zeroed: no new work
        assert cache.stats()["tail_zero_calls"] == before["tail_zero_calls"]
        assert cache._core.check_invariants() == ""


def test_a_driver_failure_while_zeroing_unmaps_the_steps_pages_again():
    with vattention.KVCache(config(layout="mega")) as cache:
        slot = cache.alloc()
        cache.step({slot: 10})
        before = cache.mapped_tokens(slot), cache.stats()["pages_mapped"]
        cache._core.inject_host_fault("zero", 1)
        with pytest.raises(vattention.DriverError):
            cache.step({slot: 200})
        assert (cache.mapped_tokens(slot), cache.stats()["pages_mapped"]) == before
        assert cache.seq_len(slot) == 10
        cache.step({slot: 200})
        assert cache.mapped_tokens(slot) == 256
        assert cache._core.check_invariants() == ""


# ---- sliding windows ------------------------------------------------------------------------


def test_a_window_keeps_the_tile_below_its_first_key_mapped():
    # 16 tokens a page index, a window of 40: at length 420 the decode query reads keys from
    # 380. Without the rule the pages below 368 go; a tile loader starts at 256, which stays.
    for tile, start in ((TILE, 256), (0, 368)):
        cfg = config(layout="mega", tile=tile, sliding_window=40, max_seq_len=4096)
        with vattention.KVCache(cfg) as cache:
            slot = cache.alloc()
            cache.step({slot: 300})
            for length in range(301, 421):
                cache.step({slot: length})
            assert cache.window_start(slot, 0) == start
            assert cache._core.check_invariants() == ""
