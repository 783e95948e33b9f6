"""Cost of the read check that ``flash_attn_with_kvcache`` runs over a vattention cache (every
request's keys must be mapped, else ``UnmappedReadError`` instead of a fault).

One decode step of a batch of rows (default 64, each ``--tokens`` long, one new token): the check
alone (``check_cache_reads``: the tensor's cache found by address, the lengths read to lists, one
call into the core for the batch), the same over plain tensors (the lookup that finds no cache),
and the decode call with the check against the same call with ``check_reads=False``, measured in
the same run, interleaved A B B A, min and median over the rounds. The ratio's floor is 1.0: the
check adds its own microseconds to a call whose cost is the K/V read (memory bandwidth).

    python benchmarks/bench_read_check.py [--rows 64] [--tokens 512]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import vattention  # noqa: E402
from vattention.integrations import flash_attn as fa  # noqa: E402

from _timing import compare_min_median  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--calls", type=int, default=200, help="calls per timed sample")
    args = parser.parse_args()
    rows, tokens = args.rows, args.tokens
    cfg = vattention.KVCacheConfig(
        num_layers=1,
        num_kv_heads=8,
        head_dim=128,
        max_batch_size=rows,
        max_seq_len=max(4096, tokens + 1),
        dtype=torch.bfloat16,
        page_size="2MB",
    )
    torch.manual_seed(0)
    q = torch.randn(rows, 1, 32, 128, dtype=torch.bfloat16)
    k = torch.randn(rows, 1, 8, 128, dtype=torch.bfloat16)
    v = torch.randn(rows, 1, 8, 128, dtype=torch.bfloat16)
    lens = torch.full((rows,), tokens, dtype=torch.int32)
    plain_k = torch.zeros(rows, tokens + 1, 8, 128, dtype=torch.bfloat16)
    with vattention.KVCache(cfg) as cache:
        slots = torch.tensor([cache.alloc() for _ in range(rows)], dtype=torch.int32)
        cache.step({int(s): tokens + 1 for s in slots})
        k_cache, v_cache = cache.layer(0)

        def check():
            fa.check_cache_reads(q, k_cache, v_cache, k, lens, slots)

        def lookup_plain():
            fa.check_cache_reads(q, plain_k, plain_k, k, lens, slots)

        def decode(checked):
            return lambda: fa.flash_attn_with_kvcache(
                q, k_cache, v_cache, k, v, cache_seqlens=lens, cache_batch_idx=slots,
                causal=True, check_reads=checked,
            )  # fmt: skip

        small = compare_min_median(
            {"check": check, "plain tensors": lookup_plain}, calls=args.calls * 10
        )
        calls = compare_min_median(
            {"checked": decode(True), "unchecked": decode(False)}, calls=args.calls
        )
    load = os.getloadavg()[0]
    print(
        f"decode over {rows} rows x {tokens} tokens, 8 KV heads x 128, bf16, "
        f"{torch.get_num_threads()} threads; load average {load:.2f}\n"
    )
    print("| what | min us | median us |")
    print("|---|---:|---:|")
    for name, (lo, med) in small.items():
        print(f"| check_cache_reads, {name} | {lo * 1e6:.1f} | {med * 1e6:.1f} |")
    for name, (lo, med) in calls.items():
        print(f"| flash_attn_with_kvcache, {name} | {lo * 1e6:.1f} | {med * 1e6:.1f} |")
    (clo, cmed), (ulo, umed) = calls["checked"], calls["unchecked"]
    print(f"\nchecked / unchecked call: min {clo / ulo:.3f}, median {cmed / umed:.3f}")


if __name__ == "__main__":
    main()
