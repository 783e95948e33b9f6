"""FlashAttention's signature over vattention caches: the SDPA reference's semantics, the CPU route
to vattention.attention's kernel, and decode/prefill on a vattention cache.

The real flash-attn path runs only on a GPU (``@pytest.mark.gpu``) and is compared with the
reference there.
"""

from __future__ import annotations

import math

import pytest
import torch

import vattention
from vattention import attention
from vattention.integrations import flash_attn as fa

from support.attention_bound import check_within_bound, reference_and_bound


def naive_attention(q, keys, values, causal_offset=None):
    """q [n, H, D], keys/values [t, Hkv, D]; query j sees keys <= j + causal_offset."""
    groups = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(groups, 1)
    v = values.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if causal_offset is not None:
        rows = torch.arange(q.shape[0])[:, None] + causal_offset
        allowed = torch.arange(k.shape[0])[None, :] <= rows
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_reference_decode_appends_in_place_and_matches_naive_gqa():
    torch.manual_seed(0)
    k_cache = torch.randn(5, 16, 2, 8, dtype=torch.float64)
    v_cache = torch.randn(5, 16, 2, 8, dtype=torch.float64)
    before_k = k_cache.clone()
    seqlens, slots = torch.tensor([3, 0, 9]), torch.tensor([4, 1, 2])
    q = torch.randn(3, 1, 6, 8, dtype=torch.float64)
    k = torch.randn(3, 1, 2, 8, dtype=torch.float64)
    v = torch.randn(3, 1, 2, 8, dtype=torch.float64)
    out = fa.decode(q, k_cache, v_cache, k, v, seqlens, slots)
    for i, (n, s) in enumerate(zip(seqlens.tolist(), slots.tolist())):
        assert torch.equal(k_cache[s, n], k[i, 0]) and torch.equal(v_cache[s, n], v[i, 0])
        expected = naive_attention(q[i], k_cache[s, : n + 1], v_cache[s, : n + 1])
        torch.testing.assert_close(out[i], expected)
    changed = (k_cache != before_k).any(-1).any(-1).nonzero().tolist()
    assert changed == [[1, 0], [2, 9], [4, 3]]  # (slot, position): only the appends


def test_reference_reads_nothing_past_cache_seqlens():
    k_cache = torch.full((2, 32, 1, 4), float("nan"))
    v_cache = torch.full((2, 32, 1, 4), float("nan"))
    k_cache[1, :5], v_cache[1, :5] = 1.0, 2.0
    out = fa.decode(
        torch.ones(1, 1, 2, 4),
        k_cache,
        v_cache,
        torch.ones(1, 1, 1, 4),
        torch.full((1, 1, 1, 4), 2.0),
        torch.tensor([5]),
        torch.tensor([1]),
    )
    assert torch.equal(out, torch.full((1, 1, 2, 4), 2.0))


def test_multi_token_decode_is_bottom_right_causal():
    torch.manual_seed(1)
    k_cache, v_cache = torch.zeros(1, 16, 1, 4), torch.zeros(1, 16, 1, 4)
    k_cache[0, :4], v_cache[0, :4] = torch.randn(4, 1, 4), torch.randn(4, 1, 4)
    q, k, v = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4)
    out = fa.decode(q, k_cache, v_cache, k, v, torch.tensor([4]), torch.tensor([0]))
    expected = naive_attention(q[0], k_cache[0, :7], v_cache[0, :7], causal_offset=4)
    torch.testing.assert_close(out[0], expected)


def test_chunked_prefill_equals_whole_prefill():
    torch.manual_seed(2)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    caches_a = torch.zeros(3, 16, 2, 8), torch.zeros(3, 16, 2, 8)
    caches_b = torch.zeros(3, 16, 2, 8), torch.zeros(3, 16, 2, 8)
    whole = fa.prefill(q, k, v, *caches_a, slot=2)
    first = fa.prefill(q[:6], k[:6], v[:6], *caches_b, slot=2)
    rest = fa.prefill(q[6:], k[6:], v[6:], *caches_b, slot=2, start=6)
    torch.testing.assert_close(torch.cat([first, rest]), whole)
    torch.testing.assert_close(whole, naive_attention(q, k, v, causal_offset=0))
    assert torch.equal(caches_a[0], caches_b[0]) and torch.equal(caches_a[0][2, :10], k)


