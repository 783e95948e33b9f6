"""Cost of KVCache.step() when nothing needs mapping (the common decode iteration), and the cost
of scrubbing pages that change owner (KVCacheConfig(scrub=True)).

Baseline of the first table, measured in the same run: merely iterating the same seq_lens input in
Python (`for slot, n in seq_lens.items(): pass`, or `for n in seq_lens: pass` for a list).
Target: <= 3x.

Second table: one request turnover per slot (free; the pages go back to the pool, or stay with the
idle slot; alloc; step() maps or inherits one page index per tensor for the new request), with
scrub=True against the same config with scrub=False, measured in the same run, interleaved.

    python benchmarks/bench_step.py
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import vattention  # noqa: E402

from _timing import compare  # noqa: E402


def iterate_dict(d):
    for _slot, _n in d.items():
        pass


def iterate_list(lst):
    for _n in lst:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    batch = 256
    cfg = vattention.KVCacheConfig(
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        max_batch_size=batch,
        max_seq_len=4096,
        dtype=torch.bfloat16,
        page_size="2MB",
        layout="mega",
    )
    print(
        f"step() with nothing to map, max_batch_size={batch}, {cfg.layout} layout, "
        f"median of interleaved rounds\n"
    )
    print("| active slots | input | step() us | iterate input us | ratio (target <= 3x) |")
    print("|---:|---|---:|---:|---:|")
    with vattention.KVCache(cfg) as cache:
        slots = [cache.alloc() for _ in range(batch)]
        for active in (1, 64, 256):
            as_dict = {s: 100 + s for s in slots[:active]}
            as_list = [as_dict.get(s, 0) for s in range(batch)]
            cache.step(as_dict)  # maps once; the timed calls find everything mapped
            maps = cache.stats()["map_calls"]
            for name, lens, baseline in (
                ("dict", as_dict, iterate_dict),
                ("list", as_list, iterate_list),
            ):
                t = compare(
                    {"step": lambda: cache.step(lens), "iterate": lambda: baseline(lens)},
                    calls=args.calls,
                )
                print(
                    f"| {active} | {name} | {t['step'] * 1e6:.2f} | {t['iterate'] * 1e6:.2f} | "
                    f"{t['step'] / t['iterate']:.2f}x |"
                )
            assert cache.stats()["map_calls"] == maps, "the timed steps mapped pages"
    scrub_table(args.calls // 20)


def scrub_table(calls: int) -> None:
    """Request turnover with scrub on vs off: the cost of zeroing pages that change owner."""
    batch = 8
    print(
        f"\nRequest turnover (free, alloc, step to one page) x {batch} slots, host backend, "
        "scrub=True vs scrub=False in the same run\n"
    )
    print("| layout | page size | path | pages per turnover | scrub off us | scrub on us | ratio |")
    print("|---|---|---|---:|---:|---:|---:|")
    for layout, page in (("layer", "2MB"), ("mega", "2MB"), ("layer", "64KB")):
        for path in ("idle slot reused", "pool (reclaim)"):
            caches = {}
            for scrub in (False, True):
                cfg = vattention.KVCacheConfig(
                    num_layers=4,
                    num_kv_heads=8,
                    head_dim=128,
                    max_batch_size=batch,
                    max_seq_len=4096,
                    dtype=torch.bfloat16,
                    page_size=page,
                    layout=layout,
                    scrub=scrub,
                )
                caches[scrub] = vattention.KVCache(cfg)
            tokens = cfg.tokens_per_page

            reclaim = path.startswith("pool")

            def turnover(cache, reclaim=reclaim):
                for s in cache.active_slots():
                    cache.free(s)
                if reclaim:
                    cache.reclaim()
                new = [cache.alloc() for _ in range(batch)]
                cache.step({s: tokens for s in new})

            for cache in caches.values():
                for _ in range(batch):
                    cache.alloc()
                cache.step({s: tokens for s in cache.active_slots()})
            t = compare(
                {"off": lambda: turnover(caches[False]), "on": lambda: turnover(caches[True])},
                calls=max(calls, 5),
            )
            pages = batch * cfg.num_tensors
            print(
                f"| {layout} | {page} | {path} | {pages} | {t['off'] * 1e6:.0f} | "
                f"{t['on'] * 1e6:.0f} | {t['on'] / t['off']:.2f}x |"
            )
            assert caches[True].stats()["scrubbed_pages"] > 0
            for cache in caches.values():
                cache.close()


if __name__ == "__main__":
    main()
