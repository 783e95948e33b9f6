"""vattention.attention's native CPU kernel (csrc/attention) against an exact oracle, on every
variant of the kernel this CPU runs.

``cpu_attention`` runs the kernel; the oracle is ``reference_attention`` in float64 on copies of
the same caches. The kernel's appends must equal the oracle's byte for byte, and every output
element must lie within the error bound derived from the kernel's arithmetic in
tests/support/attention_bound.py (inputs exact in their dtypes; fp32 dot products over head_dim,
base-2 softmax and fp32 sums over the keys; one rounding to q's dtype): the same bound on every
CPU and variant, nothing fitted on a machine. Tests that take the ``isa`` fixture
(tests/support/kernel_variants.py) run once per variant of the kernel (``amx``, ``avx512bf16``,
``avx512``, ``avx2``, ``generic``), skipped where this CPU (or, for ``amx``, its OS) cannot run
one; the session ends with
a line naming the variants that ran and those that could not. Every test whose result could
depend on the variant takes it, on 1 and 2 threads where the work is split differently (2
threads split long decode rows). The bound is shown to fail on what a broken kernel would output
(a dropped key, bf16 probabilities, a truncated output). The no-read-past-the-length guarantee is
tested for real: a vattention cache whose rows are mapped exactly up to the length, and a
sliding-window cache whose early pages were released, in a child process (a stray read is
SIGSEGV).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from vattention import _C
from vattention.attention import (
    cpu_attention,
    fp8_store_like_vllm,
    kernel_isa,
    kernel_variants,
    reference_attention,
)
from vattention.attention.variants import ISA_ENV
from vattention.bench.machine import cpu_flags, cpu_vendor

from support.attention_bound import check_within_bound, reference_and_bound

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def make_caches(
    rows, seq, kv_heads, d, dtype, *, mega=False, layers=3, gen=None, descale=(1.0, 1.0)
):
    """K and V caches [rows, seq, kv_heads, d] of random values; mega: views [:, :, 1] of
    [rows, seq, layers, kv_heads, d] tensors (token stride layers * kv_heads * d)."""
    shape = (rows, seq, layers, kv_heads, d) if mega else (rows, seq, kv_heads, d)
    out = []
    for scale in descale:
        x = torch.randn(shape, generator=gen) * scale
        if dtype in FP8:
            x = fp8_store_like_vllm(x / scale, dtype)
        else:
            x = x.to(dtype)
        out.append(x[:, :, 1] if mega else x)
    return out


def check_against_reference(q, kc, vc, k=None, v=None, **kw):
    """Runs the kernel on (kc, vc) and the float64 oracle on copies: the caches must be equal,
    every output within the derived bound (tests/support/attention_bound.py)."""
    kc_ref, vc_ref = kc.clone(), vc.clone()
    got = cpu_attention(q, kc, vc, k, v, **kw)
    want, bound = reference_and_bound(q, kc_ref, vc_ref, k, v, **kw)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert torch.equal(
        kc.view(torch.uint8) if kc.dtype in FP8 else kc,
        kc_ref.view(torch.uint8) if kc.dtype in FP8 else kc_ref,
    ), "appended keys differ"
    assert torch.equal(
        vc.view(torch.uint8) if vc.dtype in FP8 else vc,
        vc_ref.view(torch.uint8) if vc.dtype in FP8 else vc_ref,
    ), "appended values differ"
    check_within_bound(got, want, bound, f"{kernel_isa()} {q.dtype} cache {kc.dtype}")
    return got


# ---- random batches --------------------------------------------------------------------------


@st.composite
def batches(draw, big=True):
    group = draw(st.sampled_from([1, 2, 4, 8]))
    # 4 and 8 KV heads: chunks of 4 to 16 heads per decode tile (dense tiles, split accumulators);
    # 3: a partial chunk (general tiles)
    kv_heads = draw(st.sampled_from([1, 2, 3, 4, 8]))
    d = draw(st.sampled_from([64, 80, 128, 256] if big else [16, 64, 80]))
    n = draw(st.integers(1, 4))
    varlen = draw(st.booleans())
    max_lq, max_past = (300, 3000) if big else (70, 400)
    decode_lq = st.sampled_from([1, 1, 1, 2, 3])
    if varlen:
        lqs = [draw(st.one_of(decode_lq, st.integers(0, max_lq))) for _ in range(n)]
    else:
        lqs = [draw(st.one_of(decode_lq, st.integers(1, max_lq)))] * n
    pasts = [draw(st.integers(0, max_past)) for _ in range(n)]
    # keep one example under ~1e8 multiply-adds (the reference is the slow side)
    budget = 1.2e8 / (group * kv_heads * d)
    while sum(lq * (p + lq) for lq, p in zip(lqs, pasts)) > budget:
        pasts = [p // 2 for p in pasts]
        if not any(pasts):
            lqs = [max(1, lq // 2) for lq in lqs] if varlen else [max(1, lqs[0] // 2)] * n
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    cache_dtype = draw(st.sampled_from([dtype, dtype, *FP8]))
    causal = draw(st.booleans())
    left = draw(st.one_of(st.just(-1), st.integers(0, 500)))
    right = 0 if causal else draw(st.one_of(st.just(-1), st.integers(0, 20)))
    return dict(
        group=group,
        kv_heads=kv_heads,
        d=d,
        varlen=varlen,
        lqs=lqs,
        pasts=pasts,
        dtype=dtype,
        cache_dtype=cache_dtype,
        causal=causal,
        window=(left, right),
        with_new=draw(st.booleans()),
        mega=draw(st.booleans()),
        spare_rows=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def run_batch(b):
    gen = torch.Generator().manual_seed(b["seed"])
    n, kv_heads, d = len(b["lqs"]), b["kv_heads"], b["d"]
    heads = kv_heads * b["group"]
    new = b["lqs"] if b["with_new"] else [0] * n
    seq = max(p + x for p, x in zip(b["pasts"], new)) + 3
    rows = n + b["spare_rows"]
    fp8 = b["cache_dtype"] in FP8
    descale = (
        (0.5 + torch.rand((), generator=gen).item(), 0.25 + torch.rand((), generator=gen).item())
        if fp8
        else (1.0, 1.0)
    )
    kc, vc = make_caches(
        rows, seq, kv_heads, d, b["cache_dtype"], mega=b["mega"], gen=gen, descale=descale
    )
    order = torch.randperm(rows, generator=gen)[:n].to(torch.int32)  # rows in a shuffled order
    dt = b["dtype"]
    if b["varlen"]:
        total = sum(b["lqs"])
        q = torch.randn(total, heads, d, generator=gen).to(dt)
        k = (torch.randn(total, kv_heads, d, generator=gen) * descale[0]).to(dt)
        v = (torch.randn(total, kv_heads, d, generator=gen) * descale[1]).to(dt)
        cu = torch.tensor([0] + list(torch.tensor(b["lqs"]).cumsum(0)), dtype=torch.int32)
        extra = dict(cu_seqlens_q=cu)
    else:
        lq = b["lqs"][0]
        q = torch.randn(n, lq, heads, d, generator=gen).to(dt)
        k = (torch.randn(n, lq, kv_heads, d, generator=gen) * descale[0]).to(dt)
        v = (torch.randn(n, lq, kv_heads, d, generator=gen) * descale[1]).to(dt)
        extra = {}
    if not b["with_new"]:
        k = v = None
    if fp8:
        extra.update(k_descale=descale[0], v_descale=torch.tensor([descale[1]]))
    if b.get("shared"):
        groups, lens, copied = b["shared"]
        for r in order[1:].tolist():  # every row holds the first row's first `copied` tokens
            kc[r, :copied] = kc[order[0], :copied]
            vc[r, :copied] = vc[order[0], :copied]
        extra.update(prefix_groups=torch.tensor(groups), prefix_lens=torch.tensor(lens))
    check_against_reference(
        q,
        kc,
        vc,
        k,
        v,
        cache_seqlens=torch.tensor(b["pasts"], dtype=torch.int32),
        cache_batch_idx=order,
        causal=b["causal"],
        window_size=b["window"],
        **extra,
    )


# Hypothesis draws the examples of each variant anew (12 a variant: 48 on a CPU that runs all)
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(b=batches())
def test_random_batches_match_the_reference(isa, b):
    run_batch(b)


@st.composite
def shared_prefix_batches(draw):
    """Batches whose rows share their first tokens (prefix-cache hits), with the prefix hint:
    mostly decode rows (the shared items' members), some prefill rows and windows (which the
    kernel must leave out of a group), groups and claimed lengths at random within the truth."""
    b = draw(batches(big=False))
    n = draw(st.integers(2, 12))
    copied = draw(st.integers(0, 300))
    b["lqs"] = [draw(st.sampled_from([1, 1, 1, 2, 0, 9])) for _ in range(n)]
    if not b["varlen"]:
        b["lqs"] = [b["lqs"][0] or 1] * n
    b["pasts"] = [copied + draw(st.integers(-20, 120)) for _ in range(n)]
    b["pasts"] = [max(0, p) for p in b["pasts"]]
    if draw(st.booleans()):
        b["window"] = (-1, 0 if b["causal"] else -1)
    groups = [draw(st.sampled_from([-1, 0, 0, 0, 1])) for _ in range(n)]
    lens = [
        draw(st.integers(0, copied)) if draw(st.integers(0, 4)) == 0 else copied for _ in range(n)
    ]
    b["shared"] = (groups, lens, copied)
    return b


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(b=shared_prefix_batches())
def test_shared_prefix_hint_keeps_the_result(isa, threads, b):
    run_batch(b)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(b=batches(big=False))
def test_random_small_batches_on_1_and_2_threads(isa, b):
    for t in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(t)
        try:
            run_batch(b)
        finally:
            torch.set_num_threads(before)


# ---- targeted cases ----------------------------------------------------------------------------


def test_long_shared_prefix_split_across_threads(isa, threads):
    """One KV head, a 1500-token prefix behind 12 decode rows: on 2 threads the shared items are
    split by keys like a long row (each member then merges several prefix parts and its own)."""
    gen = torch.Generator().manual_seed(6)
    n, prefix = 12, 1500
    kc, vc = make_caches(n, 1700, 1, 128, torch.float32, gen=gen)
    for r in range(1, n):
        kc[r, :prefix], vc[r, :prefix] = kc[0, :prefix], vc[0, :prefix]
    q = torch.randn(n, 1, 8, 128, generator=gen)
    k, v = torch.randn(n, 1, 1, 128, generator=gen), torch.randn(n, 1, 1, 128, generator=gen)
    check_against_reference(
        q,
        kc,
        vc,
        k,
        v,
        cache_seqlens=torch.tensor([prefix + 13 * i for i in range(n)]),
        causal=True,
        prefix_groups=torch.zeros(n, dtype=torch.int32),
        prefix_lens=torch.full((n,), prefix, dtype=torch.int32),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_shared_prefix_is_read_from_one_row(isa, threads, dtype):
    """16 decode rows (GQA 2) behind one 300-token prefix, and two prefill rows: with the hint the
    kernel reads the prefix from one member's row (a hint that lies shows it: the other rows'
    prefix is not read), and the result is the reference's."""
    gen = torch.Generator().manual_seed(5)
    n, prefix = 18, 300
    kc, vc = make_caches(n, 520, 2, 64, dtype, gen=gen)
    for r in range(1, n):
        kc[r, :prefix], vc[r, :prefix] = kc[0, :prefix], vc[0, :prefix]
    lqs = [1] * 16 + [40, 1]
    q = torch.randn(sum(lqs), 4, 64, generator=gen)
    q = q.to(torch.float32 if dtype in FP8 else dtype)
    k = torch.randn(sum(lqs), 2, 64, generator=gen).to(q.dtype)
    v = torch.randn(sum(lqs), 2, 64, generator=gen).to(q.dtype)
    cu = torch.tensor([0, *torch.tensor(lqs).cumsum(0).tolist()], dtype=torch.int32)
    past = torch.tensor([prefix + 7 * i for i in range(16)] + [prefix, prefix + 3])
    hint = dict(prefix_groups=torch.tensor([0] * 17 + [-1]), prefix_lens=torch.full((n,), prefix))
    kw = dict(cache_seqlens=past, cu_seqlens_q=cu, causal=True)
    check_against_reference(q, kc, vc, k, v, **kw, **hint)
    # a lying hint: rows 1.. now differ from row 0 in the prefix, yet the hinted call reads row
    # 0's prefix for every decode member; the prefill row (17th) and the row outside any group
    # read their own
    kc[1:, :prefix] = make_caches(n - 1, prefix, 2, 64, dtype, gen=gen)[0]
    truth = cpu_attention(q, kc, vc, **kw)
    lied = cpu_attention(q, kc, vc, **kw, **hint)
    said = kc.clone()  # the caches the hint describes: the 16 members hold row 0's prefix
    said[1:16, :prefix] = kc[0, :prefix]
    want, bound = reference_and_bound(q, kc.clone(), vc.clone(), **kw)
    want_said, bound_said = reference_and_bound(q, said, vc.clone(), **kw)
    check_within_bound(truth, want, bound, "without the hint")
    check_within_bound(lied[:16], want_said[:16], bound_said[:16], "the members, hinted")
    check_within_bound(lied[16:], want[16:], bound[16:], "the rows outside the group, hinted")
    with pytest.raises(AssertionError, match="outside the derived bound"):
        check_within_bound(lied[1:16], want[1:16], bound[1:16], "members 1-15, hinted")


