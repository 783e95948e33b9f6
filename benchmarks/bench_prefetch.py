"""How long step() blocks the caller per decode iteration, with background prefetch vs without.

A decode loop: every iteration calls step() for all running slots, then "computes" for a fixed
gap (sleep, standing in for the attention kernels), and, in the prefetch run, calls prefetch()
with the next iteration's lengths right after step(). Slot lengths are staggered so that some
slot crosses a page boundary every couple of iterations. Pages are pre-created with reserve()
(as a server does at start-up), so the runs differ only in where mapping happens.

Reported: mean and p99 time inside step() per iteration, and the ratio prefetch / no prefetch
(target <= 0.1).

    python benchmarks/bench_prefetch.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import vattention

SHAPES = {
    # (layout, page): dims giving ~32 tokens per page, so boundaries are crossed often.
    ("layer", "64KB"): dict(num_layers=8, num_kv_heads=8, head_dim=128),
    ("mega", "2MB"): dict(num_layers=32, num_kv_heads=8, head_dim=128),
    ("layer", "2MB"): dict(num_layers=8, num_kv_heads=8, head_dim=128),
}


def run(
    layout: str,
    page: str,
    prefetch: bool,
    iterations: int,
    gap_s: float,
    slots: int,
    device: str = "cpu",
    dims: dict | None = None,
    lookahead_tokens: int | None = None,
    floor: bool = False,
    compute: Callable[[], None] | None = None,
):
    """One decode loop; floor=True keeps every length fixed (step() never maps: its bare cost).

    ``compute`` stands for the model's work between steps (default: sleep ``gap_s``; the GPU
    check passes a real kernel and waits for it).
    """
    cfg = vattention.KVCacheConfig(
        **(dims or SHAPES[(layout, page)]),
        max_batch_size=slots,
        max_seq_len=4096,
        dtype=torch.float16,
        page_size=page,
        layout=layout,
        device=device,
    )
    blocked = []
    with vattention.KVCache(cfg) as cache:
        tpp = cfg.tokens_per_page
        lens = {cache.alloc(): 1 + (i * tpp) // slots for i in range(slots)}
        final = {s: n + iterations + 1 + (lookahead_tokens or 0) for s, n in lens.items()}
        cache.reserve(sum(cfg.pages_for_tokens(n) for n in final.values()) * cfg.page_bytes)
        cache.step(lens)
        before = cache.stats()
        for _ in range(iterations):
            if not floor:
                lens = {s: n + 1 for s, n in lens.items()}
            t0 = time.perf_counter()
            cache.step(lens)
            blocked.append(time.perf_counter() - t0)
            if prefetch:
                cache.prefetch(
                    {s: n + 1 for s, n in lens.items()}, lookahead_tokens=lookahead_tokens
                )
            if compute is None:
                time.sleep(gap_s)
            else:
                compute()
        stats = cache.stats()
    blocked.sort()
    return {
        "mean": statistics.fmean(blocked),
        "p99": blocked[int(0.99 * (len(blocked) - 1))],
        "step_maps": stats["step_map_calls"] - before["step_map_calls"],
        # Driver calls per iteration, made inside step() / by the prefetch thread (None when
        # the core predates these counters).
        "step_calls": _per_step(stats, before, "step_driver_calls", iterations),
        "prefetch_calls": _per_step(stats, before, "prefetch_driver_calls", iterations),
        "prefetch_maps": stats["prefetch_map_calls"],
        "tokens_per_page": cfg.tokens_per_page,
    }


def _per_step(after: dict, before: dict, key: str, iterations: int):
    if key not in after:
        return None
    return (after[key] - before[key]) / iterations


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--gap-ms", type=float, default=2.0, help="simulated compute per iteration")
    parser.add_argument("--slots", type=int, default=16)
    args = parser.parse_args()
    print(
        f"host backend, {args.slots} slots, {args.iterations} iterations, "
        f"{args.gap_ms} ms simulated compute per iteration\n"
    )
    print(
        "| layout | page | tokens/page | compute gap | step() blocks, no prefetch: "
        "mean / p99 us | with prefetch: mean / p99 us | ratio (mean, target <= 0.1) | "
        "maps inside step() (no pf / pf) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    # The last row gives layer/2MB (2 x 8 layers x 2 MB to populate per boundary crossing, ~8 ms
    # on the host) a compute gap long enough to hide it.
    rows = [(layout, page, args.gap_ms) for layout, page in SHAPES] + [("layer", "2MB", 10.0)]
    for layout, page, gap_ms in rows:
        base = run(layout, page, False, args.iterations, gap_ms / 1e3, args.slots)
        pf = run(layout, page, True, args.iterations, gap_ms / 1e3, args.slots)
        print(
            f"| {layout} | {page} | {base['tokens_per_page']} | {gap_ms:g} ms | "
            f"{base['mean'] * 1e6:.1f} / {base['p99'] * 1e6:.1f} | "
            f"{pf['mean'] * 1e6:.1f} / {pf['p99'] * 1e6:.1f} | {pf['mean'] / base['mean']:.3f} | "
            f"{base['step_maps']} / {pf['step_maps']} |"
        )


if __name__ == "__main__":
    main()
