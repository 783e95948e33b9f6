"""vattention.integrations.flash_attn4: FlashAttention-4's varlen call over a cache, on the CPU,
against a torch stand-in with FA4's signature and whole-tile reads (support/fa4_stand_in.py).

What runs on a GPU is tests/gpu/test_gpu_fa4.py's (not run yet: no GPU with FA4 so far).
"""

from __future__ import annotations

import pytest
import torch

import vattention
from vattention.integrations import flash_attn4 as fa4
from vattention.integrations.flash_attn4 import attend_slots, flash_attn_varlen_func

from support.fa4_stand_in import FA4StandIn

I32 = torch.int32


def make_cache(layout="layer", tile=128, **kw):
    args = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        max_batch_size=4,
        max_seq_len=1024,
        dtype=torch.bfloat16,
        page_size="4KB",
        layout=layout,
        kv_tile_tokens=tile,
    )
    args.update(kw)
    return vattention.KVCache(vattention.KVCacheConfig(**args))


def fill(cache, lens, layer=1, seed=0):
    """Steps slots 0..n-1 to lens and writes random K/V there; returns layer's (k, v)."""
    slots = [cache.alloc() for _ in lens]
    assert slots == list(range(len(lens)))
    cache.step(dict(zip(slots, lens)))
    k, v = cache.layer(layer)
    gen = torch.Generator().manual_seed(seed)
    for s, n in zip(slots, lens):
        shape = (n,) + tuple(k.shape[2:])
        k[s, :n] = torch.randn(shape, generator=gen).to(k.dtype)
        v[s, :n] = torch.randn(shape, generator=gen).to(v.dtype)
    return k, v


def sdpa_fp32(q, k, v, lens, q_lens, causal=True):
    """fp32 SDPA per request over [total_q, H, D] queries (varlen) and rows' first lens[i] keys."""
    outs, start = [], 0
    group = q.shape[1] // k.shape[2]
    for i, (n, lq) in enumerate(zip(lens, q_lens)):
        qi = q[start : start + lq].float().transpose(0, 1)
        start += lq
        ki = k[i, :n].float().repeat_interleave(group, 1).transpose(0, 1)
        vi = v[i, :n].float().repeat_interleave(group, 1).transpose(0, 1)
        mask = torch.arange(n)[None, :] <= (torch.arange(lq)[:, None] + n - lq)
        out = torch.nn.functional.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask if causal else None
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def varlen(q_lens):
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=I32)


# ---- FA4's key tile ---------------------------------------------------------------------------


def test_fa4_key_tiles_are_fa4_4_0_0b36s():
    assert [fa4.fa4_key_tile(d) for d in (64, 96, 128, 192, 256)] == [128, 144, 128, 112, 80]
    assert fa4.fa4_key_tile(192, 128) == 128  # DeepSeek's (192, 128)
    assert fa4.fa4_key_tile(96, causal=True) == 128
    assert fa4.fa4_key_tile(192, window_size=(100, 0)) == 96
    assert fa4.fa4_key_tile(256, window_size=(100, None)) == 64
    assert fa4.fa4_key_tile(128, arch=100) == 128 and fa4.fa4_key_tile(128, arch=80) == 64
    assert fa4.fa4_key_tile(128, arch=120) == 64 and fa4.fa4_key_tile(64, arch=120) == 128


# ---- outputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["layer", "mega"])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [5, 1, 40]], ids=["decode", "mixed"])
def test_the_stand_in_over_the_cache_matches_fp32_sdpa(layout, gqa, q_lens):
    lens = [300, 45, 40]  # the last: a prefill of its whole row
    with make_cache(layout) as cache:
        k, v = fill(cache, lens + [0])
        k, v = k[:3], v[:3]
        q = torch.randn(sum(q_lens), 2 * gqa, 64).to(torch.bfloat16)
        stand_in = FA4StandIn()
        out, lse = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=varlen(q_lens),
            seqused_k=torch.tensor(lens, dtype=I32),
            causal=True,
            kernel=stand_in.flash_attn_varlen_func,
        )
        assert lse is None and out.dtype == torch.bfloat16
        want = sdpa_fp32(q, k, v, lens, q_lens)
        torch.testing.assert_close(out.float(), want, atol=1.6e-2, rtol=1.6e-2)
        assert stand_in.calls[-1]["copied"] is False  # FA4 would read the cache in place


def test_without_a_kernel_cpu_tensors_run_vattentions_own_with_fa4s_semantics():
    lens, q_lens = [300, 45, 40], [5, 1, 40]
    with make_cache() as cache:
        k, v = fill(cache, lens)
        k, v = k[:3], v[:3]
        q = torch.randn(sum(q_lens), 8, 64).to(torch.bfloat16)
        args = dict(cu_seqlens_q=varlen(q_lens), seqused_k=torch.tensor(lens, dtype=I32))
        own, _ = flash_attn_varlen_func(q, k, v, causal=True, **args)
        stand, _ = flash_attn_varlen_func(
            q, k, v, causal=True, kernel=FA4StandIn().flash_attn_varlen_func, **args
        )
        torch.testing.assert_close(own.float(), stand.float(), atol=1.6e-2, rtol=1.6e-2)
        with pytest.raises(ValueError, match="return_lse=True needs FlashAttention-4"):
            flash_attn_varlen_func(q, k, v, causal=True, return_lse=True, **args)