def test_long_decode_rows_split_across_threads(isa, threads):
    """One request dominating the batch: its keys are split (flash-decoding) and recombined."""
    gen = torch.Generator().manual_seed(1)
    kc, vc = make_caches(3, 4200, 2, 128, torch.float32, gen=gen)
    q = torch.randn(3, 1, 8, 128, generator=gen)
    k, v = torch.randn(3, 1, 2, 128, generator=gen), torch.randn(3, 1, 2, 128, generator=gen)
    check_against_reference(
        q,
        kc,
        vc,
        k,
        v,
        cache_seqlens=torch.tensor([4100, 7, 900]),
        cache_batch_idx=torch.tensor([2, 0, 1]),
        causal=True,
    )


def test_mixed_prefill_and_decodes(isa, threads):
    """A long prefill chunk beside many decodes, in one varlen call (the vLLM batch shape)."""
    gen = torch.Generator().manual_seed(2)
    lqs = [1] * 12 + [257]
    pasts = [int(x) for x in torch.randint(0, 1500, (12,), generator=gen)] + [300]
    kc, vc = make_caches(13, 1600, 2, 64, torch.bfloat16, gen=gen)
    total = sum(lqs)
    q = torch.randn(total, 8, 64, generator=gen).bfloat16()
    k, v = (
        torch.randn(total, 2, 64, generator=gen).bfloat16(),
        torch.randn(total, 2, 64, generator=gen).bfloat16(),
    )
    cu = torch.tensor([0] + list(torch.tensor(lqs).cumsum(0)), dtype=torch.int32)
    check_against_reference(
        q,
        kc,
        vc,
        k,
        v,
        cache_seqlens=torch.tensor(pasts),
        cache_batch_idx=torch.randperm(13, generator=gen),
        cu_seqlens_q=cu,
        causal=True,
        window_size=(1000, 0),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,d", [(4, 64), (8, 64), (2, 128), (8, 128)])
def test_dense_decode_tiles_over_rows_of_every_length(isa, dtype, kv_heads, d):
    """Decode rows whose heads are adjacent (the dense tiles: several tokens per tile, fp32 and
    bf16-dot), with lengths that end on and off a tile and a block, beside GQA-2 rows."""
    gen = torch.Generator().manual_seed(11)
    pasts = [0, 1, 3, 4, 5, 127, 128, 129, 255, 600, 1023, 1030]
    n = len(pasts)
    for group in (1, 2):
        kc, vc = make_caches(n, 1100, kv_heads, d, dtype, gen=gen)
        q = torch.randn(n, 1, kv_heads * group, d, generator=gen).to(dtype)
        k = torch.randn(n, 1, kv_heads, d, generator=gen).to(dtype)
        v = torch.randn(n, 1, kv_heads, d, generator=gen).to(dtype)
        check_against_reference(q, kc, vc, k, v, cache_seqlens=torch.tensor(pasts), causal=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4, 7, 8])
