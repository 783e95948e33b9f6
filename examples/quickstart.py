"""Quickstart: the README snippet. Run: ``python examples/quickstart.py`` (CPU)."""

import torch

import vattention

cfg = vattention.KVCacheConfig(num_layers=4, num_kv_heads=8, head_dim=128, max_batch_size=8,
                               max_seq_len=8192, dtype=torch.bfloat16, page_size="64KB")
with vattention.KVCache(cfg, memory_budget="256MB") as cache:
    slot = cache.alloc()                         # one slot (batch row) per request
    cache.step({slot: 1000})                     # map pages for 1000 tokens
    k, v = cache.layer(0)                        # [8, 8192, 8, 128] dense tensors, zero-copy
    k[slot, :1000] = torch.randn(1000, 8, 128)   # write K/V where the kernel expects them
    q = torch.randn(1, 8, 1, 128, dtype=torch.bfloat16)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k[slot, :1000].transpose(0, 1)[None], v[slot, :1000].transpose(0, 1)[None])
    print(cache.stats()["bytes_mapped"], "bytes mapped of", cfg.virtual_bytes, "reserved")
    cache.free(slot)                             # pages stay mapped for the next request
