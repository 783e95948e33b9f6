"""CPU attention over vattention caches: the native kernel against memory bandwidth, torch SDPA and
vLLM's CPU attention op, measured in one process.

Decode rows: 16 requests x 4096 cached tokens, 8 KV heads x 128, GQA groups 1 and 4, float32 and
bfloat16, one query token each, caches in a vattention ``KVCache`` (layer layout, 2 MB pages).

* **K/V read rate**: bytes of the K and V rows the call must read (16 x 4096 x 8 x 128 x 2 x
  element size) per second of the kernel call (``flash_attn_with_kvcache``, append included: one
  token per request). Decode attention reads each byte once, so this rate is bounded by memory
  bandwidth.
* **Memory bandwidth, same process, same threads**, over buffers of the same total size:
  ``copy``: ``dst.copy_(src)``, counted as read + write bytes (the STREAM "copy" convention: the
  bytes that cross the memory bus, as the target "80% of a streaming copy" is stated); ``read``:
  ``src.sum()``, read bytes only (a read-only stream, the closer physical limit of attention,
  which writes almost nothing). Both are printed; the ratio columns divide the K/V read rate by
  each.
* **SDPA per row**: ``flash_attn_with_kvcache_reference`` (a Python loop, one torch SDPA call per
  request), the path vattention's CPU integrations used before this kernel.
* **vLLM op** (only when run with vLLM 0.32's venv: ``.venv-vllm/bin/python
  benchmarks/bench_attention.py``): ``torch.ops._C.cpu_attention_with_kv_cache``, the op vLLM's
  CPU_ATTN backend calls (``vllm/v1/attention/backends/cpu_attn.py``), with the ISA that backend
  picks on this CPU (its ``_get_attn_isa``: ``amx`` for bf16 on a CPU with AMX tiles, else
  ``vec``; printed in each row), on the same K/V data written into its paged layout ([blocks,
  kv_heads, block_size, head_dim], 128-token blocks) by its own ``cpu_attn_reshape_and_cache``
  for that ISA, with its scheduler metadata; it does not append (vLLM
  writes K/V in a separate op), so it reads the same bytes minus one token per request.
* **Same strides, ordinary memory**: the native kernel over ``torch.empty_strided`` tensors with
  the cache tensors' shape and strides: the cost of virtual memory itself (target 1.00 +- 0.03).

Prefill rows: one request, a causal prompt of 2048 tokens (no past) and a chunk of 512 tokens after
1536 cached (chunked prefill), GQA 1, 4 and 8 over 8 KV heads x 128 and the two preset shapes
(Llama-3.2-1B's 32 / 8 x 64, Qwen2.5-0.5B's 14 / 2 x 64), float32 and bfloat16: the kernel
against vLLM's op (same K/V in its paged layout, query_start_loc / seq_lens of the chunk; both
write into a preallocated output, ours through ``cpu_attention(..., out=)`` as the plugin calls
it) and torch SDPA with ``is_causal`` / ``causal_lower_right`` (GQA via ``enable_gqa``), K/V as
strided views of the cache row.

Batch rows: calls shaped as vLLM's scheduler makes them, where prompts are short and several share
a call: one prompt of 100 and of 300 tokens, 8 prompts of 25-410 tokens, a 400-token prompt beside
16 decodes, two 256-token chunks after 300 and 900 cached tokens; GQA 4 at 16 / 4 x 64 (``bench
vllm``'s gqa4 model) and Llama-3.2-1B's 32 / 8 x 64. Each side as its engine runs one layer: ours
through ``CpuAttentionPlan`` (the vLLM plugin's call: its new K/V appended in the call), vLLM's
write op (``cpu_attn_reshape_and_cache``) then its attention op, as its forward runs them.

Every figure is the min (and median) of interleaved rounds (A B B A ...) after a warm-up, with
outputs checked against the reference. Run on an idle machine; the load is printed.

    python benchmarks/bench_attention.py [--threads 2] [--rounds 6] [--skip-decode]
        [--skip-prefill] [--skip-batches] [--isa avx512bf16,avx2]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import vattention  # noqa: E402
from vattention import _C  # noqa: E402
from vattention.attention import (  # noqa: E402
    CpuAttentionBatch,
    CpuAttentionPlan,
    cpu_attention,
    reference_attention,
)
from vattention.integrations import flash_attn as fa  # noqa: E402

from _timing import compare_min_median  # noqa: E402

N, S, HKV, D = 16, 4096, 8, 128


def vllm_ops():
    try:
        import vllm._custom_ops as ops  # noqa: F401
    except Exception as exc:  # not the vLLM venv
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
    # vLLM's amx op uses the tiles without asking the OS for them (in its engine oneDNN's bf16
    # matmuls have asked before attention runs): a process whose first tile instruction is that
    # op's dies of SIGILL unless it asks first.
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
    return ops, ""


def vllm_isa(dtype, head_dim, block_size=128):
    """The ISA vLLM's CPU_ATTN backend picks for its op on this CPU (its own ``_get_attn_isa``:
    ``amx`` for bf16 where torch sees AMX tiles, else ``vec`` on x86 for these shapes)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim)