def test_16_bit_output_is_the_exact_value_rounded_once(isa, dtype, group):
    """On 16-bit caches the output is the exact result rounded once to q's dtype, up to the fp32
    arithmetic's share of the derived bound (tests/support/attention_bound.py): u |o| for the
    rounding (u = 2^-8 bf16, 2^-11 fp16), plus a few 1e-4 of sum_j w_j |v_j| for the fp32 scores
    and sums over up to 3000 keys. Scores, probabilities and sums stay in fp32 in every variant
    (exact products of 16-bit values, fp32 accumulation, fp32 P V on widened V). Probabilities
    rounded to bf16 for a bf16 P V product (tried for speed and not kept), or an output rounded
    otherwise than once to nearest, exceed it (test_the_bound_rejects_what_a_broken_kernel_gives).
    Decode over up to 3000 keys, prefill chunks, d 64 and 128, GQA 1-8, peaked and flat rows."""
    gen = torch.Generator().manual_seed(13 + group)
    for kv_heads, d in ((2, 64), (2, 128)):
        pasts = torch.tensor([0, 1, 63, 64, 65, 700, 3000], dtype=torch.int32)
        for lq in (1, 40):
            kc, vc = make_caches(len(pasts), 3100, kv_heads, d, dtype, gen=gen)
            q = torch.randn(len(pasts), lq, kv_heads * group, d, generator=gen).to(dtype)
            # scores of a few units: peaked and flat rows both occur
            q = (q.float() * 3 / d**0.5).to(dtype)
            k = torch.randn(len(pasts), lq, kv_heads, d, generator=gen).to(dtype)
            v = torch.randn(len(pasts), lq, kv_heads, d, generator=gen).to(dtype)
            check_against_reference(q, kc, vc, k, v, cache_seqlens=pasts, causal=True)


def _bf16_probabilities(q, kc, vc, lens):
    """Decode attention (q [n, 1, H, d]) in float64 but for its probabilities, rounded to bf16
    before P V (the sum of weights unrounded): what a kernel with a bf16 P V product computes."""
    n, _, heads, d = q.shape
    group = heads // kc.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, length in enumerate(lens.tolist()):
        keys = kc[i, :length].double().repeat_interleave(group, 1)  # [L, H, d]
        vals = vc[i, :length].double().repeat_interleave(group, 1)
        s = torch.einsum("hd,lhd->hl", q[i, 0].double(), keys) / d**0.5
        p = torch.exp(s - s.amax(-1, keepdim=True))
        pv = torch.einsum("hl,lhd->hd", p.bfloat16().double(), vals)
        out[i, 0] = pv / p.sum(-1, keepdim=True)
    return out


@pytest.mark.parametrize("header", ["vec_avx512.h", "vec_avx2.h"])
def test_exp2_polynomial_is_within_what_the_bound_assumes(header):
    """The bound takes 4 u of relative error per exp2 (tests/support/attention_bound.py). The
    avx512 and avx2 kernels' exp2 is a degree-6 polynomial in f = x - round(x), |f| <= 0.5
    (then scaled by 2^round(x), exactly): evaluated as they do it (Horner, each step one fused
    multiply-add rounded to fp32) on 10^6 points of [-0.5, 0.5] and its ends, it stays within
    2 u (1.34 u over 2e8 points; its truncation alone is about 0.03 u)."""
    with open(os.path.join(ROOT, "csrc", "attention", header)) as f:
        source = f.read()
    body = source[source.index("static F exp2(F x)") :]
    body = body[: body.index("\n  }\n")]
    coeffs = [float(c) for c in re.findall(r"set1_ps\(([-+0-9.eE]+)f\)", body)]
    coeffs = [c for c in coeffs if c != -126.0]  # the underflow threshold, not a coefficient
    assert len(coeffs) == 7 and coeffs[-1] == 1.0, coeffs
    gen = torch.Generator().manual_seed(0)
    f = torch.cat([torch.rand(10**6, generator=gen) - 0.5, torch.tensor([-0.5, 0.5, 0.0])])
    p = torch.full_like(f, coeffs[0])
    for c in coeffs[1:]:  # an fp32 FMA: the product exact in float64, one rounding to fp32
        p = (p.double() * f.double() + torch.tensor(c, dtype=torch.float32).double()).float()
    rel = (p.double() / torch.exp2(f.double()) - 1).abs().max().item()
    assert rel <= 2 * 2.0**-24, rel / 2.0**-24


