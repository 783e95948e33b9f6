"""Per-layer shapes, sliding windows and fp8 caches under FlashAttention, on a real GPU.

Written without a GPU (none was lent to this project): these are the checks docs/models.md lists
as "what a GPU run must still verify". The same paths pass on the host backend and the CUDA driver
emulation (tests/test_per_layer_shapes.py, tests/test_window.py, tests/test_fp8_and_k_only.py).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _contiguous(t, slots, lens, start=None):
    """A contiguous copy of rows `slots` holding positions [start, len) (zeros elsewhere): only
    backed positions are read, as a kernel given `cache_seqlens` and a window would."""
    import torch

    out = torch.zeros((len(slots),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    for i, (slot, n) in enumerate(zip(slots, lens)):
        a = 0 if start is None else start[i]
        out[i, a:n] = t[slot, a:n]
    return out


@pytest.mark.parametrize(
    "heads, dims, index_pages",
    [
        ([8, 4], [128, 256], [1, 1]),  # Gemma-4-like global head dim: same bytes a token
        ([8, 2], [128, 128], [4, 1]),  # 4 pages a page index in layer 0's tensors
    ],
)
def test_flash_attn_reads_each_layer_of_a_per_layer_shape_cache(gpu, heads, dims, index_pages):
    import torch

    import vattention

    fa = pytest.importorskip("flash_attn")
    lens = [1, 700, 3000]
    cfg = vattention.KVCacheConfig(
        num_layers=2,
        num_kv_heads=heads,
        head_dim=dims,
        max_batch_size=3,
        max_seq_len=8192,
        dtype=torch.bfloat16,
        device=gpu,
    )
    assert [cfg.index_pages(i) for i in range(2)] == index_pages
    with vattention.KVCache(cfg) as cache:
        slots = [cache.alloc() for _ in lens]
        cache.step(dict(zip(slots, lens)))
        seqlens = torch.tensor(lens, dtype=torch.int32, device=gpu)
        idx = torch.tensor(slots, dtype=torch.int32, device=gpu)
        for layer in range(2):
            k, v = cache.layer(layer)
            h, d = cfg.layer_kv_heads[layer], cfg.layer_head_dims[layer]
            for slot, n in zip(slots, lens):
                k[slot, :n] = torch.randn(n, h, d, device=gpu, dtype=torch.bfloat16)
                v[slot, :n] = torch.randn(n, h, d, device=gpu, dtype=torch.bfloat16)
            q = torch.randn(3, 1, 16, d, device=gpu, dtype=torch.bfloat16)
            got = fa.flash_attn_with_kvcache(
                q, k, v, cache_seqlens=seqlens, cache_batch_idx=idx, causal=True
            )
            want = fa.flash_attn_with_kvcache(
                q,
                _contiguous(k, slots, lens),
                _contiguous(v, slots, lens),
                cache_seqlens=seqlens,
                causal=True,
            )
            torch.cuda.synchronize()
            assert torch.equal(got, want), f"layer {layer}"


def test_flash_attn_window_over_released_pages(gpu):
    """Decode past the window: step() unmapped the pages before it; FA's window never reads
    them (an illegal address would say otherwise) and equals a contiguous copy."""
    import torch

    import vattention

    fa = pytest.importorskip("flash_attn")
    window = 1000
    cfg = vattention.KVCacheConfig(
        num_layers=1,
        num_kv_heads=8,
        head_dim=128,
        max_batch_size=2,
        max_seq_len=16384,
        dtype=torch.bfloat16,
        device=gpu,
        sliding_window=window,
    )
    with vattention.KVCache(cfg) as cache:
        slots = [cache.alloc(), cache.alloc()]
        k, v = cache.layer(0)
        lens = [3000, 5000]
        cache.step(dict(zip(slots, lens)))  # prefill: nothing released yet
        for slot, n in zip(slots, lens):
            k[slot, :n] = torch.randn(n, 8, 128, device=gpu, dtype=torch.bfloat16)
            v[slot, :n] = torch.randn(n, 8, 128, device=gpu, dtype=torch.bfloat16)
        q = torch.randn(2, 1, 32, 128, device=gpu, dtype=torch.bfloat16)
        for _ in range(3 * 1024):  # decode: queue kernels, then release behind them
            lens = [n + 1 for n in lens]
            cache.step(dict(zip(slots, lens)))
            seqlens = torch.tensor(lens, dtype=torch.int32, device=gpu)
            idx = torch.tensor(slots, dtype=torch.int32, device=gpu)
            fa.flash_attn_with_kvcache(
                q,
                k,
                v,
                cache_seqlens=seqlens,
                cache_batch_idx=idx,
                causal=True,
                window_size=(window - 1, 0),
            )
        torch.cuda.synchronize()
        starts = [cache.window_start(s, 0) for s in slots]
        assert all(a > 0 for a in starts) and cache.stats()["window_released_pages"] > 0
        got = fa.flash_attn_with_kvcache(
            q,
            k,
            v,
            cache_seqlens=seqlens,
            cache_batch_idx=idx,
            causal=True,
            window_size=(window - 1, 0),
        )
        want = fa.flash_attn_with_kvcache(
            q,
            _contiguous(k, slots, lens, starts),
            _contiguous(v, slots, lens, starts),
            cache_seqlens=seqlens,
            causal=True,
            window_size=(window - 1, 0),
        )
        torch.cuda.synchronize()
        assert torch.equal(got, want)


def test_fp8_tensors_are_cuda_views_with_the_right_bytes(gpu):
    import torch

    import vattention

    cfg = vattention.KVCacheConfig(
        num_layers=1,
        num_kv_heads=8,
        head_dim=128,
        max_batch_size=1,
        max_seq_len=4096,
        dtype=torch.float8_e4m3fn,
        device=gpu,
    )
    with vattention.KVCache(cfg) as cache:
        slot = cache.alloc()
        cache.step({slot: 2500})
        k, _ = cache.layer(0)
        assert k.is_cuda and k.dtype == torch.float8_e4m3fn
        assert k.data_ptr() == cache.layer_ptrs(0)[0]
        x = torch.randn(2500, 8, 128, device=gpu).to(torch.float8_e4m3fn)
        k[slot, :2500] = x
        torch.cuda.synchronize()
        assert torch.equal(k[slot, :2500].view(torch.uint8), x.view(torch.uint8))
        assert torch.equal(k[slot, :2500].to(torch.bfloat16), x.to(torch.bfloat16))
