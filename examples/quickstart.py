"""Quickstart: a paged KV cache that attention kernels see as one dense tensor per layer.

Run: ``python examples/quickstart.py`` (CPU; the same code runs with ``device="cuda"``).
"""

import torch
import torch.nn.functional as F

import vattention

cfg = vattention.KVCacheConfig(num_layers=4, num_kv_heads=2, head_dim=64, max_batch_size=8,
                               max_seq_len=4096, dtype=torch.float32, device="cpu",
                               page_size="64KB", layout="layer")
print(f"virtual {cfg.virtual_bytes / 2**20:.0f} MiB reserved, a static cache would hold "
      f"{cfg.static_bytes / 2**20:.0f} MiB; {cfg.tokens_per_page} tokens per page")

with vattention.KVCache(cfg) as cache:
    slot = cache.alloc()                      # one request = one batch row
    prompt_len = 100
    cache.step({slot: prompt_len})            # map pages for 100 tokens (all layers, K and V)

    k_cache, v_cache = cache.layer(0)         # [max_batch, max_seq, kv_heads, head_dim], zero-copy
    k_cache[slot, :prompt_len] = torch.randn(prompt_len, 2, 64)
    v_cache[slot, :prompt_len] = torch.randn(prompt_len, 2, 64)

    # Attention reads the backed prefix of the slot's row: a plain strided view.
    q = torch.randn(1, 2, 1, 64)                                   # [batch, heads, 1, head_dim]
    keys = k_cache[slot, :prompt_len].transpose(0, 1).unsqueeze(0)  # [1, heads, len, head_dim]
    values = v_cache[slot, :prompt_len].transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(q, keys, values)
    print("attention output", tuple(out.shape))

    for length in range(prompt_len + 1, prompt_len + 200):         # decode: grow one token a step
        cache.step({slot: length})
    stats = cache.stats()
    print(f"after {cache.seq_len(slot)} tokens: {stats['pages_mapped']} pages mapped "
          f"({stats['bytes_mapped'] / 2**10:.0f} KiB), backing {cache.mapped_tokens(slot)} tokens")
    cache.free(slot)                          # pages stay mapped for the next request
    print("reclaimed pages:", cache.reclaim())