@pytest.mark.parametrize(
    "dtype, broken",
    [
        (torch.bfloat16, "a dropped key"),
        (torch.float32, "a dropped key"),
        (torch.bfloat16, "bf16 probabilities"),
        (torch.float32, "bf16 probabilities"),
        (torch.bfloat16, "a truncated output"),
    ],
)
def test_the_bound_rejects_what_a_broken_kernel_gives(dtype, broken):
    """The derived bound can fail. On one decode batch (rows of 1 to 600 keys, GQA 4, d 128) the
    kernel's output passes it, and the output of each broken arithmetic, rounded to q's dtype
    as the kernel rounds, fails it: the last key of every row left out; probabilities rounded to
    bf16 before P V; the exact result truncated to bf16 instead of rounded to nearest (up to one
    unit in the last place where rounding is off by half a unit at most)."""
    gen = torch.Generator().manual_seed(21)
    lens = torch.tensor([1, 2, 7, 30, 100, 600])
    kc, vc = make_caches(len(lens), 600, 2, 128, dtype, gen=gen)
    q = torch.randn(len(lens), 1, 8, 128, generator=gen).to(dtype)
    got = cpu_attention(q, kc, vc, cache_seqlens=lens)
    want, bound = reference_and_bound(q, kc.clone(), vc.clone(), cache_seqlens=lens)
    check_within_bound(got, want, bound, "the kernel")
    if broken == "a dropped key":
        wrong = reference_attention(q.double(), kc, vc, cache_seqlens=lens - 1).to(dtype)
    elif broken == "bf16 probabilities":
        wrong = _bf16_probabilities(q, kc, vc, lens).to(dtype)
    else:  # toward zero: the low 16 bits of the fp32 value cut off
        wrong = (want.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)
        assert torch.equal(wrong.float(), wrong.float().bfloat16().float())  # exact in bf16
    with pytest.raises(AssertionError, match="outside the derived bound"):
        check_within_bound(wrong, want, bound, broken)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("lq", [1, 5, 12, 17, 20, 31, 33, 47, 48, 64, 65, 100])
def test_prefill_query_blocks_of_every_row_count(isa, lq, d, dtype):
    """Prefill items of 1-64 rows: the register tiles (6 x 4 and 4 x 4 per 4 vectors of d with
    AVX-512, their remainders) cover every row once, nothing past the block (rows pad to a
    multiple of the vector width); key blocks (128 keys at d = 64, 64 at d = 128) end in key
    tiles of 4, 2 and 1 (block ends, and rows ending anywhere). bf16 takes the bf16 dot product
    tiles where the CPU has them (``avx512bf16``: q in pairs of d, padded rows zero)."""
    gen = torch.Generator().manual_seed(12)
    kc, vc = make_caches(2, 400, 2, d, dtype, gen=gen)
    q = torch.randn(2, lq, 2, d, generator=gen).to(dtype)
    k = torch.randn(2, lq, 2, d, generator=gen).to(dtype)
    v = torch.randn(2, lq, 2, d, generator=gen).to(dtype)
    check_against_reference(q, kc, vc, k, v, cache_seqlens=torch.tensor([0, 150]), causal=True)


@pytest.mark.parametrize("window", [-1, 40])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_items_of_many_row_tiles(isa, group, window):
    """amx items take up to 256 rows (64 queries at a group of 4, 256 at 1; the other variants
    64): a block's K tiles and V (pairs, or V^T tiles) are packed once for all of them, and a
    pair of row tiles reads a block only up to the last key one of its rows sees (none of it when
    none). Causal prompts of 300 queries over 0 and 150 cached
    keys: an item's first rows end long before its last rows (they skip its later blocks), a
    window of 40 keys makes its last rows skip its first blocks, and the second item is a
    partial one (44 rows a head at group 1: an odd count of row tiles)."""
    gen = torch.Generator().manual_seed(14)
    kc, vc = make_caches(2, 500, 2, 64, torch.bfloat16, gen=gen)
    q = torch.randn(2, 300, 2 * group, 64, generator=gen).bfloat16()
    k = torch.randn(2, 300, 2, 64, generator=gen).bfloat16()
    v = torch.randn(2, 300, 2, 64, generator=gen).bfloat16()
    check_against_reference(
        q, kc, vc, k, v, cache_seqlens=torch.tensor([0, 150]), causal=True, window_size=(window, 0)
    )