def vllm_paged(ops, k, v, block_size=128):
    """k, v [tokens, kv_heads, d] (tokens a multiple of block_size) written into vLLM's CPU layout
    ([blocks, kv_heads, block_size, d] for K and for V, packed as its ISA reads them) by its own
    ``cpu_attn_reshape_and_cache``; returns (key_cache, value_cache), block i holding tokens
    [i * block_size, ...)."""
    tokens, hkv, d = k.shape
    kv = torch.zeros(tokens // block_size, hkv, 2 * block_size, d, dtype=k.dtype)
    key_cache, value_cache = kv.chunk(2, dim=2)
    vllm_write(ops, k.contiguous(), v.contiguous(), key_cache, value_cache, torch.arange(tokens))
    return key_cache, value_cache


def vllm_write(ops, k, v, key_cache, value_cache, slots):
    """vLLM's K/V write op as its CPU backend's forward runs it: rows k, v [tokens, kv_heads, d]
    to cache slots ``slots`` (block * block_size + offset) of vllm_paged's layout, packed for the
    ISA its backend picks."""
    isa = vllm_isa(k.dtype, k.shape[2], key_cache.shape[2])
    ops.cpu_attn_reshape_and_cache(
        k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )


def vllm_call(ops, q, key_cache, value_cache, block_table, qsl, seq_lens):
    """A call of vLLM's CPU attention op (what CPU_ATTN's forward runs): q [tokens, heads, d] of
    requests at query_start_loc qsl, each attending causally to seq_lens keys of its block table
    (a prompt's chunk after cached tokens when seq_lens exceeds its query count)."""
    hkv, d = key_cache.shape[1], key_cache.shape[3]
    isa = vllm_isa(q.dtype, d, key_cache.shape[2])
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.numel(),
        num_heads=q.shape[1],
        num_kv_heads=hkv,
        head_dim=d,
        seq_lens=seq_lens,
        dtype=q.dtype,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    out = torch.empty_like(q)

    def call():
        ops.cpu_attention_with_kv_cache(
            query=q,
            key_cache=key_cache,
            value_cache=value_cache,
            output=out,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            scale=d**-0.5,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=block_table,
            softcap=0.0,
            scheduler_metadata=meta,
            s_aux=None,
        )
        return out

    return call


def vllm_decode(ops, k_rows, v_rows, q, block_size=128):
    """A call of vLLM's CPU attention op on k_rows/v_rows [N, S, HKV, D] copied into its layout."""
    n, s, hkv, d = k_rows.shape
    key_cache, value_cache = vllm_paged(
        ops, k_rows.reshape(n * s, hkv, d), v_rows.reshape(n * s, hkv, d), block_size
    )
    block_table = torch.arange(n * s // block_size, dtype=torch.int32).view(n, s // block_size)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    seq_lens = torch.full((n,), s, dtype=torch.int32)
    return vllm_call(ops, q, key_cache, value_cache, block_table, qsl, seq_lens)


def vllm_prefill(ops, q, k_rows, v_rows, block_size=128):
    """A call of vLLM's CPU attention op for one request's causal chunk, q [chunk, heads, d], over
    k_rows/v_rows [total, kv_heads, d] (the chunk's own keys last; total a multiple of
    block_size) copied into its layout."""
    total, chunk = k_rows.shape[0], q.shape[0]
    key_cache, value_cache = vllm_paged(ops, k_rows, v_rows, block_size)
    return vllm_call(
        ops,
        q.contiguous(),
        key_cache,
        value_cache,
        torch.arange(total // block_size, dtype=torch.int32)[None],
        torch.tensor([0, chunk], dtype=torch.int32),
        torch.tensor([total], dtype=torch.int32),
    )


def fmt(t, digits=1):
    return f"{t[0] * 1e3:.{digits}f} ({t[1] * 1e3:.{digits}f})"


def measure_decode(
    dtype, groups, *, rounds, calls, rows=N, tokens=S, kv_heads=HKV, head_dim=D, ops=None, full=True
):
    """Decode calls of the native kernel over a vattention cache (``rows`` requests x ``tokens``
    cached, one query token each, its K/V appended in the call) timed in interleaved rounds beside
    a streaming copy and a read of as many bytes as the call's K and V rows; yields one dict per
    GQA group of ``groups``: ``t`` (name -> (min, median) seconds per call), ``kv`` (the K/V read
    rate, bytes/s, from the min), ``copy`` (read + write bytes/s) and ``read`` (bytes/s).

    The kernel's output is first checked against torch SDPA per row (AssertionError beyond the
    dtype's tolerance) and against the same call over ordinary memory of the same strides (equal).
    ``full``: also time those two (``sdpa``, ``ordinary``); ``ops``: also vLLM's op (``vllm``).
    """
    cfg = vattention.KVCacheConfig(
        num_layers=1,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_batch_size=rows,
        max_seq_len=tokens + 1,
        dtype=dtype,
        page_size="2MB",
    )
    with vattention.KVCache(cfg) as cache:
        slots = [cache.alloc() for _ in range(rows)]
        cache.step({s: tokens + 1 for s in slots})
        k_cache, v_cache = cache.layer(0)
        gen = torch.Generator().manual_seed(0)
        for s in slots:
            k_cache[s, :tokens] = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[s, :tokens] = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
        k_ord = torch.empty_strided(k_cache.shape, k_cache.stride(), dtype=dtype)
        v_ord = torch.empty_strided(v_cache.shape, v_cache.stride(), dtype=dtype)
        for s in slots:
            k_ord[s, : tokens + 1] = k_cache[s, : tokens + 1]
            v_ord[s, : tokens + 1] = v_cache[s, : tokens + 1]
        nbytes = 2 * rows * tokens * kv_heads * head_dim * k_cache.element_size()
        src = torch.randn(nbytes // 4)
        dst = torch.empty_like(src)
        idx = torch.tensor(slots, dtype=torch.int32)
        past = torch.full((rows,), tokens, dtype=torch.int32)
        for group in groups:
            q = torch.randn(rows, 1, kv_heads * group, head_dim, generator=gen).to(dtype)
            k_new = torch.randn(rows, 1, kv_heads, head_dim, generator=gen).to(dtype)
            v_new = torch.randn(rows, 1, kv_heads, head_dim, generator=gen).to(dtype)
            call = dict(k=k_new, v=v_new, cache_seqlens=past, cache_batch_idx=idx, causal=True)

            def kernel(kc=k_cache, vc=v_cache, q=q, call=call):
                return fa.flash_attn_with_kvcache(q, kc, vc, **call)

            def sdpa(q=q, call=call):
                return fa.flash_attn_with_kvcache_reference(q, k_cache, v_cache, **call)

            got, want = kernel(), sdpa()
            tol = 2e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            assert torch.equal(kernel(k_ord, v_ord), got)
            cands = {"kernel": kernel, "copy": lambda: dst.copy_(src), "read": src.sum}
            if full:
                cands.update(sdpa=sdpa, ordinary=lambda kernel=kernel: kernel(k_ord, v_ord))
            if ops:
                k_rows = torch.stack([k_cache[s, :tokens] for s in slots])
                v_rows = torch.stack([v_cache[s, :tokens] for s in slots])
                vllm = vllm_decode(ops, k_rows, v_rows, q[:, 0].contiguous())
                ref = fa.flash_attn_with_kvcache(
                    q, k_rows, v_rows, cache_seqlens=tokens, causal=True
                )
                torch.testing.assert_close(vllm().float(), ref[:, 0].float(), atol=tol, rtol=tol)
                cands["vllm"] = vllm
            t = compare_min_median(cands, calls=calls, rounds=rounds)
            yield {
                "dtype": dtype,
                "group": group,
                "t": t,
                "kv": nbytes / t["kernel"][0],
                "copy": 2 * nbytes / t["copy"][0],
                "read": nbytes / t["read"][0],
            }


def decode_rows(args, ops, why_no_vllm):
    print(f"### Decode: {N} requests x {S} tokens, {HKV} KV heads x {D}, one query each\n")
    print(
        "K/V rate: K+V bytes the call reads per second (min-time figure). Bandwidth of the same "
        "buffer size, same threads: copy = read+write bytes/s, read = sum() bytes/s.\n"
    )
    vcol = "vLLM op ms" if ops else "vLLM op"
    print(
        f"| dtype | GQA | kernel ms min (median) | K/V GB/s | copy GB/s | read GB/s | "
        f"K/V / copy | K/V / read | SDPA per row ms | kernel vs SDPA | {vcol} | vLLM ISA "
        f"| kernel vs vLLM | same strides, ordinary memory ms | virtual / ordinary |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for r in measure_decode(dtype, (1, 4), rounds=args.rounds, calls=args.calls, ops=ops):
            t, kv, copy, read = r["t"], r["kv"], r["copy"], r["read"]
            vllm_cell, vllm_ratio, isa = why_no_vllm or "not run", "-", "-"
            if ops:
                vllm_cell = fmt(t["vllm"])
                vllm_ratio = f"{t['vllm'][0] / t['kernel'][0]:.2f}x"
                isa = vllm_isa(dtype, D)
            print(
                f"| {str(dtype)[6:]} | {r['group']} | {fmt(t['kernel'])} | {kv / 1e9:.1f} | "
                f"{copy / 1e9:.1f} | {read / 1e9:.1f} | {kv / copy:.2f} | {kv / read:.2f} | "
                f"{fmt(t['sdpa'])} | {t['sdpa'][0] / t['kernel'][0]:.1f}x | {vllm_cell} | "
                f"{isa} | {vllm_ratio} | {fmt(t['ordinary'])} | "
                f"{t['kernel'][0] / t['ordinary'][0]:.3f} |"
            )
    print()


PREFILL_SHAPES = ((8, 8, 128), (32, 8, 128), (64, 8, 128), (32, 8, 64), (14, 2, 64))
PREFILL_CHUNKS = ((2048, 0), (512, 1536))


def measure_prefill(dtype, heads, hkv, d, chunk, past, *, rounds, ops=None):
    """One request's causal prefill of ``chunk`` queries after ``past`` cached tokens (heads /
    hkv x d): the native kernel against torch SDPA (``is_causal`` or ``causal_lower_right``, GQA
    via ``enable_gqa``) and, with ``ops``, vLLM's op on the same K/V in its paged layout, timed in
    interleaved rounds. The kernel's output is first checked against SDPA's and vLLM's
    (AssertionError beyond the dtype's tolerance). Returns (name -> (min, median) seconds per
    call, FLOPs of the call: 4 d per (query head, visible key))."""
    from torch.nn.attention.bias import causal_lower_right

    total = past + chunk
    gen = torch.Generator().manual_seed(1)
    kc = torch.randn(1, total + 16, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(1, total + 16, hkv, d, generator=gen).to(dtype)
    q = torch.randn(1, chunk, heads, d, generator=gen).to(dtype)
    out = torch.empty_like(q)  # the plugin's call: vLLM's output buffer, as vLLM's op

    def kernel():
        return cpu_attention(q, kc, vc, cache_seqlens=total, causal=True, out=out)

    qh = q[0].transpose(0, 1)[None]
    kh = kc[0, :total].transpose(0, 1)[None]
    vh = vc[0, :total].transpose(0, 1)[None]
    mask = None if past == 0 else causal_lower_right(chunk, total)

    def sdpa():
        return F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, is_causal=past == 0, enable_gqa=True
        )

    tol = 2e-5 if dtype == torch.float32 else 2e-2
    got = kernel()[0]
    torch.testing.assert_close(got.float(), sdpa()[0].transpose(0, 1).float(), atol=tol, rtol=tol)
    cands = {"kernel": kernel, "sdpa": sdpa}
    if ops:
        call = vllm_prefill(ops, q[0], kc[0, :total], vc[0, :total])
        torch.testing.assert_close(call().float(), got.float(), atol=tol, rtol=tol)
        cands["vllm"] = call
    t = compare_min_median(cands, calls=1, rounds=rounds)
    return t, 4 * d * heads * (chunk * past + chunk * (chunk + 1) / 2)


def prefill_rows(args, ops, why_no_vllm):
    print("### Prefill: one request, causal; a whole prompt, or a chunk after cached tokens\n")
    print(
        "Shapes: query heads / KV heads x head_dim (GQA 1, 4 and 8 at 8 KV heads x 128; "
        "Llama-3.2-1B's 32 / 8 x 64; Qwen2.5-0.5B's 14 / 2 x 64). GFLOP/s: 4 d FLOPs per "
        "(query head, visible key) over the kernel's min time. torch SDPA: oneDNN's flash "
        "attention (AMX tiles for bf16 where the CPU has them), the AMX-rate reference.\n"
    )
    vcol = "vLLM op ms" if ops else "vLLM op"
    print(
        f"| dtype | heads / KV x d | chunk | cached before | kernel ms min (median) | {vcol} "
        "| vLLM ISA | kernel vs vLLM | torch SDPA ms | kernel vs SDPA | kernel GFLOP/s |"
    )
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for heads, hkv, d in PREFILL_SHAPES:
            for chunk, past in PREFILL_CHUNKS:
                t, flops = measure_prefill(
                    dtype, heads, hkv, d, chunk, past, rounds=args.rounds, ops=ops
                )
                vllm_cell, vllm_ratio, isa = why_no_vllm or "not run", "-", "-"
                if ops:
                    vllm_cell = fmt(t["vllm"])
                    vllm_ratio = f"{t['vllm'][0] / t['kernel'][0]:.2f}x"
                    isa = vllm_isa(dtype, d)
                print(
                    f"| {str(dtype)[6:]} | {heads} / {hkv} x {d} | {chunk} | {past} | "
                    f"{fmt(t['kernel'])} | {vllm_cell} | {isa} | {vllm_ratio} | {fmt(t['sdpa'])} | "
                    f"{t['sdpa'][0] / t['kernel'][0]:.2f}x | "
                    f"{flops / t['kernel'][0] / 1e9:.0f} |"
                )
    print()


BATCH_SHAPES = ((16, 4, 64), (32, 8, 64))
# (label, prompt or chunk length per request, tokens cached before it)
BATCHES = (
    ("one prompt", (100,), (0,)),
    ("one prompt", (300,), (0,)),
    ("8 prompts", (37, 220, 80, 410, 150, 60, 300, 25), (0,) * 8),
    ("a prompt + 16 decodes", (400,) + (1,) * 16, (0,) + tuple(300 + 37 * i for i in range(16))),
    ("2 chunks", (256, 256), (300, 900)),
)


def measure_batch(dtype, heads, hkv, d, lens, past, *, rounds, calls, ops=None, block_size=128):
    """One varlen call of requests with ``lens`` new tokens after ``past`` cached, causal: ours
    through CpuAttentionPlan with the new K/V appended in the call (the plugin's call), and with
    ``ops`` vLLM's forward for the same batch (its K/V write op, then its attention op, same K/V
    in its paged layout), timed in interleaved rounds after checking the outputs against the
    float64 reference and each other (AssertionError beyond the dtype's tolerance). Returns
    name -> (min, median) seconds per call."""
    n = len(lens)
    total = [a + b for a, b in zip(lens, past)]
    cap = max((t + block_size - 1) // block_size * block_size for t in total)
    gen = torch.Generator().manual_seed(2)
    kc = torch.randn(n, cap, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(n, cap, hkv, d, generator=gen).to(dtype)
    q = torch.randn(sum(lens), heads, d, generator=gen).to(dtype)
    # the new tokens' K/V: what the caches hold at their positions
    k_new = torch.cat([kc[i, past[i] : total[i]] for i in range(n)])
    v_new = torch.cat([vc[i, past[i] : total[i]] for i in range(n)])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(past, dtype=torch.int32)
    plan = CpuAttentionPlan(kc, vc, heads, dtype=dtype, causal=True)
    batch = CpuAttentionBatch(cu, seq)
    out = torch.empty_like(q)

    def kernel():
        return plan(q, k_new, v_new, batch, out)

    cands = {"kernel": kernel}
    got = kernel().clone()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    want = reference_attention(
        q.double(),
        kc.clone(),
        vc.clone(),
        k_new,
        v_new,
        cache_seqlens=seq,
        cu_seqlens_q=cu,
        causal=True,
    )
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    if ops:
        key_cache, value_cache = vllm_paged(
            ops, kc.reshape(-1, hkv, d), vc.reshape(-1, hkv, d), block_size
        )
        blocks = cap // block_size
        slots = torch.cat([i * cap + torch.arange(past[i], total[i]) for i in range(n)])
        block_table = torch.arange(n * blocks, dtype=torch.int32).view(n, blocks)
        attend = vllm_call(
            ops, q, key_cache, value_cache, block_table, cu, torch.tensor(total, dtype=torch.int32)
        )

        def vllm():
            vllm_write(ops, k_new, v_new, key_cache, value_cache, slots)
            return attend()

        torch.testing.assert_close(vllm().float(), got.float(), atol=tol, rtol=tol)
        cands["vllm"] = vllm
    return compare_min_median(cands, calls=calls, rounds=rounds)


def batch_rows(args, ops, why_no_vllm):
    print("### Batches: calls as vLLM's scheduler makes them (short prompts, chunks, decodes)\n")
    print(
        "Requests: new tokens (cached before): each call causal, one layer. Ours through "
        "CpuAttentionPlan, new K/V appended in the call; vLLM's write op then its attention op.\n"
    )
    vcol = "vLLM write + op ms" if ops else "vLLM op"
    print(
        f"| dtype | heads / KV x d | batch | requests | kernel ms min (median) | {vcol} "
        "| vLLM ISA | kernel vs vLLM |"
    )
    print("|---|---|---|---|---:|---:|---|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for heads, hkv, d in BATCH_SHAPES:
            for label, lens, past in BATCHES:
                t = measure_batch(
                    dtype, heads, hkv, d, lens, past, rounds=args.rounds, calls=args.calls, ops=ops
                )
                vllm_cell, vllm_ratio, isa = why_no_vllm or "not run", "-", "-"
                if ops:
                    vllm_cell = fmt(t["vllm"], 3)
                    vllm_ratio = f"{t['vllm'][0] / t['kernel'][0]:.2f}x"
                    isa = vllm_isa(dtype, d)
                reqs = ", ".join(
                    f"{a} ({b})" if b else str(a) for a, b in zip(lens[:3], past[:3])
                ) + (", ..." if len(lens) > 3 else "")
                print(
                    f"| {str(dtype)[6:]} | {heads} / {hkv} x {d} | {label} | {reqs} | "
                    f"{fmt(t['kernel'], 3)} | {vllm_cell} | {isa} | {vllm_ratio} |"
                )
    print()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--rounds", type=int, default=6, help="interleaved rounds (min and median over them)"
    )
    parser.add_argument("--calls", type=int, default=2, help="calls per timed sample")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-batches", action="store_true")
    parser.add_argument(
        "--isa",
        default="",
        help="comma-separated kernel instruction sets to run in turn (amx, avx512bf16, avx512, "
        "avx2, generic; default: the best this CPU runs); the tables name each",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops, why = vllm_ops()
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), kernel ISA {fa.kernel_isa()}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min) at start"
        + ("" if ops else f"; vLLM op not run ({why}): run with the vLLM venv")
        + "\n"
    )
    for isa in args.isa.split(",") if args.isa else [""]:
        if not _C.set_attention_kernel_isa(isa):
            print(f"## kernel ISA {isa}: this CPU cannot run it, skipped\n")
            continue
        print(f"## kernel ISA {fa.kernel_isa()}\n")
        if not args.skip_decode:
            decode_rows(args, ops, "" if ops else "n/a")
        if not args.skip_prefill:
            prefill_rows(args, ops, "" if ops else "n/a")
        if not args.skip_batches:
            batch_rows(args, ops, "" if ops else "n/a")
    _C.set_attention_kernel_isa("")
    load = os.getloadavg()
    print(f"load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
