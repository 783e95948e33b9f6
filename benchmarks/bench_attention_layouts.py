"""Decode attention over every layer of a real model's shape, in vattention caches of both layouts
(`mega`: all layers of a token in one row; `layer`: one row per layer) and, with vLLM 0.32's
venv, vLLM's CPU op on its own paged layout:

    .venv-vllm/bin/python benchmarks/bench_attention_layouts.py
    .venv-vllm/bin/python benchmarks/bench_attention_layouts.py --model llama-3.2-1b --tokens 1024
    .venv-vllm/bin/python benchmarks/bench_attention_layouts.py --model-size small

What the vLLM plugin's decode-only steps do: `--rows` requests of `--tokens` cached tokens, one
query token each, the model's heads, KV heads, head_dim and dtype (`bench vllm`'s presets, or with
`--model-size` its random fp32 Llamas: `small` is GQA 1 in fp32), one
call per layer, all layers in turn, so each layer's K/V comes from memory as in an engine's step
(the layers together are far larger than the L3 cache). Pages hold 128 tokens (vLLM's CPU block:
the plugin's page is one block); K/V are random. Each candidate is warmed up, then timed over
alternated rounds (A B C C B A ...); the table prints the time per layer, min (median), and each
against vLLM's op. Every layer's outputs of the three are compared first (the same K/V in all).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_attention import vllm_call, vllm_ops, vllm_paged  # noqa: E402

import vattention  # noqa: E402
from vattention.bench.machine import cpu_name  # noqa: E402
from vattention.bench.model_presets import PRESETS, ModelPreset  # noqa: E402
from vattention.bench.vllm_bench import MODEL_SIZES, size_model  # noqa: E402
from vattention.integrations import flash_attn as fa  # noqa: E402

from _timing import compare_min_median  # noqa: E402

BLOCK = 128  # tokens per page: vLLM's CPU block


def cache_views(preset, layout: str, values, tokens: int, dtype):
    """A vattention cache of `layout` whose rows hold `values` (per layer (k, v), `tokens` each);
    (cache, per layer (k, v) views)."""
    rows = values[0][0].shape[0]
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
    for i, (kv, vv) in enumerate(values):
        k, v = cache.layer(i)
        k[:, :tokens].copy_(kv)
        v[:, :tokens].copy_(vv)
        views.append((k, v))
    return cache, views


def run_model(preset: ModelPreset, args, ops) -> None:
    name = preset.name
    dtype = getattr(torch, preset.dtype)
    n, s, layers = args.rows, args.tokens, preset.num_layers
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, 1, preset.num_heads, preset.head_dim, generator=gen).to(dtype)
    lens = torch.full((n,), s, dtype=torch.int32)

    def ours(views):
        return lambda: [fa.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens) for k, v in views]

    shape = (n, s, preset.num_kv_heads, preset.head_dim)
    values = [
        (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
        for _ in range(layers)
    ]
    caches, candidates, outputs = [], {}, {}
    for layout in ("mega", "layer"):
        cache, views = cache_views(preset, layout, values, s, dtype)
        caches.append(cache)
        candidates[layout] = ours(views)
        outputs[layout] = candidates[layout]()
    if ops is not None:
        table = torch.arange(n * (s // BLOCK), dtype=torch.int32).view(n, s // BLOCK)
        qsl = torch.arange(n + 1, dtype=torch.int32)
        flat = (n * s, preset.num_kv_heads, preset.head_dim)
        calls = []
        for k, v in values:
            kc, vc = vllm_paged(ops, k.reshape(flat), v.reshape(flat), BLOCK)
            calls.append(vllm_call(ops, q[:, 0].contiguous(), kc, vc, table, qsl, lens))
        candidates["vLLM op"] = lambda: [c() for c in calls]
        outputs["vLLM op"] = [o.unsqueeze(1) for o in candidates["vLLM op"]()]
    # every layer's output of each candidate against the first's (same K/V everywhere)
    first = next(iter(outputs.values()))
    for what, outs in outputs.items():
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs, first))
        if err > 2e-2:
            raise SystemExit(f"{name}: {what}'s outputs differ from the others' by {err:.3g}")
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", choices=tuple(PRESETS))
    p.add_argument(
        "--model-size",
        action="append",
        choices=tuple(MODEL_SIZES),
        help="bench vllm's random Llama of this size (fp32)",
    )
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=5, help="passes over all layers per sample")
    args = p.parse_args(argv)
    if args.rows < 1 or args.tokens < BLOCK or args.tokens % BLOCK:
        p.error(f"--rows {args.rows} must be >= 1 and --tokens {args.tokens} a multiple of {BLOCK}")
    if args.rounds < 2 or args.calls < 1:  # alternation needs two rounds at least (A B, B A)
        p.error(f"--rounds {args.rounds} must be >= 2 and --calls {args.calls} >= 1")
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
    models = [PRESETS[m] for m in args.model or ()] + [size_model(m) for m in args.model_size or ()]
    for preset in models or [PRESETS["llama-3.2-1b"], PRESETS["qwen2.5-0.5b"]]:
        run_model(preset, args, ops)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