@pytest.mark.parametrize("d", [64, 128])
def test_p_v_in_rows_and_in_columns(isa, d):
    """amx multiplies P V in rows (O += P V, P transposed per row tile) for items of fewer than
    3 / 4 d rows and in columns (O^T += V^T P^T, V transposed per block) from there on: a call
    whose items are under that (d / 2 rows a head), then one whose items are at it (3 / 4 d),
    over cached keys that span two key blocks, so that each layout rescales its accumulators
    and carries them across blocks (fails with either layout's lo terms left out: checked)."""
    gen = torch.Generator().manual_seed(16)
    kc, vc = make_caches(2, 400, 2, d, torch.bfloat16, gen=gen)
    rows = (d // 2, 3 * d // 4)
    q = torch.randn(2, rows[1], 2, d, generator=gen).bfloat16()
    k = torch.randn(2, rows[1], 2, d, generator=gen).bfloat16()
    v = torch.randn(2, rows[1], 2, d, generator=gen).bfloat16()
    check_against_reference(
        q[:1, : rows[0]],
        kc[:1],
        vc[:1],
        k[:1, : rows[0]],
        v[:1, : rows[0]],
        cache_seqlens=torch.tensor([200]),
        causal=True,
    )
    check_against_reference(q, kc, vc, k, v, cache_seqlens=torch.tensor([130, 200]), causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("key", [0.25, 1.0, 4.0])
def test_a_late_key_far_above_the_running_max(isa, key, dtype):
    """One key late in the rows (after two key blocks of small scores) whose score is above every
    earlier one by about 11, 46 or 184 in base 2: amx keeps a tile's running max while its
    probabilities stay at most 2^16 (the first: the key weighs 2^11 against that max) and
    otherwise takes the block's max and rescales (the last would be 2^184, past fp32's range);
    the other variants always rescale."""
    gen = torch.Generator().manual_seed(15)
    kc, vc = make_caches(1, 400, 1, 64, dtype, gen=gen)
    kc[0, :300] = (torch.randn(300, 1, 64, generator=gen) * 0.01).to(dtype)
    kc[0, 280] = key
    q = (4 + torch.randn(1, 32, 1, 64, generator=gen) * 0.1).to(dtype)
    check_against_reference(q, kc, vc, cache_seqlens=torch.tensor([300]), causal=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_negative_and_zero_softmax_scales(isa, scale, dtype):
    """A scale at or below zero is finite, so the kernel takes it: the softmax's max is then the
    smallest raw score scaled (amx takes the block's max before scaling), and with a zero scale
    a row's masked keys (causal: every key past its query) still weigh nothing, also in a key
    block where all of a row's keys are masked (the second row's first queries see keys up to
    100-126 of its 140, and the kernels' key blocks start at 128 or before)."""
    gen = torch.Generator().manual_seed(13)
    kc, vc = make_caches(2, 400, 2, 64, dtype, gen=gen)
    q = torch.randn(2, 40, 4, 64, generator=gen).to(dtype)
    k = torch.randn(2, 40, 2, 64, generator=gen).to(dtype)
    v = torch.randn(2, 40, 2, 64, generator=gen).to(dtype)
    check_against_reference(
        q, kc, vc, k, v, cache_seqlens=torch.tensor([0, 100]), causal=True, softmax_scale=scale
    )


def test_output_written_in_place_into_a_given_buffer():
    """The vLLM plugin's path: the kernel writes into a slice of the engine's output buffer (no
    new tensor, no copy); a buffer of the wrong shape, dtype or strides is refused, nothing
    written."""
    gen = torch.Generator().manual_seed(13)
    kc, vc = make_caches(2, 64, 2, 16, torch.float32, gen=gen)
    q = torch.randn(5, 4, 16, generator=gen)
    k, v = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    meta = (torch.tensor([3, 7], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32))
    cu = torch.tensor([0, 4, 5], dtype=torch.int32)
    args = dict(cache_seqlens=meta[0], cache_batch_idx=meta[1], cu_seqlens_q=cu, causal=True)
    want = cpu_attention(q, kc.clone(), vc.clone(), k, v, **args)
    buffer = torch.full((8, 64), 7.0)
    got = cpu_attention(q, kc, vc, k, v, **args, out=buffer[:5].view(5, 4, 16))
    assert got.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:5].view(5, 4, 16), want)  # the same arithmetic, another buffer
    assert torch.equal(buffer[5:], torch.full((3, 64), 7.0))
    for bad in (
        torch.empty(5, 4, 8),
        torch.empty(5, 4, 16).bfloat16(),
        torch.empty(5, 4, 32)[..., ::2],
    ):
        before = kc.clone()
        with pytest.raises(ValueError, match="out must be"):
            cpu_attention(q, kc, vc, k, v, **args, out=bad)
        assert torch.equal(kc, before)


def test_reference_gqa_square_causal_matches_naive_softmax(isa):
    """The oracle itself: grouped heads, as many queries as keys, causal (SDPA's is_causal path
    must not be taken there: the group's heads are stacked as extra query rows), in float64
    against a naive softmax (both err by ~1e-16, far below float64's default tolerance); and the
    kernel on the same case."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(1, 3, 4, 8, generator=gen),
        torch.randn(1, 3, 2, 8, generator=gen),
        torch.randn(1, 3, 2, 8, generator=gen),
    )
    kc, vc = torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8)
    out = reference_attention(q.double(), kc, vc, k, v, cache_seqlens=0, causal=True)
    for j in range(3):
        for h in range(4):
            s = k[0, : j + 1, h // 2].double() @ q[0, j, h].double() / 8**0.5
            naive = s.softmax(0) @ v[0, : j + 1, h // 2].double()
            torch.testing.assert_close(out[0, j, h], naive)
    kc, vc = torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8)
    check_against_reference(q, kc, vc, k, v, cache_seqlens=0, causal=True)


def test_query_that_sees_no_key_outputs_zero(isa):
    """Zeros where a query sees no key; where it sees one, that key's value exactly (its weight
    is exp2(0) = 1, the sum 1, in every variant)."""
    kc, vc = torch.randn(1, 8, 1, 16), torch.randn(1, 8, 1, 16)
    q = torch.randn(1, 4, 2, 16)
    # 4 queries, 2 keys, causal bottom-right: queries 0 and 1 sit before the first key
    out = cpu_attention(q, kc, vc, cache_seqlens=2, causal=True)
    assert torch.equal(out[0, :2], torch.zeros(2, 2, 16)) and out[0, 2:].abs().sum() > 0
    # a window of 0 keys to the left and right, not causal: each query sees exactly one key
    out = cpu_attention(q, kc, vc, cache_seqlens=6, window_size=(0, 0))
    for j in range(4):
        assert torch.equal(out[0, j], vc[0, j + 2].expand(2, 16)), j


def test_prefill_rows_that_see_no_key_output_zero_in_tiles(isa):
    """bf16 at d = 64 (the amx variant's tile path): 40 queries, 21 keys, causal bottom-right, a
    group of 4, so queries 0-18 see no key. Their rows fill four whole row tiles that no key ever
    reaches (amx: accumulators never written, emitted as zeros) and part of a fifth whose other
    rows see key 0: all output exact zeros, the rest within the bound."""
    gen = torch.Generator().manual_seed(22)
    kc, vc = make_caches(1, 64, 2, 64, torch.bfloat16, gen=gen)
    q = torch.randn(1, 40, 8, 64, generator=gen).bfloat16()
    out = check_against_reference(q, kc, vc, cache_seqlens=21, causal=True)
    assert torch.equal(out[0, :19], torch.zeros(19, 8, 64, dtype=torch.bfloat16))
    assert (out[0, 19:].float().abs().sum(-1) > 0).all()


@pytest.mark.parametrize("window", [-1, 1000])
def test_prefill_chunk_split_across_threads(isa, threads, window):
    """A prefill chunk of 12 queries over 3000 cached keys (or a window of 1000) beside small
    requests dominates the call: on two threads its keys are split into parts whose partial
    sums, maxima and weights are combined (each part an item of its own)."""
    gen = torch.Generator().manual_seed(23)
    kc, vc = make_caches(3, 3100, 2, 64, torch.bfloat16, gen=gen)
    lqs = [12, 1, 3]
    total = sum(lqs)
    q = torch.randn(total, 8, 64, generator=gen).bfloat16()
    k = torch.randn(total, 2, 64, generator=gen).bfloat16()
    v = torch.randn(total, 2, 64, generator=gen).bfloat16()
    check_against_reference(
        q,
        kc,
        vc,
        k,
        v,
        cu_seqlens_q=torch.tensor([0, 12, 13, 16], dtype=torch.int32),
        cache_seqlens=torch.tensor([3000, 50, 400]),
        causal=True,
        window_size=(window, 0),
    )


def test_fp8_writes_match_vllm_rounding():
    """New keys into an fp8 cache: x * (1 / descale), saturated, truncated toward zero (vLLM 0.32).

    1.1 / 2 = 0.55 lies between 0.5 and 0.5625 (e4m3) or 0.625 (e5m2): round-to-nearest would
    give 0.5625 / 0.5; truncation gives 0.5 for both. 150 in e5m2 lies between 128 and 160
    (nearest: 160, truncated: 128)."""
    x = torch.tensor([1.1, -1e9, 0.003, -0.0, 1e-4, -1e-4, 300.0, 0.37]).view(1, 1, 1, 8)
    for dtype, fmax, at_150 in (
        (torch.float8_e4m3fn, 448.0, 144.0),
        (torch.float8_e5m2, 57344.0, 128.0),
    ):
        kc = torch.zeros(1, 4, 1, 8, dtype=dtype)
        vc = torch.zeros(1, 4, 1, 8, dtype=dtype)
        cpu_attention(
            torch.zeros(1, 1, 1, 8), kc, vc, x, x, cache_seqlens=0, k_descale=2.0, v_descale=2.0
        )
        got = kc[0, 0, 0].float()
        assert got[0] == 0.5 and got[1] == -fmax and got[6] == at_150
        assert got[3] == 0 and not torch.signbit(got[3])  # -0 is stored as +0
        assert torch.equal(
            kc[0, 0].view(torch.uint8),
            fp8_store_like_vllm(x / 2.0, dtype)[0, 0].view(torch.uint8),
        )
        assert torch.equal(kc.view(torch.uint8), vc.view(torch.uint8))


# `make test` builds .venv-vllm; VATTENTION_VLLM_PYTHON points at another vLLM 0.32 interpreter
VLLM_PYTHON = os.environ.get(
    "VATTENTION_VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin", "python")
)


@pytest.mark.skipif(not os.path.exists(VLLM_PYTHON), reason="no vLLM venv (.venv-vllm) built")
def test_fp8_writes_are_bit_identical_to_vllm_cpu_backend(tmp_path):
    """Runs vLLM's own cpu_attn_reshape_and_cache beside this kernel in the vLLM venv."""
    code = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        import vllm._custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        from vattention.attention import cpu_attention
        torch.manual_seed(0)
        H, D, bs = 2, 64, 256
        try:   # vLLM's own choice for this CPU: fp8 caches need AVX-512 or AMX in 0.32
            isa = _get_attn_isa(torch.float32, bs, D, "fp8")
        except NotImplementedError as e:
            print("vLLM refuses:", e)
            sys.exit(0)
        x = (torch.randn(bs, H, D) * torch.logspace(-14, 14, bs, base=2).view(bs, 1, 1)).float()
        x[0, 0, :3] = torch.tensor([float("nan"), -0.0, 1e30])
        for name, dt in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
            for scale in (0.37, 1.0, 7.3):
                kc = torch.zeros(1, H, bs, D, dtype=torch.uint8); vc = torch.zeros_like(kc)
                ops.cpu_attn_reshape_and_cache(x, x, kc, vc, torch.arange(bs), isa, k_scale=scale,
                                               v_scale=scale, kv_cache_dtype=name)
                vllm_bytes = vc[0].transpose(0, 1)                     # value rows: [bs, H, D]
                ours_k = torch.zeros(1, bs, H, D, dtype=dt); ours_v = torch.zeros_like(ours_k)
                cpu_attention(
                    torch.zeros(1, bs, H, D), ours_k, ours_v, x[None], x[None],
                    cache_seqlens=0, k_descale=scale, v_descale=scale)
                mism = int((ours_v[0].view(torch.uint8) != vllm_bytes).sum())
                assert mism == 0, (name, scale, mism)
        print("identical")
    """)
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    proc = subprocess.run(
        [VLLM_PYTHON, "-c", code, ROOT], capture_output=True, text=True, env=env, timeout=300
    )
    if proc.returncode == 0 and "vLLM refuses:" in proc.stdout:
        pytest.skip(f"no fp8 cache in vLLM's CPU backend on this CPU ({proc.stdout.strip()})")
    assert proc.returncode == 0 and "identical" in proc.stdout, proc.stdout + proc.stderr


def test_in_place_append_is_exact_and_touches_nothing_else(isa):
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        kc, vc = make_caches(4, 50, 2, 64, dtype, mega=True, gen=gen)
        before_k, before_v = kc.clone(), vc.clone()
        q = torch.randn(5, 4, 64, generator=gen).to(dtype)
        k, v = (
            torch.randn(5, 2, 64, generator=gen).to(dtype),
            torch.randn(5, 2, 64, generator=gen).to(dtype),
        )
        cpu_attention(
            q,
            kc,
            vc,
            k,
            v,
            cache_seqlens=torch.tensor([10, 45]),
            cache_batch_idx=torch.tensor([3, 1]),
            cu_seqlens_q=torch.tensor([0, 3, 5]),
            causal=True,
        )
        assert torch.equal(kc[3, 10:13], k[:3]) and torch.equal(vc[3, 10:13], v[:3])
        assert torch.equal(kc[1, 45:47], k[3:]) and torch.equal(vc[1, 45:47], v[3:])
        kc[3, 10:13], vc[3, 10:13] = before_k[3, 10:13], before_v[3, 10:13]
        kc[1, 45:47], vc[1, 45:47] = before_k[1, 45:47], before_v[1, 45:47]
        assert torch.equal(kc, before_k) and torch.equal(vc, before_v)


# ---- errors: typed, naming the argument, before anything is written ---------------------------


def _args():
    kc, vc = torch.zeros(2, 8, 1, 16), torch.zeros(2, 8, 1, 16)
    return dict(
        q=torch.randn(1, 1, 2, 16),
        k_cache=kc,
        v_cache=vc,
        k=torch.ones(1, 1, 1, 16),
        v=torch.ones(1, 1, 1, 16),
        cache_seqlens=torch.tensor([3]),
        cache_batch_idx=torch.tensor([1]),
        causal=True,
    )


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(cache_seqlens=torch.tensor([8])), ValueError, "exceed the cache length 8"),
        (
            dict(cache_seqlens=torch.tensor([-1])),
            ValueError,
            r"cache_seqlens\[0\] = -1 is negative",
        ),
        (dict(cache_seqlens=torch.tensor([3.0])), TypeError, "cache_seqlens must hold integers"),
        (
            dict(cache_seqlens=torch.tensor([3, 4])),
            ValueError,
            "cache_seqlens must be 1-D with 1 entries",
        ),
        (dict(cache_seqlens=torch.tensor([2**33])), ValueError, "fit in int32"),
        (
            dict(cache_batch_idx=torch.tensor([2])),
            ValueError,
            r"cache_batch_idx\[0\] = 2 is outside the cache's 2 rows",
        ),
        (
            dict(
                q=torch.randn(1, 1, 3, 16),
                k_cache=torch.zeros(2, 8, 2, 16),
                v_cache=torch.zeros(2, 8, 2, 16),
                k=torch.ones(1, 1, 2, 16),
                v=torch.ones(1, 1, 2, 16),
            ),
            ValueError,
            r"q heads \(3\) must be a multiple",
        ),
        (dict(q=torch.randn(1, 1, 2, 8)), ValueError, "head_dim 8 != the cache's head_dim 16"),
        (
            dict(q=torch.randn(1, 1, 2, 16, dtype=torch.float64)),
            TypeError,
            "q dtype must be float32",
        ),
        (dict(k=torch.ones(1, 1, 1, 16, dtype=torch.float16)), TypeError, "k/v dtype must be q's"),
        (dict(k=torch.ones(1, 2, 1, 16)), ValueError, r"v must have k's shape \(1, 2, 1, 16\)"),
        (
            dict(k=torch.ones(2, 1, 1, 16), v=torch.ones(2, 1, 1, 16)),
            ValueError,
            r"k must be \[n, seqlen_new, kv_heads, head_dim\] = \[1, \*, 1, 16\]",
        ),
        (dict(v=None), ValueError, "k and v must be given together"),
        (dict(k_descale=2.0), ValueError, "k_descale applies to fp8 caches only"),
        (dict(window_size=(-2, 0)), ValueError, "window_size entries must be >= -1"),
        (dict(window_size=(1.5, 0)), TypeError, "window_size entries must be integers"),
        (
            dict(cu_seqlens_q=torch.tensor([0, 1])),
            ValueError,
            r"q must be \[total_q, heads, head_dim\]",
        ),
    ],
)
def test_bad_arguments_raise_typed_errors_and_write_nothing(change, error, match):
    args = _args()
    args.update(change)
    before = args["k_cache"].clone()
    with pytest.raises(error, match=match):
        cpu_attention(**args)
    assert torch.equal(args["k_cache"], before)


@pytest.mark.parametrize("missing", ["k", "v"])
def test_reference_takes_k_and_v_together(missing):
    # Like the kernel: one of them alone is an argument error, not a crash inside the oracle.
    args = _args()
    args[missing] = None
    before = args["k_cache"].clone()
    with pytest.raises(ValueError, match="k and v must be given together"):
        reference_attention(**args)
    assert torch.equal(args["k_cache"], before)


def test_more_bad_arguments():
    args = _args()
    kc = torch.zeros(2, 8, 1, 32)[..., ::2]  # last dim strided
    with pytest.raises(ValueError, match="k_cache must have a contiguous last dimension"):
        cpu_attention(**dict(args, k_cache=kc, v_cache=kc.clone()))
    q = torch.randn(2, 1, 2, 16)
    with pytest.raises(ValueError, match="cache_batch_idx repeats row 1"):
        cpu_attention(
            **dict(
                args,
                q=q,
                k=torch.ones(2, 1, 1, 16),
                v=torch.ones(2, 1, 1, 16),
                cache_seqlens=torch.tensor([1, 2]),
                cache_batch_idx=torch.tensor([1, 1]),
            )
        )
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        cpu_attention(
            torch.randn(3, 2, 16),
            args["k_cache"],
            args["v_cache"],
            cache_seqlens=2,
            cu_seqlens_q=torch.tensor([0, 2, 1]),
        )
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 4 exceeds the 3 query tokens"):
        cpu_attention(
            torch.randn(3, 2, 16),
            args["k_cache"],
            args["v_cache"],
            cache_seqlens=2,
            cu_seqlens_q=torch.tensor([0, 4]),
        )
    with pytest.raises(ValueError, match="k_descale must be finite and > 0"):
        fp8 = torch.zeros(2, 8, 1, 16, dtype=torch.float8_e4m3fn)
        cpu_attention(**dict(args, k_cache=fp8, v_cache=fp8.clone(), k_descale=0.0))
    # duplicate rows are fine when nothing is appended (read only)
    cpu_attention(
        q,
        args["k_cache"],
        args["v_cache"],
        cache_seqlens=torch.tensor([1, 2]),
        cache_batch_idx=torch.tensor([1, 1]),
    )


# ---- the memory guarantee, on a real vattention cache -----------------------------------------

GUARD_SCRIPT = """
import os, sys, torch, vattention
from vattention.attention import cpu_attention, kernel_isa
torch.set_num_threads(2)
mode = sys.argv[1]
assert kernel_isa() == os.environ.get("VATTENTION_ATTENTION_ISA", kernel_isa()), kernel_isa()
window = 300 if mode == "window" else None
cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=3,
                               max_seq_len=4096, dtype=torch.float32, page_size="64KB",
                               sliding_window=window)
