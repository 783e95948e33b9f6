"""``python -m vattention demo``: continuous batching on the CPU over a virtual KV cache.

Requests with real length distributions (a ShareGPT sample, lengths scaled down to finish in
seconds) arrive, prefill their prompt, decode one token per iteration and leave. Every iteration
writes K/V into the cache tensors and runs torch SDPA directly over the cache views, checked
against SDPA over a contiguous copy. Physical memory follows the live tokens; the closing table
compares it with what a static max-length allocation would hold.
"""

from __future__ import annotations

import argparse
import collections
from typing import Deque, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..cache import KVCache
from ..config import KVCacheConfig
from ..errors import OutOfPagesError
from .progress import Progress
from .traces import TRACE_NAMES, load_trace

MiB = 1 << 20


def _requests(trace: str, count: int, scale: int, max_seq_len: int, seed: int) -> List[List[int]]:
    rows = load_trace(trace)
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(rows), (count,), generator=gen).tolist()
    out = []
    for i in picks:
        prompt = max(1, int(rows[i][0]) // scale)
        decode = max(1, int(rows[i][1]) // scale)
        prompt = min(prompt, max_seq_len // 2)
        out.append([prompt, min(decode, max_seq_len - prompt)])
    return out


def run(
    num_requests: int = 48,
    max_batch_size: int = 16,
    max_seq_len: int = 1024,
    page_size: str = "64KB",
    layout: str = "layer",
    budget: str = "24MB",
    trace: str = "sharegpt",
    scale: int = 4,
    seed: int = 0,
    verbose: bool = True,
) -> Dict:
    num_kv_heads, head_dim = 4, 64
    cfg = KVCacheConfig(
        num_layers=4,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        dtype=torch.float32,
        page_size=page_size,
        layout=layout,
    )
    # One query head per KV head: torch's CPU SDPA takes a slow path for grouped-query attention
    # over transposed (BSHD) views, virtual or not.
    heads_q = num_kv_heads
    gen = torch.Generator().manual_seed(seed)
    requests = _requests(trace, num_requests, scale, max_seq_len, seed)
    waiting: Deque[int] = collections.deque(range(num_requests))
    running: Dict[int, int] = {}  # request -> slot
    length: Dict[int, int] = {}  # request -> tokens in the cache
    generated = [0] * num_requests
    peak = {"concurrency": 0, "bytes_mapped": 0, "pages_mapped": 0}
    efficiency: List[float] = []
    preemptions = iterations = checks = 0

    def kv_for(n: int):
        return (
            torch.randn(n, num_kv_heads, head_dim, generator=gen),
            torch.randn(n, num_kv_heads, head_dim, generator=gen),
        )

    def layer_kv(layer: int) -> Tuple[torch.Tensor, torch.Tensor]:
        k, v = cache.layer(layer)
        assert v is not None  # the config keeps V (value_cache=True)
        return k, v

    def attend(slot: int, q_len: int, total: int, check: bool) -> None:
        nonlocal checks
        for layer in range(cfg.num_layers):
            k, v = layer_kv(layer)
            q = torch.randn(1, heads_q, q_len, head_dim, generator=gen)
            keys = k[slot, :total].transpose(0, 1).unsqueeze(0)  # [1, H, n, D] strided view
            vals = v[slot, :total].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(q, keys, vals, is_causal=q_len > 1)
            if check:
                ref = F.scaled_dot_product_attention(
                    q, keys.contiguous(), vals.contiguous(), is_causal=q_len > 1
                )
                assert torch.equal(out, ref), "SDPA over the virtual cache differs"
                checks += 1

    with (
        KVCache(cfg, memory_budget=budget) as cache,
        Progress(num_requests, "requests", enabled=verbose) as bar,
    ):
        while waiting or running:
            iterations += 1
            # Admission (FCFS): a new request gets a slot and its whole prompt in one step.
            prefills: List[int] = []
            while waiting and len(running) < max_batch_size:
                req = waiting[0]
                slot = cache.alloc()
                try:
                    cache.step({slot: requests[req][0]})
                except OutOfPagesError:
                    cache.free(slot)
                    break
                waiting.popleft()
                running[req] = slot
                length[req] = requests[req][0]
                prefills.append(req)
            # Decode: every running request appends one token; preempt the youngest on OOM.
            decoding = [r for r in running if r not in prefills]
            while True:
                try:
                    cache.step({running[r]: length[r] + 1 for r in decoding})
                    break
                except OutOfPagesError:
                    victim = max(running, key=lambda r: (r not in prefills, r))
                    cache.free(running.pop(victim))
                    generated[victim] = 0
                    waiting.appendleft(victim)
                    preemptions += 1
                    if victim in decoding:
                        decoding.remove(victim)
                    if victim in prefills:
                        prefills.remove(victim)
            for r in prefills:
                slot, n = running[r], length[r]
                for layer in range(cfg.num_layers):
                    k, v = layer_kv(layer)
                    k[slot, :n], v[slot, :n] = kv_for(n)
                attend(slot, n, n, check=r % 8 == 0)
            for r in decoding:
                slot, n = running[r], length[r]
                for layer in range(cfg.num_layers):
                    k, v = layer_kv(layer)
                    knew, vnew = kv_for(1)
                    k[slot, n], v[slot, n] = knew[0], vnew[0]
                attend(slot, 1, n + 1, check=iterations % 50 == 0)
                length[r] = n + 1
                generated[r] += 1
            # Map the next iteration's pages in the background while this one "computes".
            cache.prefetch({running[r]: length[r] + 1 for r in running if length[r] < max_seq_len})
            stats = cache.stats()
            peak["concurrency"] = max(peak["concurrency"], len(running))
            peak["bytes_mapped"] = max(peak["bytes_mapped"], stats["bytes_mapped"])
            peak["pages_mapped"] = max(peak["pages_mapped"], stats["pages_mapped"])
            if stats["bytes_mapped"]:
                efficiency.append(stats["bytes_used_by_tokens"] / stats["bytes_mapped"])
            for r in [r for r in running if generated[r] >= requests[r][1]]:
                cache.free(running.pop(r))
                bar.update(1)
        cache.wait()
        final = cache.stats()
    static = max_batch_size * max_seq_len * cfg.bytes_per_token
    static_concurrency = min(
        max_batch_size, int(_parse_budget(budget) // (max_seq_len * cfg.bytes_per_token))
    )
    return {
        "config": cfg,
        "requests": num_requests,
        "iterations": iterations,
        "tokens": sum(p + d for p, d in requests),
        "preemptions": preemptions,
        "peak_concurrency": peak["concurrency"],
        "peak_bytes_mapped": peak["bytes_mapped"],
        "peak_pages_mapped": peak["pages_mapped"],
        "static_bytes": static,
        "static_concurrency": static_concurrency,
        "efficiency_mean": sum(efficiency) / max(1, len(efficiency)),
        "map_calls": final["map_calls"],
        "unmap_calls": final["unmap_calls"],
        "prefetch_map_calls": final["prefetch_map_calls"],
        "sdpa_checks": checks,
        "budget_bytes": _parse_budget(budget),
    }


def _parse_budget(budget) -> int:
    from ..config import parse_size

    return parse_size(budget, name="budget")


def format_table(r: Dict) -> str:
    cfg = r["config"]
    rows = [
        (
            "requests completed",
            f"{r['requests']} ({r['tokens']} tokens, {r['iterations']} iterations)",
        ),
        ("KV memory budget", f"{r['budget_bytes'] / MiB:.1f} MiB"),
        (
            "physical KV memory, peak",
            f"{r['peak_bytes_mapped'] / MiB:.1f} MiB "
            f"({r['peak_pages_mapped']} pages of "
            f"{cfg.page_bytes // 1024} KB)",
        ),
        (
            "static max-length allocation",
            f"{r['static_bytes'] / MiB:.1f} MiB for "
            f"{cfg.max_batch_size} x {cfg.max_seq_len} tokens",
        ),
        (
            "peak concurrent requests",
            f"{r['peak_concurrency']} (static allocation in the same "
            f"budget: {r['static_concurrency']})",
        ),
        (
            "mean KV memory efficiency",
            f"{100 * r['efficiency_mean']:.1f}% (live token bytes / mapped bytes)",
        ),
        ("preemptions", str(r["preemptions"])),
        (
            "map / unmap calls",
            f"{r['map_calls']} / {r['unmap_calls']} "
            f"({r['prefetch_map_calls']} maps by the prefetch thread)",
        ),
        ("SDPA virtual == contiguous", f"{r['sdpa_checks']} checks, all bit-identical"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m vattention demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=48, help="requests to serve (default: 48)")
    p.add_argument("--batch", type=int, default=16, help="max_batch_size (slots)")
    p.add_argument(
        "--max-seq-len", type=int, default=1024, help="max_seq_len in tokens (default: 1024)"
    )
    p.add_argument("--page-size", default="64KB", help="page size (default: 64KB)")
    p.add_argument(
        "--layout", default="layer", choices=("layer", "mega"), help="cache layout (default: layer)"
    )
    p.add_argument("--budget", default="24MB", help="physical KV memory budget")
    p.add_argument(
        "--trace",
        default="sharegpt",
        help=f"request lengths: a packaged trace ({', '.join(TRACE_NAMES)}) or a CSV with the "
        "columns num_prefill_tokens and num_decode_tokens, divided by 4 (default: sharegpt)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    args = p.parse_args(argv)
    # Tiny attention calls: thread-pool hand-offs cost more than they save (and a 2-core CI
    # machine has no core to spare for them).
    torch.set_num_threads(1)
    result = run(
        num_requests=args.requests,
        max_batch_size=args.batch,
        max_seq_len=args.max_seq_len,
        page_size=args.page_size,
        layout=args.layout,
        budget=args.budget,
        trace=args.trace,
        seed=args.seed,
    )
    cfg = result["config"]
    print(
        f"\nvattention demo: {cfg.num_layers} layers, {cfg.num_kv_heads} KV heads x "
        f"{cfg.head_dim}, {str(cfg.dtype).replace('torch.', '')}, layout={cfg.layout}, "
        f"trace={args.trace} (lengths / 4)\n"
    )
    print(format_table(result))
    return 0
