"""FlashAttention decode/prefill latency: virtual cache vs contiguous tensors vs FA's paged KV.

Same values in all three: the contiguous tensor is a copy of the (fully mapped) virtual one, and the
paged variant views that copy as blocks of 256 tokens with a block_table. Ratios are to contiguous.
"""

from __future__ import annotations

import statistics

GB = 1 << 30


def _time_ms(fn, iters: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(
    batches=(1, 4, 16, 64),
    contexts=(1024, 4096, 16384, 65536),
    q_heads=32,
    kv_heads=8,
    head_dim=128,
    prefill_tokens=512,
    iters=20,
) -> list[dict]:
    import torch
    from flash_attn import flash_attn_with_kvcache

    import vattention

    free_bytes, _ = torch.cuda.mem_get_info()
    rows = []
    for batch in batches:
        for ctx in contexts:
            kv_bytes = 2 * batch * ctx * kv_heads * head_dim * 2  # K+V, bf16
            if 2.5 * kv_bytes > free_bytes:
                rows.append({"batch": batch, "context": ctx, "skipped": "GPU memory"})
                continue
            cfg = vattention.KVCacheConfig(
                num_layers=1,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                max_batch_size=batch,
                max_seq_len=ctx,
                dtype=torch.bfloat16,
                device="cuda:0",
            )
            with vattention.KVCache(cfg) as cache:
                slots = [cache.alloc() for _ in range(batch)]
                cache.step({s: ctx for s in slots})
                k, v = cache.layer(0)
                k.normal_()
                v.normal_()
                kc, vc = k.clone(), v.clone()
                block = 256
                kp = kc.view(batch * ctx // block, block, kv_heads, head_dim)
                vp = vc.view(batch * ctx // block, block, kv_heads, head_dim)
                table = torch.arange(batch * ctx // block, dtype=torch.int32, device="cuda").view(
                    batch, ctx // block
                )
                lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
                idx = torch.tensor(slots, dtype=torch.int32, device="cuda")
                for phase, q_len in (("decode", 1), ("prefill", min(prefill_tokens, ctx))):
                    q = torch.randn(
                        batch, q_len, q_heads, head_dim, device="cuda", dtype=torch.bfloat16
                    )
                    t_virtual = _time_ms(
                        lambda: flash_attn_with_kvcache(
                            q, k, v, cache_seqlens=lens, cache_batch_idx=idx, causal=True
                        ),
                        iters,
                    )
                    t_contig = _time_ms(
                        lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True),
                        iters,
                    )
                    t_paged = _time_ms(
                        lambda: flash_attn_with_kvcache(
                            q, kp, vp, cache_seqlens=lens, block_table=table, causal=True
                        ),
                        iters,
                    )
                    rows.append(
                        {
                            "phase": phase,
                            "batch": batch,
                            "context": ctx,
                            "contiguous_ms": round(t_contig, 4),
                            "virtual_ms": round(t_virtual, 4),
                            "paged_ms": round(t_paged, 4),
                            "virtual/contiguous": round(t_virtual / t_contig, 3),
                            "paged/contiguous": round(t_paged / t_contig, 3),
                        }
                    )
                kc = vc = kp = vp = None  # free them (the timing lambdas share them)
                torch.cuda.empty_cache()
    return rows