tpp = cfg.tokens_per_page
with vattention.KVCache(cfg) as cache:
    slots = [cache.alloc() for _ in range(3)]
    lens = [3 * tpp, 5 * tpp, 7 * tpp]            # whole pages: the mapping ends at the length
    lq = [1, 1, 100]
    past = [L - n for L, n in zip(lens, lq)]
    for n in range(tpp, max(past) + tpp, tpp):     # grow in steps, as a server would (windowed
        cache.step({s: min(n, p) for s, p in zip(slots, past)})   # rows release early pages)
    cache.step(dict(zip(slots, lens)))              # this step's tokens, as the engine does
    assert [cache.mapped_tokens(s) for s in slots] == lens, [cache.mapped_tokens(s) for s in slots]
    k_cache, v_cache = cache.layer(0)
    starts = [cache.window_start(s, 0) for s in slots]
    for s, L, a in zip(slots, lens, starts):
        k_cache[s, a:L] = torch.randn(L - a, 2, 64)
        v_cache[s, a:L] = torch.randn(L - a, 2, 64)
    if mode == "control":                           # reading one token past the length faults
        print("control:", float(k_cache[slots[0], :lens[0] + 1].sum()), flush=True)
    ws = (window - 1, 0) if window else (-1, -1)
    # decode (last token appended) and a prefill chunk of 100 tokens, in one call
    q = torch.randn(sum(lq), 8, 64)
    k = torch.randn(sum(lq), 2, 64)
    v = torch.randn(sum(lq), 2, 64)
    cu = torch.tensor([0, 1, 2, 102], dtype=torch.int32)
    out = cpu_attention(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(past),
                        cache_batch_idx=torch.tensor(slots), cu_seqlens_q=cu, causal=True,
                        window_size=ws)
    assert torch.isfinite(out).all()
    print("ok", mode, starts, flush=True)