def test_overflowing_append_is_rejected():
    k_cache, v_cache = torch.zeros(1, 4, 1, 4), torch.zeros(1, 4, 1, 4)
    with pytest.raises(ValueError, match="exceed the cache length 4"):
        fa.decode(
            torch.zeros(1, 2, 1, 4),
            k_cache,
            v_cache,
            torch.zeros(1, 2, 1, 4),
            torch.zeros(1, 2, 1, 4),
            torch.tensor([3]),
            torch.tensor([0]),
        )


@pytest.mark.parametrize("layout", ["layer", "mega"])
def test_ragged_decode_on_a_vattention_cache(layout):
    torch.manual_seed(3)
    cfg = vattention.KVCacheConfig(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        max_batch_size=4,
        max_seq_len=256,
        dtype=torch.float32,
        page_size=4096,
        layout=layout,
    )
    with vattention.KVCache(cfg) as cache:
        slots = [cache.alloc() for _ in range(3)]
        prompt_lens = [5, 40, 17]
        cache.step({s: n for s, n in zip(slots, prompt_lens)})
        k_cache, v_cache = cache.layer(1)
        for s, n in zip(slots, prompt_lens):
            fa.prefill(
                torch.randn(n, 4, 16),
                torch.randn(n, 2, 16),
                torch.randn(n, 2, 16),
                k_cache,
                v_cache,
                slot=s,
            )
        cache.step({s: n + 1 for s, n in zip(slots, prompt_lens)})  # back the appended token
        q, k, v = torch.randn(3, 1, 4, 16), torch.randn(3, 1, 2, 16), torch.randn(3, 1, 2, 16)
        out = fa.decode(q, k_cache, v_cache, k, v, torch.tensor(prompt_lens), torch.tensor(slots))
        for i, (s, n) in enumerate(zip(slots, prompt_lens)):
            expected = naive_attention(q[i], k_cache[s, : n + 1], v_cache[s, : n + 1])
            torch.testing.assert_close(out[i], expected)
            assert torch.equal(k_cache[s, n], k[i, 0])


@pytest.mark.gpu
def test_flash_attn_kernel_matches_reference_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    flash = fa.flash_kernel()
    if flash is None:
        pytest.skip("flash-attn is not installed")
    torch.manual_seed(4)
    cfg = vattention.KVCacheConfig(
        num_layers=1,
        num_kv_heads=2,
        head_dim=64,
        max_batch_size=4,
        max_seq_len=4096,
        dtype=torch.float16,
        device="cuda",
    )
    with vattention.KVCache(cfg) as cache:
        slots = [cache.alloc() for _ in range(3)]
        lens = [7, 1000, 130]
        cache.step({s: n + 1 for s, n in zip(slots, lens)})
        k_cache, v_cache = cache.layer(0)
        for s, n in zip(slots, lens):
            k_cache[s, :n].normal_()
            v_cache[s, :n].normal_()
        q = torch.randn(3, 1, 8, 64, device="cuda", dtype=torch.float16)
        k = torch.randn(3, 1, 2, 64, device="cuda", dtype=torch.float16)
        v = torch.randn(3, 1, 2, 64, device="cuda", dtype=torch.float16)
        got = fa.decode(
            q, k_cache, v_cache, k, v, torch.tensor(lens), torch.tensor(slots), kernel=flash
        )
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        want = fa.decode(
            q,
            ref_k,
            ref_v,
            k,
            v,
            torch.tensor(lens),
            torch.tensor(slots),
            kernel=fa.flash_attn_with_kvcache_reference,
        )
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_flash_path_refuses_slot_offsets_beyond_int32():
    calls = []

    def kernel(*args, **kwargs):
        calls.append(kwargs["cache_batch_idx"].tolist())
        return args[0]

    # meta tensors: real strides, no memory. Batch stride 2**28 elements: slot 8 is at 2**31.
    k_cache = torch.empty(16, 2**16, 32, 128, device="meta")
    q, k = torch.zeros(1, 1, 32, 128), torch.zeros(1, 1, 32, 128)
    fa.decode(q, k_cache, k_cache, k, k, torch.tensor([0]), torch.tensor([7]), kernel=kernel)
    with pytest.raises(ValueError, match=r"slot 8 starts 2147483648 elements .*#772"):
        fa.decode(q, k_cache, k_cache, k, k, torch.tensor([0]), torch.tensor([8]), kernel=kernel)
    with pytest.raises(ValueError, match="slot 9 starts"):
        fa.prefill(q[0], k[0], k[0], k_cache, k_cache, slot=9, kernel=kernel)
    fa.decode(
        q,
        k_cache,
        k_cache,
        k,
        k,
        torch.tensor([0]),
        torch.tensor([8]),
        kernel=kernel,
        check_int32_offsets=False,
    )
    assert calls == [[7], [8]]


