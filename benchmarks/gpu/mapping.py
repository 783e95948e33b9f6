"""Mapping throughput: GB/s of KV cache made available by cache.step() on the CUDA backend.

Two cases per page size: pages pre-created by cache.reserve() (map + set_access only, the hot
path) and pages created on demand (cuMemCreate inside step).
"""

from __future__ import annotations

import time

GB = 1 << 30


def measure(
    device: str = "cuda:0",
    page_sizes=("2MB", "8MB"),
    batch: int = 64,
    max_seq: int = 8192,
    chunk: int = 512,
) -> list[dict]:
    import torch

    import vattention

    rows = []
    for page in page_sizes:
        for pre_created in (True, False):
            cfg = vattention.KVCacheConfig(
                num_layers=32,
                num_kv_heads=8,
                head_dim=128,
                max_batch_size=batch,
                max_seq_len=max_seq,
                dtype=torch.bfloat16,
                device=device,
                page_size=page,
            )
            with vattention.KVCache(cfg) as cache:
                slots = [cache.alloc() for _ in range(batch)]
                if pre_created:
                    cache.reserve(cfg.pages_for_tokens(max_seq) * batch * cfg.page_bytes)
                before = cache.stats()
                t0 = time.perf_counter()
                for n in range(chunk, max_seq + 1, chunk):
                    cache.step({s: n for s in slots})
                elapsed = time.perf_counter() - t0
                after = cache.stats()
                mapped = after["bytes_mapped"] - before["bytes_mapped"]
                rows.append(
                    {
                        "page": page,
                        "pages_pre_created": pre_created,
                        "GB_mapped": round(mapped / GB, 2),
                        "map_calls": after["map_calls"] - before["map_calls"],
                        "set_access_calls": after["set_access_calls"] - before["set_access_calls"],
                        "seconds": round(elapsed, 4),
                        "GB_per_s": round(mapped / GB / elapsed, 2),
                    }
                )
    return rows