"""


@pytest.mark.parametrize("mode", ["length", "window"])
def test_kernel_reads_nothing_past_the_length_or_before_the_window(isa, mode):
    """The variant's loads, in a child process that runs it (VATTENTION_ATTENTION_ISA)."""
    proc = subprocess.run(
        [sys.executable, "-c", GUARD_SCRIPT, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, **{ISA_ENV: isa}),
    )
    assert proc.returncode == 0 and f"ok {mode}" in proc.stdout, proc.stdout + proc.stderr
    if mode == "window":
        starts = eval(proc.stdout.split("ok window ")[1])
        assert max(starts) > 0, "no page was released: the window case tests nothing"


def test_the_guard_is_real():
    """The same script, reading one token past the length with torch: the child dies of SIGSEGV."""
    proc = subprocess.run(
        [sys.executable, "-c", GUARD_SCRIPT, "control"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -11 and "control:" not in proc.stdout, (
        proc.returncode,
        proc.stdout,
        proc.stderr,
    )


# ---- runtime: one OpenMP runtime, torch's thread count, the GIL released ----------------------


@pytest.mark.parametrize("first", ["torch", "vattention"])
def test_one_libgomp_is_mapped_whatever_the_import_order(first):
    code = (
        f"import {first}; import torch, vattention; from vattention import _C; "
        "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    libs = eval(proc.stdout)
    assert len(libs) == 1 and os.path.basename(libs[0]) == "libgomp.so.1", libs


def test_kernel_releases_the_gil():
    # 16 rows of one random row each (randn of the whole 268 MB took most of this test's time)
    kc = torch.randn(1, 4096, 8, 128).repeat(16, 1, 1, 1)
    vc = torch.randn(1, 4096, 8, 128).repeat(16, 1, 1, 1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        q = torch.randn(16, 1, 8, 128)
        seqlens = torch.full((16,), 4096)
        cpu_attention(q, kc, vc, cache_seqlens=seqlens)  # warm: one_call is a warm call's time
        start = time.perf_counter()
        cpu_attention(q, kc, vc, cache_seqlens=seqlens)
        one_call = time.perf_counter() - start
        done = threading.Event()
        ticks = []

        def worker():
            for _ in range(3):
                cpu_attention(q, kc, vc, cache_seqlens=seqlens)
            done.set()

        thread = threading.Thread(target=worker)
        thread.start()
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)
        thread.join()
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        # with the GIL held for a call, this loop would stall for a whole call at least once
        assert len(ticks) > 3 and max(gaps) < max(0.5 * one_call, 0.02), (one_call, max(gaps))
    finally:
        torch.set_num_threads(before)


BOTH = ("avx512bf16", "avx512")


@pytest.mark.parametrize(
    "dtype, cache_dtype, lq, d, group, keys, twins",
    [
        (torch.float32, torch.float32, 40, 64, 4, 300, BOTH),  # fp32: not AMX's, no dot product
        (torch.float16, torch.float16, 40, 64, 4, 300, BOTH),
        (torch.float32, torch.float8_e4m3fn, 40, 64, 4, 300, BOTH),
        (torch.bfloat16, torch.bfloat16, 1, 64, 1, 300, BOTH),  # decode, GQA 1: FMAs in both
        (torch.bfloat16, torch.bfloat16, 1, 80, 4, 300, ("avx512",)),  # d not a multiple of 32
        (torch.bfloat16, torch.bfloat16, 1, 64, 4, 300, ()),  # decode, GQA 4: tile scores
        (torch.bfloat16, torch.bfloat16, 1, 128, 4, 300, ()),
        (torch.bfloat16, torch.bfloat16, 1, 64, 8, 300, ()),  # GQA 8: chunks of 2 heads
        (torch.bfloat16, torch.bfloat16, 1, 64, 4, 120, ("avx512",)),  # rows under 128 keys
        (torch.bfloat16, torch.bfloat16, 40, 80, 4, 300, ("avx512",)),  # d not a multiple of 32
        (torch.bfloat16, torch.bfloat16, 40, 64, 4, 300, ()),  # prefill: the tiles
        (torch.bfloat16, torch.bfloat16, 40, 128, 4, 300, ()),
    ],
)
def test_amx_runs_avx512s_code_but_for_bf16_tiles(dtype, cache_dtype, lq, d, group, keys, twins):
    """The amx variant is avx512's kernel except where bf16 caches with d a multiple of 32 take
    the tiles: prefill items, and the scores of decode items whose tiles hold one token (GQA 4
    and 8: a chunk's heads x rows fill the 16 lanes) over 128 keys or more (decode rows of
    ``keys`` / 2 to ``keys`` tokens here). Everything else gives avx512's output bit
    for bit (QK^T on FMAs over widened K, not avx512bf16's dot product: GQA 1 decode, other head
    sizes), and fp32, fp16 and fp8 caches avx512bf16's too (no dot product there). Outputs equal
    exactly the twins named, so each case also shows which code ran (its accuracy is the
    reference tests')."""
    runnable = {v.name for v in kernel_variants() if v.runnable}
    if not {"amx", *BOTH} <= runnable:
        pytest.skip(
            f"needs the amx, avx512bf16 and avx512 variants; this CPU runs {sorted(runnable)}"
        )
    gen = torch.Generator().manual_seed(31)
    # decode: enough outputs that the FMAs' rounding, not the dot product's, shows in some bf16
    rows, kv_heads = (3, 2) if lq > 1 else (32, 8)
    kc, vc = make_caches(rows, 300, kv_heads, d, cache_dtype, gen=gen)
    q = torch.randn(rows, lq, group * kv_heads, d, generator=gen).to(dtype)
    lens = (
        torch.tensor([0, 100, 250])
        if lq > 1
        else torch.randint(keys // 2, keys - 1, (rows,), generator=gen)
    )
    kw = dict(cache_seqlens=lens, causal=True)
    before = kernel_isa()
    outs = {}
    try:
        for name in ("amx", *BOTH):
            assert _C.set_attention_kernel_isa(name)
            outs[name] = cpu_attention(q, kc, vc, **kw)
    finally:
        _C.set_attention_kernel_isa(before)
    equal = tuple(name for name in BOTH if torch.equal(outs["amx"], outs[name]))
    assert equal == twins


TUNING_CASES = {
    # fp32 decode, one row per KV head, 8 heads x 64 (4 x 128; 16 x 64) in a chunk: intel runs
    # P V in passes of 4 heads (2; 4 passes of 4), other token by token
    "fp32 GQA 1 x 8 x 64": (torch.float32, 1, 8, 64, 1, False),
    "fp32 GQA 1 x 4 x 128": (torch.float32, 1, 4, 128, 1, False),
    "fp32 GQA 1 x 16 x 64": (torch.float32, 1, 16, 64, 1, False),
    "fp32 GQA 1 x 8 x 64, mega": (torch.float32, 1, 8, 64, 1, True),  # and prefetched rows
    "bf16 GQA 1 x 8 x 64": (torch.bfloat16, 1, 8, 64, 1, False),  # intel prefetches the rows
    "fp32 prefill": (torch.float32, 40, 2, 64, 4, False),  # other prefetches each next block
}


@pytest.mark.parametrize("case", list(TUNING_CASES))
def test_the_tunings_give_the_same_bits(isa, threads, case):
    """The kernels' two tunings (intel, other: software prefetches, the order of fp32 decode's
    P V) give the same output bit for bit, each within the reference's bound, on any CPU."""
    dtype, lq, kv_heads, d, group, mega = TUNING_CASES[case]
    gen = torch.Generator().manual_seed(41)
    rows = 6
    kc, vc = make_caches(rows, 700, kv_heads, d, dtype, mega=mega, gen=gen)
    q = torch.randn(rows, lq, group * kv_heads, d, generator=gen).to(dtype)
    kw = dict(cache_seqlens=torch.tensor([1, 130, 255, 300, 513, 640]), causal=True)
    outs = {}
    try:
        for tuning in ("intel", "other"):
            assert _C.set_attention_kernel_tuning(tuning)
            assert _C.attention_kernel_tuning() == tuning
            outs[tuning] = check_against_reference(q, kc, vc, **kw)
    finally:
        assert _C.set_attention_kernel_tuning("")
    assert torch.equal(outs["intel"], outs["other"])


def test_the_tuning_is_the_cpus_unless_set():
    """'' puts back this CPU's tuning (intel on Intel CPUs); an unknown name changes nothing."""
    vendor = "intel" if cpu_vendor() == "GenuineIntel" else "other"
    assert _C.attention_kernel_tuning() == vendor
    assert not _C.set_attention_kernel_tuning("zen4")
    assert _C.attention_kernel_tuning() == vendor
    try:
        other = "other" if vendor == "intel" else "intel"
        assert _C.set_attention_kernel_tuning(other)
        assert _C.attention_kernel_tuning() == other
    finally:
        assert _C.set_attention_kernel_tuning("")
    assert _C.attention_kernel_tuning() == vendor


def test_kernel_variants_are_what_the_build_and_the_cpu_offer():
    """kernel_variants() names every variant, best first; the kernel runs exactly the runnable
    ones (and reports the one it runs), a variant lacks exactly the features Linux does not list
    for this CPU, only amx can be refused by the OS (its tile state, where the CPU has it), and
    without VATTENTION_ATTENTION_ISA the kernel runs the first runnable one."""
    variants = kernel_variants()
    assert [v.name for v in variants] == ["amx", "avx512bf16", "avx512", "avx2", "generic"]
    assert all(not v.refused for v in variants[1:]), variants
    amx = variants[0]
    assert not amx.refused or (amx.compiled and not amx.missing), amx
    before = kernel_isa()
    try:
        for v in variants:
            assert _C.set_attention_kernel_isa(v.name) == v.runnable, v
            if v.runnable:
                assert kernel_isa() == v.name
        assert not _C.set_attention_kernel_isa("sve") and kernel_isa() == "generic"
        assert _C.set_attention_kernel_isa("")
        assert kernel_isa() == next(v.name for v in variants if v.runnable)
    finally:
        _C.set_attention_kernel_isa(before)
    flags = cpu_flags()
    if "fpu" in flags:  # x86 (other CPUs spell their features otherwise)
        for v in variants:
            assert v.missing == tuple(f for f in v.needs if f not in flags), (v, sorted(flags))
    if ISA_ENV not in os.environ:
        assert before == next(v.name for v in variants if v.runnable)
