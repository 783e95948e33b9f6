"""Two variants of the CPU attention kernel on the same calls, alternated in one process.

    python benchmarks/bench_attention_variants.py amx avx512bf16 [--threads 2] [--rounds 16]
        [--layers 1] [--page-size 2MB] [--dtype bfloat16]
        [--decode HEADS,KV_HEADS,D,ROWS,TOKENS ...] [--prefill HEADS,KV_HEADS,D,CHUNK,PAST ...]

A variant is a kernel instruction set, optionally with a tuning (``amx:intel`` against
``amx:other``: the software prefetches and fp32 decode's P V order of Intel's cores or of the
others, on the same instruction set; without one, this CPU's). ``--layers N`` gives each shape N
layers, called in turn as a model's are (times per layer call), so that K and V come from memory,
not from the CPU caches that one layer's loop keeps them in.

For each shape it builds one vattention cache of ``--dtype`` (bf16 by default; fp32 is what the
``small`` model of ``bench vllm`` runs) in pages of ``--page-size`` (the vLLM plugin's are one vLLM
block of one layer, 64 KB at the ``gqa4-bf16`` preset's 128 tokens x 4 x 64), checks that the two
variants' outputs agree within that dtype's tolerance (not bit for bit: their arithmetic may
differ),
then times them in rounds that switch the variant before every sample (A B B A ...), so that a
noisy machine's drift hits both alike. It prints each variant's fastest and median sample and
the median over rounds of B's time over A's: how many
times A's speed B's is, the figure to quote. Runs in separate processes, or whole tables one
variant after the other, moved by more than the differences this is for on the VMs it was made
on (docs/benchmarks.md).

Decode shapes: ROWS requests of TOKENS cached tokens, one query each. Prefill shapes: two
requests, each a causal chunk of CHUNK queries after PAST cached tokens (PAST 0: whole prompts).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import vattention
from vattention import _C
from vattention.attention import cpu_attention, kernel_isa, kernel_variants
from vattention.bench.machine import cpu_flags, cpu_name

DECODE = [
    "16,4,64,16,512",
    "16,4,64,16,2048",
    "16,8,64,16,1024",
    "32,8,128,16,1024",
    "32,4,128,8,2048",
]
PREFILL = ["16,4,80,256,512", "32,8,80,512,0"]


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# How far two variants' outputs may differ: a few units in the last place of the dtype's output
# (their sums and exponentials are ordered and approximated differently).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def calls(
    shape: str,
    prefill: bool,
    layers: int = 1,
    page_size: str = "2MB",
    dtype: torch.dtype = torch.bfloat16,
):
    """(the call, the cache to close) for one shape: a vattention cache of ``dtype`` filled at
    random, of ``layers`` layers that the call attends over in turn."""
    heads, kv_heads, d, a, b = (int(x) for x in shape.split(","))
    rows, tokens = (2, a + b) if prefill else (a, b)
    cfg = vattention.KVCacheConfig(
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=d,
        max_batch_size=rows,
        max_seq_len=tokens,
        dtype=dtype,
        page_size=page_size,
    )
    cache = vattention.KVCache(cfg)
    slots = [cache.alloc() for _ in range(rows)]
    cache.step({s: tokens for s in slots})
    gen = torch.Generator().manual_seed(0)
    kvs = [cache.layer(i) for i in range(layers)]
    for k, v in kvs:
        for s in slots:
            k[s, :tokens] = torch.randn(tokens, kv_heads, d, generator=gen).to(dtype)
            v[s, :tokens] = torch.randn(tokens, kv_heads, d, generator=gen).to(dtype)
    q = torch.randn(rows, a if prefill else 1, heads, d, generator=gen).to(dtype)
    outs = torch.empty(layers, *q.shape, dtype=q.dtype)  # every layer's output, compared
    kw = dict(
        cache_seqlens=torch.full((rows,), tokens, dtype=torch.int32),
        cache_batch_idx=torch.tensor(slots, dtype=torch.int32),
        causal=True,
    )

    def call():
        for (k, v), out in zip(kvs, outs):
            cpu_attention(q, k, v, out=out, **kw)
        return outs

    return call, cache


def select(variant: str) -> str:
    """Makes ``NAME[:TUNING]`` the kernel's instruction set and tuning ('': this CPU's); returns
    what the kernel then runs, as it reports it."""
    name, _, tuning = variant.partition(":")
    _C.set_attention_kernel_isa(name)
    _C.set_attention_kernel_tuning(tuning)
    return f"{kernel_isa()} tuned {_C.attention_kernel_tuning()}"


def compare(
    a: str, b: str, fn, rounds: int, per_sample: int, layers: int = 1
) -> dict[str, list[float]]:
    """Seconds per call of each sample of A and B. Like _timing.compare_min_median, but the
    variant is switched before every sample and warmed by an untimed call after the switch, and
    the samples are kept so that each round's ratio can be taken."""
    times: dict[str, list[float]] = {a: [], b: []}
    for r in range(rounds):
        for name in (a, b) if r % 2 == 0 else (b, a):
            select(name)
            fn()  # the first call after a switch warms that variant's code and scratch
            start = time.perf_counter()
            for _ in range(per_sample):
                fn()
            times[name].append((time.perf_counter() - start) / per_sample / layers)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("a", help="the variant measured (e.g. amx, or amx:intel)")
    parser.add_argument("b", help="the variant it is measured against (e.g. avx512bf16)")
    parser.add_argument(
        "--layers", type=int, default=1, help="layers called in turn (times are per layer call)"
    )
    parser.add_argument(
        "--page-size", default="2MB", help="the caches' pages (the vLLM plugin's: one block's)"
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="bfloat16", help="the caches' and queries'"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--calls", type=int, default=3, help="calls per timed sample")
    parser.add_argument("--decode", nargs="*", default=DECODE, metavar="H,HKV,D,ROWS,TOKENS")
    parser.add_argument("--prefill", nargs="*", default=PREFILL, metavar="H,HKV,D,CHUNK,PAST")
    args = parser.parse_args()
    runnable = {v.name for v in kernel_variants() if v.runnable}
    if args.a == args.b:
        parser.error(f"two different variants, not {args.a!r} twice")
    if args.layers < 1:
        parser.error(f"--layers {args.layers} must be >= 1")
    for variant in (args.a, args.b):
        name, _, tuning = variant.partition(":")
        if name not in runnable:
            parser.error(f"variant {name!r} does not run on this CPU (it runs {sorted(runnable)})")
        if tuning not in ("", "intel", "other"):
            parser.error(f"tuning {tuning!r} of {variant!r}: intel or other")
    dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.threads)
    isa = sorted(cpu_flags() & {"avx512_bf16", "amx_bf16", "amx_tile", "avx512f", "avx2"})
    load = os.getloadavg()
    print(
        f"{cpu_name()} ({', '.join(isa)}), {os.cpu_count()} CPUs, {args.threads} thread(s), "
        f"torch {torch.__version__}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at "
        f"start; {args.rounds} rounds of {args.calls} calls over {args.layers} layer(s) of "
        f"{args.dtype} in {args.page_size} pages, variants alternated"
    )
    print(f"{args.a}: {select(args.a)}; {args.b}: {select(args.b)}\n")
    print(
        f"| call | shape | {args.a} min / median | {args.b} min / median | "
        f"{args.a} / {args.b} speed |"
    )
    print("|---|---|---:|---:|---:|")
    try:
        for kind, shapes in (("decode", args.decode), ("prefill", args.prefill)):
            for shape in shapes:
                fn, cache = calls(shape, kind == "prefill", args.layers, args.page_size, dtype)
                with cache:
                    outs = []
                    for name in (args.a, args.b):
                        select(name)
                        outs.append(fn().float().clone())
                    tol = TOLERANCE[dtype]
                    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
                    t = compare(args.a, args.b, fn, args.rounds, args.calls, args.layers)
                ratio = statistics.median(tb / ta for ta, tb in zip(t[args.a], t[args.b]))
                ta, tb = (
                    f"{min(t[n]) * 1e3:.3f} / {statistics.median(t[n]) * 1e3:.3f} ms"
                    for n in (args.a, args.b)
                )
                print(f"| {kind} | {shape} | {ta} | {tb} | **{ratio:.2f}x** |", flush=True)
    finally:
        select("")
    load = os.getloadavg()
    print(f"\nload average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
