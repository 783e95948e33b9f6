"""What one layer's attention call costs around its kernel, as an engine makes it: a decode step's
call through ``CpuAttentionPlan`` (checked once per layer and step), through ``cpu_attention``
(every argument checked at every call), through the native entry with every argument prepared
(the floor), and, in the vLLM venv, stock vLLM's CPU_ATTN path (its K/V write op, then its
attention op, with its forward's tensor views).

    .venv-vllm/bin/python benchmarks/bench_attention_call.py
    .venv-vllm/bin/python benchmarks/bench_attention_call.py --dtype float32 --heads 8 \\
        --kv-heads 8 --rows 16 --past 32

Each call appends one token to each of ``--rows`` requests that hold ``--past`` tokens, so the
kernel's own work is small and the call's overhead shows. Two settings: ``hot``, calls back to
back, and ``evicted``, where before each call a layer's worth of other work runs untimed (a bf16
matmul of the rows against 16 MB of weights and a Python pass over a 20,000-entry dict): in an
engine each layer's attention call follows its matmuls, which evict the interpreter's code and
data, and a call's Python then costs several times what a loop shows. Candidates alternate in
rounds (A B C D, D C B A, ...); each round's sample is the median of ``--calls`` timed calls; the
table gives the min (median) over ``--rounds`` rounds and each candidate's time over the plan's.
The outputs of the candidates are compared first (equal bit for bit for ours; vLLM's within
1e-2 in bf16, 1e-5 in fp32).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_attention import vllm_isa, vllm_ops  # noqa: E402

from vattention import _C  # noqa: E402
from vattention.attention import (  # noqa: E402
    CpuAttentionBatch,
    CpuAttentionPlan,
    cpu_attention,
    kernel_isa,
)
from vattention.attention.kernel import _CACHE_CODES, _QUERY_CODES, _operand  # noqa: E402
from vattention.bench.machine import cpu_flags, cpu_name  # noqa: E402

BLOCK = 128  # vLLM's CPU block size for these calls
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class Step:
    """One decode step's tensors: q, new K / V as views of a fused qkv projection (as vLLM hands
    them), the output buffer, and the requests' lengths and rows."""

    def __init__(self, args, dtype):
        n, h, hkv, d = args.rows, args.heads, args.kv_heads, args.head_dim
        self.n, self.h, self.hkv, self.d, self.dtype = n, h, hkv, d, dtype
        self.seq = (args.past + 1 + BLOCK - 1) // BLOCK * BLOCK
        gen = torch.Generator().manual_seed(0)
        qkv = torch.randn(n, (h + 2 * hkv) * d, generator=gen).to(dtype)
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        self.q, self.k, self.v = q.view(n, h, d), k.view(n, hkv, d), v.view(n, hkv, d)
        self.out = torch.empty(n, h * d, dtype=dtype)
        self.past = torch.full((n,), args.past, dtype=torch.int32)
        self.rows = torch.arange(n, dtype=torch.int32)
        self.cu = torch.arange(n + 1, dtype=torch.int32)
        self.k_cache = torch.randn(n, self.seq, hkv, d, generator=gen).to(dtype)
        self.v_cache = torch.randn(n, self.seq, hkv, d, generator=gen).to(dtype)


def ours(step: Step):
    """(plan, cpu_attention, native) calls over the same caches and step."""
    scale = step.d**-0.5
    plan = CpuAttentionPlan(step.k_cache, step.v_cache, step.h, softmax_scale=scale, causal=True)
    batch = CpuAttentionBatch(step.cu, step.past, step.rows)
    out = step.out.view(step.q.shape)

    def planned():
        plan(step.q, step.k, step.v, batch, out)

    def generic():
        cpu_attention(
            step.q,
            step.k_cache,
            step.v_cache,
            step.k,
            step.v,
            cache_seqlens=step.past,
            cache_batch_idx=step.rows,
            cu_seqlens_q=step.cu,
            softmax_scale=scale,
            causal=True,
            window_size=(-1, -1),
            out=out,
        )

    prepared = dict(
        num_requests=step.n,
        num_heads=step.h,
        num_kv_heads=step.hkv,
        head_dim=step.d,
        dtype=_QUERY_CODES[step.dtype],
        cache_dtype=_CACHE_CODES[step.dtype],
        q=_operand(step.q, True),
        out=_operand(out, True),
        k_new=_operand(step.k, True),
        v_new=_operand(step.v, True),
        k_cache=_operand(step.k_cache, False),
        v_cache=_operand(step.v_cache, False),
        cu_seqlens_q=step.cu.data_ptr(),
        seqlen_q=0,
        q_tokens=step.n,
        seqlen_new=0,
        cache_batch=step.n,
        cache_len=step.seq,
        cache_seqlens=step.past.data_ptr(),
        cache_batch_idx=step.rows.data_ptr(),
        softmax_scale=scale,
        causal=True,
        window_left=-1,
        window_right=-1,
        k_descale=1.0,
        v_descale=1.0,
        num_threads=torch.get_num_threads(),
    )

    def native():
        _C.flash_attn_with_kvcache(**prepared)

    return planned, generic, native