def test_every_name_of_the_flash_attn_layer_is_importable():
    from vattention.integrations.flash_attn import (  # noqa: F401
        IntArg,
        Kernel,
        decode,
        flash_attn_with_kvcache,
        flash_attn_with_kvcache_reference,
        flash_kernel,
        fp8_store_like_vllm,
        kernel_isa,
        prefill,
    )

    assert kernel_isa is attention.kernel_isa
    assert fp8_store_like_vllm is attention.fp8_store_like_vllm
    assert set(fa.__all__) <= set(dir(fa))


def test_cpu_tensors_run_the_kernel_with_flash_attns_positional_arguments(isa):
    """FA's positional order (max_seqlen_q between cu_seqlens_q and softmax_scale) reaches
    attention.cpu_attention as its keywords, fp8 descales and the prefix hint included; the
    reference takes the same order (in float64: the exact result, which the kernel's output
    is within the derived bound of, tests/support/attention_bound.py)."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(5, 4, 16, generator=gen)
    k, v = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    cached = attention.fp8_store_like_vllm(
        torch.randn(3, 32, 2, 16, generator=gen), torch.float8_e4m3fn
    )
    cached[0, :4] = cached[2, :4]  # what the hint says: rows 2 and 0 share 4 tokens
    seqlens, rows = torch.tensor([6, 9]), torch.tensor([2, 0])
    cu = torch.tensor([0, 1, 2])  # two decode rows: the hint's group
    q, k, v = q[:2], k[:2], v[:2]
    hint = dict(prefix_groups=torch.tensor([0, 0]), prefix_lens=torch.tensor([4, 4]))
    caches = [(cached.clone(), cached.clone()) for _ in range(4)]
    got = fa.flash_attn_with_kvcache(
        q, *caches[0], k, v, seqlens, rows, cu, 4, 0.3, True, (7, 0), 0.5, 2.0, **hint
    )
    want = attention.cpu_attention(
        q,
        *caches[1],
        k,
        v,
        cache_seqlens=seqlens,
        cache_batch_idx=rows,
        cu_seqlens_q=cu,
        softmax_scale=0.3,
        causal=True,
        window_size=(7, 0),
        k_descale=0.5,
        v_descale=2.0,
        **hint,
    )
    ref = fa.flash_attn_with_kvcache_reference(
        q.double(), *caches[2], k, v, seqlens, rows, cu, 4, 0.3, True, (7, 0), 0.5, 2.0
    )
    exact, bound = reference_and_bound(
        q,
        *caches[3],
        k,
        v,
        cache_seqlens=seqlens,
        cache_batch_idx=rows,
        cu_seqlens_q=cu,
        softmax_scale=0.3,
        causal=True,
        window_size=(7, 0),
        k_descale=0.5,
        v_descale=2.0,
    )
    assert torch.equal(got, want) and torch.equal(ref, exact)
    check_within_bound(want, exact, bound, isa)
    for (kc, vc), (kw, vw) in zip(caches, caches[1:]):
        assert torch.equal(kc.view(torch.uint8), kw.view(torch.uint8))
        assert torch.equal(vc.view(torch.uint8), vw.view(torch.uint8))


def test_decode_and_prefill_helpers_use_the_kernel(isa):
    assert fa._default_kernel(torch.zeros(1), torch.zeros(1)) is fa.flash_attn_with_kvcache
    assert (
        fa._default_kernel(torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
        is fa.flash_attn_with_kvcache_reference
    )
    gen = torch.Generator().manual_seed(4)
    kc, vc = torch.randn(3, 64, 2, 32, generator=gen), torch.randn(3, 64, 2, 32, generator=gen)
    q, k, v = (
        torch.randn(10, 4, 32, generator=gen),
        torch.randn(10, 2, 32, generator=gen),
        torch.randn(10, 2, 32, generator=gen),
    )
    ref_k, ref_v = kc.clone(), vc.clone()
    exact, bound = reference_and_bound(
        q[None],
        kc.clone(),
        vc.clone(),
        k[None],
        v[None],
        cache_seqlens=5,
        cache_batch_idx=torch.tensor([2]),
        causal=True,
    )
    got = fa.prefill(q, k, v, kc, vc, slot=2, start=5)
    want = fa.prefill(
        q.double(),
        k,
        v,
        ref_k,
        ref_v,
        slot=2,
        start=5,
        kernel=fa.flash_attn_with_kvcache_reference,
    )
    assert torch.equal(want, exact[0]) and torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    check_within_bound(got, exact[0], bound[0], isa)