def test_attend_slots_takes_requests_in_any_order_of_rows():
    lens = [300, 45, 40]
    with make_cache() as cache:
        k, v = fill(cache, lens)
        slots, q_lens = [2, 0, 1], [3, 1, 2]  # request i reads row slots[i]
        seq_lens = [lens[s] for s in slots]
        q = torch.randn(sum(q_lens), 4, 64).to(torch.bfloat16)
        stand_in = FA4StandIn()
        out = attend_slots(
            q,
            k,
            v,
            seq_lens=seq_lens,
            q_lens=q_lens,
            slots=slots,
            kernel=stand_in.flash_attn_varlen_func,
        )
        starts = [0, 3, 4]
        for i, s in enumerate(slots):
            mine = q[starts[i] : starts[i] + q_lens[i]]
            want = sdpa_fp32(mine, k[s : s + 1], v[s : s + 1], [lens[s]], [q_lens[i]])
            got = out[starts[i] : starts[i] + q_lens[i]].float()
            torch.testing.assert_close(got, want, atol=1.6e-2, rtol=1.6e-2)
        # every row of the cache is in the call (FA4 has no batch index): row 3 has nothing
        assert stand_in.calls[-1]["max_seqlen_q"] == 3


def test_a_window_reads_from_the_tile_of_its_first_key():
    with make_cache("mega", sliding_window=64, max_seq_len=2048) as cache:
        slot = cache.alloc()
        cache.step({slot: 100})
        for n in range(101, 600):
            cache.step({slot: n})
        k, v = cache.layer(1)
        k[slot, cache.window_start(slot, 1) : 599] = 1.0
        v[slot, cache.window_start(slot, 1) : 599] = 2.0
        assert cache.window_start(slot, 1) == 512  # first key 536: the tile from 512 stays
        q = torch.randn(1, 2, 64).to(torch.bfloat16)
        out = attend_slots(
            q,
            k[slot : slot + 1],
            v[slot : slot + 1],
            seq_lens=[599],
            window_size=(63, 0),
            kernel=FA4StandIn().flash_attn_varlen_func,
        )
        assert bool(out.float().eq(2.0).all())
        with pytest.raises(vattention.UnmappedReadError, match="sliding window released"):
            attend_slots(
                q, k[slot : slot + 1], v[slot : slot + 1], seq_lens=[599], window_size=(200, 0)
            )


# ---- what the cache's tail rule prevents, and the integration's refusals ----------------------


def _nan_tail_row(tile):
    """A row whose page held NaN before it came to the row (recycled through the pool). 64 KB
    pages (128 tokens a page index): without the rule the tile is mapped, its tail stale."""
    cache = make_cache("mega", tile=tile, page_size="64KB")
    first = cache.alloc()
    cache.step({first: 512})
    for layer in range(2):
        for t in cache.layer(layer):
            t[first, :512] = float("nan")
    cache.free(first)
    cache.reclaim()
    slot = cache.alloc()
    cache.step({slot: 70})
    k, v = cache.layer(1)
    k[slot, :70] = 0.5
    v[slot, :70] = 1.0
    return cache, slot, k, v


def test_the_rule_keeps_a_stale_nan_out_of_fa4s_whole_tiles():
    q = torch.randn(1, 1, 2, 64).to(torch.bfloat16)
    for tile, finite in ((128, True), (0, False)):
        cache, slot, k, v = _nan_tail_row(tile)
        with cache:
            stand_in = FA4StandIn()  # FA4 itself, called without the integration's checks
            out, _ = stand_in.flash_attn_varlen_func(
                q,
                k[slot : slot + 1],
                v[slot : slot + 1],
                seqused_k=torch.tensor([70], dtype=I32),
                causal=True,
            )
            assert bool(out.isfinite().all()) is finite
            if finite:
                assert bool(out.float().eq(1.0).all())


@pytest.mark.parametrize("tile", [0, 64])
def test_a_cache_whose_tile_does_not_cover_fa4s_is_refused(tile):
    with make_cache(tile=tile) as cache:
        k, v = fill(cache, [10])
        q = torch.randn(1, 2, 64).to(torch.bfloat16)
        with pytest.raises(
            vattention.ConfigError, match=f"kv_tile_tokens={tile}; FA4 .* loads 128-key tiles"
        ):
            attend_slots(q, k, v, seq_lens=[10])


def test_reads_past_the_mapped_rows_are_refused():
    with make_cache() as cache:
        k, v = fill(cache, [10])
        q = torch.randn(1, 2, 64).to(torch.bfloat16)
        with pytest.raises(vattention.UnmappedReadError, match="reads 256 tokens of cache row 0"):
            attend_slots(q, k, v, seq_lens=[130])


