"""FlashAttention over the virtual cache equals FlashAttention over contiguous tensors (GPU only).

The virtual cache is a dense strided tensor, so ``flash_attn_with_kvcache`` must produce
bit-identical outputs whether it reads the virtual K/V or a contiguous copy of the same values.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

LENS = [1, 300, 2049, 4096]  # crosses page boundaries at 2 MB pages (tokens_per_page = 1024 here)


def _filled_cache(device, layout):
    import torch

    import vattention

    cfg = vattention.KVCacheConfig(
        num_layers=2,
        num_kv_heads=8,
        head_dim=128,
        max_batch_size=len(LENS),
        max_seq_len=4096,
        dtype=torch.bfloat16,
        device=device,
        layout=layout,
    )
    cache = vattention.KVCache(cfg)
    slots = [cache.alloc() for _ in LENS]
    cache.step(dict(zip(slots, LENS)))
    gen = torch.Generator(device=device).manual_seed(0)
    for layer in range(cfg.num_layers):
        k, v = cache.layer(layer)
        for slot, n in zip(slots, LENS):
            k[slot, :n] = torch.randn(n, 8, 128, device=device, generator=gen, dtype=torch.bfloat16)
            v[slot, :n] = torch.randn(n, 8, 128, device=device, generator=gen, dtype=torch.bfloat16)
    return cache, slots


def _contiguous_copy(t, slots):
    import torch

    out = torch.zeros((len(slots),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    for i, (slot, n) in enumerate(zip(slots, LENS)):
        out[i, :n] = t[slot, :n]  # copy only mapped positions: the rest would fault
    return out


@pytest.mark.parametrize("layout", ["layer", "mega"])
@pytest.mark.parametrize("q_len", [1, 64], ids=["decode", "prefill"])
def test_flash_attn_virtual_equals_contiguous(gpu, layout, q_len):
    import torch

    fa = pytest.importorskip("flash_attn")
    cache, slots = _filled_cache(gpu, layout)
    with cache:
        k, v = cache.layer(1)
        assert k.is_cuda and k.device.index == 0
        lens = torch.tensor(LENS, dtype=torch.int32, device=gpu)
        idx = torch.tensor(slots, dtype=torch.int32, device=gpu)
        q = torch.randn(len(LENS), q_len, 32, 128, device=gpu, dtype=torch.bfloat16)
        out_virtual = fa.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=lens, cache_batch_idx=idx, causal=True
        )
        kc, vc = _contiguous_copy(k, slots), _contiguous_copy(v, slots)
        out_contig = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
        torch.cuda.synchronize()
        assert torch.equal(out_virtual, out_contig)


def test_sdpa_over_virtual_slice_equals_contiguous(gpu):
    import torch

    cache, slots = _filled_cache(gpu, "layer")
    with cache:
        k, v = cache.layer(0)
        slot, n = slots[2], LENS[2]
        q = torch.randn(1, 8, 16, 128, device=gpu, dtype=torch.bfloat16)
        kv = (k[slot, :n].transpose(0, 1)[None], v[slot, :n].transpose(0, 1)[None])
        a = torch.nn.functional.scaled_dot_product_attention(q, *kv)
        b = torch.nn.functional.scaled_dot_product_attention(q, *(t.contiguous() for t in kv))
        assert torch.equal(a, b)
