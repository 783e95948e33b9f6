"""Decode attention over every layer of a real model's shape, in vattention caches of both layouts
(`mega`: all layers of a token in one row; `layer`: one row per layer) and, with vLLM 0.32's
venv, vLLM's CPU op on its own paged layout:

    .venv-vllm/bin/python benchmarks/bench_attention_layouts.py
    .venv-vllm/bin/python benchmarks/bench_attention_layouts.py --model llama-3.2-1b --tokens 1024

What the vLLM plugin's decode-only steps do: `--rows` requests of `--tokens` cached tokens, one
query token each, the model's heads, KV heads, head_dim and dtype (`bench vllm`'s presets), one
call per layer, all layers in turn, so each layer's K/V comes from memory as in an engine's step
(the layers together are far larger than the L3 cache). Pages hold 128 tokens (vLLM's CPU block:
the plugin's page is one block); K/V are random. Each candidate is warmed up, then timed over
alternated rounds (A B C C B A ...); the table prints the time per layer, min (median), and each
against vLLM's op. Outputs are checked against vLLM's op first.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_attention import vllm_call, vllm_ops, vllm_paged  # noqa: E402

import vattention  # noqa: E402
from vattention.bench.model_presets import PRESETS  # noqa: E402
from vattention.integrations import flash_attn as fa  # noqa: E402

from _timing import compare_min_median  # noqa: E402

BLOCK = 128  # tokens per page: vLLM's CPU block


def cache_views(preset, layout: str, rows: int, tokens: int, dtype, gen):
    """A vattention cache of `layout` with `rows` rows of `tokens` random tokens; (cache, views)."""
    per_token = (preset.num_layers if layout == "mega" else 1) * preset.num_kv_heads
    page = BLOCK * per_token * preset.head_dim * dtype.itemsize
    cache = vattention.KVCache(
        vattention.KVCacheConfig(
            num_layers=preset.num_layers,
            num_kv_heads=preset.num_kv_heads,
            head_dim=preset.head_dim,
            max_batch_size=rows,
            max_seq_len=tokens + BLOCK,
            dtype=dtype,
            device="cpu",
            page_size=page,
            layout=layout,
        )
    )
    for _ in range(rows):
        cache.alloc()
    cache.step([tokens] * rows)
    views = []
    shape = (rows, tokens, preset.num_kv_heads, preset.head_dim)
    for i in range(preset.num_layers):
        k, v = cache.layer(i)
        k[:, :tokens].copy_(torch.randn(shape, generator=gen).to(dtype))
        v[:, :tokens].copy_(torch.randn(shape, generator=gen).to(dtype))
        views.append((k, v))
    return cache, views


def run_model(name: str, args, ops) -> None:
    preset = PRESETS[name]
    dtype = getattr(torch, preset.dtype)
    n, s, layers = args.rows, args.tokens, preset.num_layers
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, 1, preset.num_heads, preset.head_dim, generator=gen).to(dtype)
    lens = torch.full((n,), s, dtype=torch.int32)

    def ours(views):
        return lambda: [fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens) for k, v in views]

    caches, candidates, firsts = [], {}, {}
    for layout in ("mega", "layer"):
        cache, views = cache_views(preset, layout, n, s, dtype, gen)
        caches.append(cache)
        candidates[layout] = ours(views)
        firsts[layout] = views[0]
    if ops is not None:
        table = torch.arange(n * (s // BLOCK), dtype=torch.int32).view(n, s // BLOCK)
        qsl = torch.arange(n + 1, dtype=torch.int32)
        calls = []
        for i in range(layers):
            k, v = firsts["mega"] if i == 0 else (None, None)
            if k is None:
                shape = (n, s, preset.num_kv_heads, preset.head_dim)
                k = torch.randn(shape, generator=gen).to(dtype)
                v = torch.randn(shape, generator=gen).to(dtype)
            flat = (n * s, preset.num_kv_heads, preset.head_dim)
            kc, vc = vllm_paged(ops, k[:, :s].reshape(flat), v[:, :s].reshape(flat), BLOCK)
            calls.append(vllm_call(ops, q[:, 0].contiguous(), kc, vc, table, qsl, lens))
        # layer 0 of the mega cache holds the same K/V as vLLM's first layer
        k0, v0 = firsts["mega"]
        got = fa.flash_attn_with_kvcache(q, k0, v0, cache_seqlens=lens)[:, 0].float()
        err = (got - calls[0]().float()).abs().max().item()
        if err > 2e-2:
            raise SystemExit(f"{name}: outputs differ from vLLM's op by {err:.3g}")
        candidates["vLLM op"] = lambda: [c() for c in calls]
    t = compare_min_median(candidates, calls=args.calls, rounds=args.rounds)
    base = t["vLLM op"][0] if "vLLM op" in t else None
    for what, (mn, med) in t.items():
        ratio = f"{mn / base:.2f}" if base else "-"
        print(
            f"| {name} | {preset.num_heads} / {preset.num_kv_heads} x {preset.head_dim}, "
            f"{preset.dtype} | {what} | {mn / layers * 1e6:.0f} ({med / layers * 1e6:.0f}) "
            f"| {ratio} |"
        )
    del caches


def cpu_name() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        if found:
            return found.group(1).strip()
    except OSError:
        pass
    return platform.machine()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", choices=tuple(PRESETS))
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=5, help="passes over all layers per sample")
    args = p.parse_args(argv)
    if args.rows < 1 or args.tokens < BLOCK or args.tokens % BLOCK:
        p.error(f"--rows {args.rows} must be >= 1 and --tokens {args.tokens} a multiple of {BLOCK}")
    ops, why = vllm_ops()
    torch.set_num_threads(args.threads)
    print(
        f"{cpu_name()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, {args.threads} thread(s), kernel ISA {fa.kernel_isa()}; "
        f"{args.rows} rows x {args.tokens} tokens; vLLM op: {'yes' if ops else why}; "
        f"load average {os.getloadavg()[0]:.2f} at start\n"
    )
    print("| model | heads / KV heads x d | cache | us per layer, min (median) | / vLLM op |")
    print("|---|---|---|---:|---:|")
    for name in args.model or ("llama-3.2-1b", "qwen2.5-0.5b"):
        run_model(name, args, ops)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