def test_reads_past_the_finite_tail_are_refused():
    # A new request in an idle row inherits its pages: mapped, but nothing of them is its own
    # until its step (the old request's tokens may be anything).
    with make_cache() as cache:
        k, v = fill(cache, [300])
        cache.free(0)
        assert cache.alloc() == 0 and cache.mapped_tokens(0) == 384
        q = torch.randn(1, 2, 64).to(torch.bfloat16)
        with pytest.raises(vattention.UnmappedReadError, match=r"only tokens \[0, 0\) are known"):
            attend_slots(q, k, v, seq_lens=[200])
        cache.step({0: 200})  # the length the kernel is given: now its tail is finite
        attend_slots(q, k, v, seq_lens=[200], kernel=FA4StandIn().flash_attn_varlen_func)


# ---- argument checks ------------------------------------------------------------------------


@pytest.fixture
def args():
    k = torch.zeros(2, 256, 2, 64, dtype=torch.bfloat16)
    return dict(
        q=torch.zeros(3, 4, 64, dtype=torch.bfloat16),
        k=k,
        v=torch.zeros_like(k),
        cu_seqlens_q=torch.tensor([0, 1, 3], dtype=I32),
        seqused_k=torch.tensor([5, 9], dtype=I32),
    )


def _refused(args, error, match, **change):
    kw = dict(args, **change)
    with pytest.raises(error, match=match):
        flash_attn_varlen_func(**kw, kernel=FA4StandIn().flash_attn_varlen_func)


def test_dtypes_outside_fp16_bf16_or_mixed_are_type_errors(args):
    _refused(args, TypeError, "q has dtype torch.float32", q=args["q"].float())
    _refused(args, TypeError, "must share one dtype", v=args["v"].half())
    _refused(args, TypeError, "k must be a torch.Tensor, not list", k=[1])
    _refused(args, TypeError, "seqused_k has dtype torch.int64", seqused_k=torch.tensor([5, 9]))
    _refused(
        args, TypeError, "cu_seqlens_q has dtype torch.int64", cu_seqlens_q=torch.tensor([0, 1, 3])
    )


def test_shapes_are_value_errors_naming_the_argument(args):
    _refused(args, ValueError, "k and v must be", k=args["k"][0])
    _refused(args, ValueError, r"q has shape \(3, 64\); expected \[total_q", q=args["q"][:, 0])
    _refused(args, ValueError, "not a multiple of k's 2 KV heads", q=args["q"][:, :3])
    _refused(args, ValueError, "q's head_dim is 32", q=args["q"][..., :32])
    _refused(args, ValueError, r"seqused_k has shape \(3,\)", seqused_k=torch.zeros(3, dtype=I32))
    _refused(args, ValueError, "seqused_k is required", seqused_k=None)
    _refused(args, ValueError, r"cu_seqlens_q=\[0, 2, 1\] must", cu_seqlens_q=torch.tensor(
        [0, 2, 1], dtype=I32))  # fmt: skip
    big = torch.tensor([5, 257], dtype=I32)
    _refused(args, ValueError, r"seqused_k\[1\]=257 is outside \[0, 256\]", seqused_k=big)


def test_layouts_fa4_would_copy_are_refused(args):
    flat = torch.zeros(2 * 256 * 2 * 64 + 1, dtype=torch.bfloat16)
    shifted = flat[1:].view(2, 256, 2, 64)  # 2 bytes off a 16-byte boundary
    _refused(args, ValueError, "not 16-byte aligned: FA4 would copy", k=shifted)
    _refused(args, ValueError, "last-dimension stride of 2", v=torch.zeros(
        2, 256, 2, 128, dtype=torch.bfloat16)[..., ::2])  # fmt: skip
    wide = torch.zeros(2, 256, 2, 68, dtype=torch.bfloat16)[..., :64]
    _refused(args, ValueError, r"k.stride\(2\)=68 elements is not a multiple of 8", k=wide)


def test_tensors_on_two_devices_are_refused(args):
    _refused(args, ValueError, "k is on meta, q on cpu: one device", k=args["k"].to("meta"))


def test_attend_slots_checks_its_counts_and_slots():
    k = torch.zeros(2, 256, 1, 64, dtype=torch.bfloat16)
    q = torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="seq_lens has 2 entries, slots 1"):
        attend_slots(q, k, k, seq_lens=[1, 2], slots=[0])
    with pytest.raises(ValueError, match=r"slots\[1\]=5 is outside the cache's rows \[0, 2\)"):
        attend_slots(q, k, k, seq_lens=[1, 2], slots=[0, 5])
    with pytest.raises(ValueError, match="lists a row twice"):
        attend_slots(q, k, k, seq_lens=[1, 2], slots=[1, 1])
    with pytest.raises(ValueError, match=r"expected \[sum\(q_lens\)=3, heads"):
        attend_slots(q, k, k, seq_lens=[1, 2], q_lens=[1, 2])
