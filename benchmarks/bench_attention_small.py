"""vattention's CPU attention kernel against vLLM's CPU attention op on the shapes a small engine
serves, where bench_attention.py's long rows are not the bottleneck: short decode rows that all
read one shared prefix (what prefix-cache hits give both engines), short private decode rows, and
prefill. Needs vLLM 0.32's venv:

    .venv-vllm/bin/python benchmarks/bench_attention_small.py

Both kernels run in this process on the same K/V values, fp32, over the same threads; vLLM's op
reads them from its own paged layout (128-token blocks, written by its `cpu_attn_reshape_and_cache`)
and attends over whole blocks only, so its rows are rounded down to a multiple of 128 tokens; the
"per token" column scales our time by that ratio. Our decode calls append no token (vLLM writes
K/V in a separate op). On the shared prefix ours also runs with the prefix hint (``prefix_groups``
/ ``prefix_lens``, what the vLLM plugin passes from its block tables): the prefix is then read once
per KV head for all rows. Our prefill writes into a preallocated output (``cpu_attention(...,
out=)``, the plugin's call into vLLM's output buffer), as vLLM's op does: a new 8-32 MB output per
call would add the kernel's page faults to ours alone. Both kernels are warmed up, then timed
alternately over six rounds; the tables print the min (median in brackets), and the outputs of
the two kernels are compared first (same values within 1e-4, on the tokens both read).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_attention import vllm_call, vllm_ops, vllm_paged  # noqa: E402

from vattention.attention import cpu_attention  # noqa: E402
from vattention.integrations import flash_attn as fa  # noqa: E402

from _timing import compare_min_median  # noqa: E402

BLOCK = 128


def compare(ours, theirs, calls: int, hinted=None):
    """(min, median) seconds per call of ours, theirs (and ours with the prefix hint): all warmed
    up, then alternated over six rounds of `calls` calls (_timing.compare_min_median)."""
    fns = {"ours": ours, "theirs": theirs, **({"hinted": hinted} if hinted else {})}
    t = compare_min_median(fns, calls=calls, rounds=6)
    return [t[k] for k in fns]


def check(a, b) -> None:
    if not torch.allclose(a, b, atol=1e-4, rtol=1e-4):
        raise SystemExit(f"outputs differ: max |ours - vLLM| = {(a - b).abs().max().item():.3g}")


def paged(ops, k, v):
    """k, v [tokens, kv_heads, d] written into vLLM's CPU layout; (key_cache, value_cache)."""
    return vllm_paged(ops, k, v, BLOCK)


def decode(ops, n, s, hkv, d, shared, calls):
    """n decode rows of s cached tokens; shared: every row reads the same memory."""
    rows = 1 if shared else n
    k = torch.randn(rows, s, hkv, d)
    v = torch.randn(rows, s, hkv, d)
    q = torch.randn(n, 1, hkv, d)
    k_cache = k.expand(n, -1, -1, -1) if shared else k
    v_cache = v.expand(n, -1, -1, -1) if shared else v
    lens = torch.full((n,), s, dtype=torch.int32)
    ours = lambda: fa.flash_attn_with_kvcache(  # noqa: E731
        q, k_cache, v_cache, cache_seqlens=lens, causal=True
    )
    hint = dict(
        prefix_groups=torch.zeros(n, dtype=torch.int32),
        prefix_lens=torch.full((n,), s // BLOCK * BLOCK, dtype=torch.int32),
    )
    hinted = (
        (
            lambda: fa.flash_attn_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=lens, causal=True, **hint
            )
        )
        if shared
        else None
    )
    sv = s // BLOCK * BLOCK
    kc, vc = paged(ops, k[:, :sv].reshape(-1, hkv, d), v[:, :sv].reshape(-1, hkv, d))
    per_row = sv // BLOCK
    table = torch.arange(rows * per_row, dtype=torch.int32).view(rows, per_row)
    table = table.expand(n, -1).contiguous() if shared else table
    theirs = vllm_call(
        ops,
        q[:, 0].contiguous(),
        kc,
        vc,
        table,
        torch.arange(n + 1, dtype=torch.int32),
        torch.full((n,), sv, dtype=torch.int32),
    )
    lens_v = torch.full((n,), sv, dtype=torch.int32)  # the tokens vLLM's op reads
    check(
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens_v, causal=True)[:, 0],
        theirs(),
    )
    if shared:
        check(hinted(), ours())
    return (*compare(ours, theirs, calls, hinted), sv)


def prefill(ops, s, heads, hkv, d, calls):
    """One causal prompt of s tokens (a multiple of 128), nothing cached before it."""
    q = torch.randn(s, heads, d)
    k = torch.randn(s, hkv, d)
    v = torch.randn(s, hkv, d)
    k_cache = torch.zeros(1, s, hkv, d)
    v_cache = torch.zeros_like(k_cache)
    cu = torch.tensor([0, s], dtype=torch.int32)
    past = torch.zeros(1, dtype=torch.int32)
    out = torch.empty_like(q)  # the plugin's call: into vLLM's output buffer, as vLLM's op
    ours = lambda: cpu_attention(  # noqa: E731
        q, k_cache, v_cache, k, v, cache_seqlens=past, cu_seqlens_q=cu, causal=True, out=out
    )
    kc, vc = paged(ops, k, v)
    theirs = vllm_call(
        ops,
        q,
        kc,
        vc,
        torch.arange(s // BLOCK, dtype=torch.int32)[None],
        cu,
        torch.tensor([s], dtype=torch.int32),
    )
    check(ours(), theirs())
    return compare(ours, theirs, calls)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    ops, why = vllm_ops()
    if ops is None:
        print(
            f"vLLM's CPU op is not available here ({why}): run with .venv-vllm/bin/python",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), kernel ISA "
        f"{fa.kernel_isa()}; load average {os.getloadavg()[0]:.2f} at start\n"
    )
    print(
        "| decode (fp32) | rows x tokens | KV heads x d | ours us | vLLM us (tokens) "
        "| ours / vLLM per token (min) | ours with the prefix hint us | hint / vLLM (min) |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for shared in (True, False):
        for n, s, hkv, d in ((16, 830, 4, 64), (16, 830, 8, 64), (16, 2048, 8, 64)):
            a, b, *h, sv = decode(ops, n, s, hkv, d, shared, calls=100)
            kind = "shared prefix" if shared else "private rows"
            hint = (
                f"{h[0][0] * 1e6:.0f} ({h[0][1] * 1e6:.0f}) | {h[0][0] / b[0] * sv / s:.2f}"
                if h
                else "- | -"
            )
            print(
                f"| {kind} | {n} x {s} | {hkv} x {d} | {a[0] * 1e6:.0f} ({a[1] * 1e6:.0f}) "
                f"| {b[0] * 1e6:.0f} ({b[1] * 1e6:.0f}) over {sv} | "
                f"{a[0] / b[0] * sv / s:.2f} | {hint} |"
            )
    print(
        "\n| prefill (fp32, causal) | tokens | heads / KV heads x d | ours ms | vLLM ms "
        "| ours / vLLM (min) |"
    )
    print("|---|---:|---|---:|---:|---:|")
    for s, heads, hkv, d in ((1024, 8, 8, 64), (2048, 32, 8, 128)):
        a, b = prefill(ops, s, heads, hkv, d, calls=5)
        print(
            f"| one prompt | {s} | {heads} / {hkv} x {d} | {a[0] * 1e3:.2f} ({a[1] * 1e3:.2f}) "
            f"| {b[0] * 1e3:.2f} ({b[1] * 1e3:.2f}) | {a[0] / b[0]:.2f} |"
        )
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