def stock(step: Step, ops):
    """vLLM's CPU_ATTN forward for the same step: its K/V write op into its paged cache, then its
    attention op (the tensor views its forward makes included)."""
    blocks = step.seq // BLOCK
    kv = torch.zeros(step.n * blocks, step.hkv, 2 * BLOCK, step.d, dtype=step.dtype)
    isa = vllm_isa(step.dtype, step.d, BLOCK)
    key_cache, value_cache = kv.chunk(2, dim=2)
    tokens = torch.arange(step.n * blocks * BLOCK)
    ops.cpu_attn_reshape_and_cache(
        step.k_cache.reshape(-1, step.hkv, step.d),
        step.v_cache.reshape(-1, step.hkv, step.d),
        key_cache,
        value_cache,
        tokens,
        isa,
    )
    kv = kv.view(step.n * blocks, step.hkv, BLOCK, 2 * step.d)  # the engine's cache tensor
    block_table = torch.arange(step.n * blocks, dtype=torch.int32).view(step.n, blocks)
    seq_lens = step.past + 1
    slots = (torch.arange(step.n) * step.seq + step.past.long()).to(torch.int64)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=step.n,
        num_heads=step.h,
        num_kv_heads=step.hkv,
        head_dim=step.d,
        seq_lens=seq_lens,
        dtype=step.dtype,
        query_start_loc=step.cu,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    out = step.out.view(step.q.shape)

    def views():
        num_blocks, num_kv_heads, block_size, _ = kv.size()
        return kv.view((num_blocks, num_kv_heads, block_size * 2, -1)).chunk(2, dim=2)

    def call():
        key_cache, value_cache = views()  # do_kv_cache_update
        ops.cpu_attn_reshape_and_cache(
            step.k,
            step.v,
            key_cache,
            value_cache,
            slots,
            isa,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )
        key_cache, value_cache = views()  # forward
        ops.cpu_attention_with_kv_cache(
            query=step.q[: step.n],
            key_cache=key_cache,
            value_cache=value_cache,
            output=out[: step.n],
            query_start_loc=step.cu,
            seq_lens=seq_lens,
            scale=step.d**-0.5,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=block_table,
            softcap=0.0,
            scheduler_metadata=meta,
            s_aux=None,
            dynamic_causal=None,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )

    return call


def evictor(step: Step):
    """A layer's worth of other work, untimed, before each call."""
    weights = torch.randn(1024, 8192).to(torch.bfloat16)
    x = torch.randn(step.n, 1024).to(torch.bfloat16)
    entries = {i: str(i) for i in range(20000)}

    def evict():
        torch.matmul(x, weights)
        total = 0
        for key in entries:
            total += len(entries[key])

    return evict


def timed(fn, before, calls: int) -> float:
    samples = []
    for _ in range(calls):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--past", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=200, help="timed calls per sample")
    args = p.parse_args(argv)
    for name in ("heads", "kv_heads", "head_dim", "rows", "threads", "rounds", "calls"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.past < 0 or args.heads % args.kv_heads:
        p.error(
            f"--past ({args.past}) must be >= 0 and --heads ({args.heads}) a multiple of "
            f"--kv-heads ({args.kv_heads})"
        )
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    ops, why = vllm_ops()
    load = os.getloadavg()
    amx = "amx" if {"amx_tile", "amx_bf16"} <= cpu_flags() else "no AMX"
    print(
        f"{cpu_name()} ({amx}), {os.cpu_count()} CPUs, {args.threads} thread(s), torch "
        f"{torch.__version__}, kernel ISA {kernel_isa()}; load average {load[0]:.2f} "
        f"{load[1]:.2f} {load[2]:.2f} (1/5/15 min) at start"
        + ("" if ops else f"; vLLM's path not run ({why}): run with the vLLM venv")
    )
    print(
        f"decode step: {args.rows} rows x {args.past} cached tokens + 1, {args.heads} / "
        f"{args.kv_heads} heads x {args.head_dim}, {args.dtype}\n"
    )
    step = Step(args, dtype)
    planned, generic, native = ours(step)
    candidates = {"CpuAttentionPlan": planned, "cpu_attention": generic, "native entry": native}
    if ops is not None:
        candidates["vLLM's write + attention ops"] = stock(step, ops)
    # Same arithmetic: each of ours writes the same output from the same caches (appending the
    # same token at the same position); vLLM's op reads its own copy of them.
    outputs = {}
    for name, fn in candidates.items():
        step.out.fill_(float("nan"))
        fn()
        outputs[name] = step.out.clone()
    base = outputs["CpuAttentionPlan"]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, got in outputs.items():
        same = (
            torch.equal(got, base)
            if name != "vLLM's write + attention ops"
            else (torch.allclose(got.float(), base.float(), atol=tol, rtol=tol))
        )
        if not same:
            print(f"{name}'s output differs from CpuAttentionPlan's")
            return 1
    evict = evictor(step)
    print(
        "| setting | "
        + " | ".join(f"{n} us" for n in candidates)
        + " | "
        + " | ".join(f"{n} / plan" for n in list(candidates)[1:])
        + " |"
    )
    print("|---|" + "---:|" * (2 * len(candidates) - 1))
    for setting, before in (("hot", None), ("evicted", evict)):
        names = list(candidates)
        samples = {n: [] for n in names}
        for r in range(args.rounds):
            for n in names if r % 2 == 0 else reversed(names):
                samples[n].append(timed(candidates[n], before, args.calls))
        cells = [f"{min(s) * 1e6:.1f} ({statistics.median(s) * 1e6:.1f})" for s in samples.values()]
        plan_min = min(samples["CpuAttentionPlan"])
        ratios = [f"{min(samples[n]) / plan_min:.2f}" for n in names[1:]]
        print(f"| {setting} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    load = os.getloadavg()
    print(f"\nload average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
