"""How far the CPU attention kernel's output may be from the exact result: a bound derived from
the kernel's arithmetic, the same on every CPU and every variant (nothing fitted on a machine).

The tests hand the kernel q, K and V already in their storage dtypes (fp32, bf16, fp16, or fp8
with a descale), and the oracle is :func:`vattention.attention.reference_attention` in float64 on
exactly those values (16-bit and fp8 values upcast exactly, fp8 times its descale in float64). So
the rounding of q/k/v to bf16 is the test's input, not an error: what the bound covers is the
kernel's fp32 arithmetic and its final rounding to q's dtype.

What each variant does in which precision (csrc/attention: isa_kernels.h, vec_*.h, convert.h,
attention.cpp). Every variant keeps every intermediate in fp32; they differ in order only:

============  =====================================================================================
QK^T          fp32 on q pre-scaled by c' = fl(fl(softmax_scale) fl(log2 e)) (x k_descale for fp8),
              16-bit and fp8 K widened exactly. Decode: ceil(d / W) multiply-adds per lane, W = 16
              (avx512*) or 8 (avx2, generic), then a lane sum (4 or 3 levels; generic: 7 adds in a
              row). Prefill: one accumulator per score over all d. generic multiplies and adds
              (two roundings), avx2/avx512 fuse them (FMA). avx512bf16, bf16 K: vdpbf16ps on q and
              K as they are (products exact, two fp32 additions per instruction, denormal inputs
              and results flushed to zero), the scores then multiplied by c'. amx, bf16 q and cache,
              d a multiple of 32 (prefill and shared-prefix items, and decode items whose tiles
              hold one token, where the other heads' lanes add exact zeros): TDPBF16PS tiles,
              the same products, accumulated in two chains of 16 per instruction, summed, then
              added to the score (at most 18 + d / 32 roundings), denormals flushed as
              vdpbf16ps does, then scaled by c' (decode: a multiply; prefill: in exp2's
              argument).
softmax       base 2: p = exp2(s - m), running max m per block of >= 16 keys, earlier sums
              rescaled by exp2(m_old - m_new) (amx: a tile of 16 rows keeps its m while a
              block's p stay <= 2^16; m is then one key's score, below the max, and l >= 1
              still); exp2 is a degree-6 polynomial (avx2, avx512*: relative error 1.34 u at
              most over 2e8 points of [-0.5, 0.5]) or std::exp2 (generic, < 1 ulp); results
              below 2^-126 are 0. Key splits (flash-decoding, shared prefixes)
              are merged by weights exp2(m_part - m_max), in fp32.
P V           fp32 multiply-adds on V widened exactly (never on bf16 probabilities), sum of
              weights l in fp32; out = acc * fl(v_descale / l). amx (prefill and shared-prefix
              items' tiles; its decode's P V is the vector code's): each
              probability p split into two bf16 terms, hi = p truncated to bf16 and
              lo = bf16(p - hi), both
              multiplied by V in TDPBF16PS tiles (exact products, fp32 sums as above); l sums
              the fp32 p.
output        rounded to nearest even to q's dtype (convert.h, vec_*.h stores), once.
============  =====================================================================================

The bound. Per output row (one query token and head) seeing N keys, with u = 2^-24 and
gamma(n) = n u / (1 - n u) (a sum of n terms in fp32, in any order, errs by at most
gamma(n) sum |terms|): c = softmax_scale log2(e), s_j = c q.K_j the exact base-2 scores,
w_j = 2^(s_j - max s) / sum 2^(s - max s) the exact weights, o = sum_j w_j V_j, A = sum_j w_j |V_j|
(per element of head_dim: the oracle on |V|), and S >= |c| sum_x |q_x K_jx| for every key j (here
S = |c| |q|_2 max_j |K_j|_2, Cauchy-Schwarz).

1. Scores. Each product q_x K_jx passes at most d + 15 roundings of the dot product (the longest
   chain: prefill's d, or decode's ceil(d / W) plus the lane sum, at most d + 15 for d < W; amx's
   18 + d / 32 - 1), one for q x c' (or score x c'), and c' itself is c times (1 + theta_5) (five
   fp32 roundings: softmax_scale, log2 e, their product, k_descale, x k_descale). So
   |s'_j - s_j| <= e_s = gamma(d + 22) S + c 2^-126 (d M + d + 22), the last term for the
   denormals vdpbf16ps and TDPBF16PS flush: an input below 2^-126 read as 0 loses at most
   2^-126 M of its product (M = max(1, max |q_x|, max |K_jx|)), a sum below 2^-126 flushed at
   most 2^-126 per rounding.
2. Weights. The kernel's weight of key j relative to the others is 2^(s'_j - s_j) (a common
   factor 2^(s'_max - s_max) cancels in the normalization) times the rounding of s'_j - m (one
   rounding of a difference <= 2 (S + e_s)), of the rescales' exponents (their differences
   telescope: at most 2 (S + e_s) in all), of the partials' merge (2 (S + e_s) again), and
   (1 + eps) per exp2, eps = 4 u, for its own exp2, at most R = ceil(N / 16) + 1 rescales and the
   merge. So every weight is w_j (1 + eta_j) up to normalization, |eta_j| <= eta =
   2^(e_s + 6 u (S + e_s)) (1 + eps)^(R + 2) - 1, and the normalized result moves by
   |sum_j w_j eta_j (V_j - o)| / (1 - eta) <= 2 eta / (1 - eta) A.
3. Sums. l and acc pass at most n = N + R + 2 * 128 + 20 roundings per term (the keys, the
   rescales, the merge of up to 2 x 64 partials, and the lane sums, 8 at most, or the 18
   roundings an amx term passes inside its first TDPBF16PS beyond one per later instruction),
   and out32 = acc * fl(vd / l) three more: |out32 - o'| <= (2 gamma(n) / (1 - gamma(n))
   (1 + gamma(3)) H + gamma(3)) A', with o' the normalized result of step 2, A' = sum w'|V| <=
   A (1 + eta) / (1 - eta), and H = 1 + 2^-7 (1 + 2^-8) the terms' magnitudes per unit of
   weight (1 where p V is one fp32 term; amx's hi and lo terms: |hi| <= p, |lo| <=
   2^-7 (1 + 2^-8) p).
3a. amx's split. hi + lo = p (1 + delta), |delta| <= 2^-15 (p - hi is exact in fp32 and below
   2^-7 p, hi being p truncated to bf16's 8 bits; lo rounds it to bf16, within 2^-8 of it), while
   l sums the fp32 p: the numerator's weights are off by delta_j from the denominator's, which
   moves the result by at most 2^-15 A'.
3b. Flushes. Per key at most 2^-126 (max |V| + 1): a weight below 2^-126 is 0 (exp2), or amx's
   lo term below 2^-126 is read as 0 (2^-126 |V_j| either way), and amx reads a denormal V as 0
   (2^-126 p_j <= 2^-126 l); and amx flushes a P V sum below 2^-126 at most 2^-126 per rounding,
   at most 68 roundings (two instructions of 34) per chunk of 32 keys, ceil(N / 32) + ceil(N /
   128) chunks (each block's last one padded), and R rescales: <= 3 N + 68 + R roundings. acc's
   absolute errors reach the output divided by l >= 1 (the key whose score is m weighs 1; vd
   is 1 on the bf16 caches amx runs).
4. Output. Rounding out32 to nearest in q's dtype adds at most u_out |out32| + t_out: u_out =
   2^-8 (bf16), 2^-11 (fp16), 0 (fp32: counted in 3), t_out half the smallest subnormal.

So |out - o| <= B = E + u_out (|o| + E) + t_out, E the sum of steps 2 and 3 (3a and 3b: every
variant's bound has them, so that it is the same on all). The float64
oracle's own error is the same expression with 2^-53 for u: it is folded in by evaluating gamma
with u + 2^-53. For d = 128, N = 1000, unit-normal q, K, V: S ~ 20, eta ~ 1.2e-4, E ~ 4e-4 A, so a
bf16 output may be off by its own rounding (3.9e-3 |o|) plus about 4e-4 A, and an fp32 output by
about 4e-4 A: a worst case over every order of the additions, reached by no real input, but one
a kernel that drops a key, rounds its probabilities or accumulates to 16 bits, or rounds its
output any other way than once to nearest, exceeds (tests/test_attention_kernel.py shows each).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from vattention.attention import reference_attention

U = 2.0**-24  # fp32 unit roundoff
U_ORACLE = 2.0**-53  # float64's, for the oracle's own error
EXP2_ERROR = 4 * U  # per exp2 (the polynomial's 1.34 u, glibc's < 1 ulp, with room)
MIN_BLOCK_KEYS = 16  # the kernel's smallest key block (attention.cpp: block_keys)
MAX_PARTIALS = 2 * 64  # kMaxSplits parts of a shared prefix plus as many of a row's own keys
DOT_CHAIN = 22  # roundings of a score beyond d (see the module docstring, step 1)
SUM_EXTRA = 20  # roundings of a P V term beyond keys, rescales and merges (step 3)
SPLIT = 2.0**-15  # amx: relative error of hi + lo, a probability's two bf16 terms (step 3a)
SPLIT_TERMS = 1 + 2.0**-7 * (1 + 2.0**-8)  # amx: |hi| + |lo| per unit of probability (step 3)
FLUSH = 2.0**-126  # fp32's smallest normal: below it vdpbf16ps and exp2 give 0
# rounding of the output to q's dtype: unit roundoff, and half the smallest subnormal
OUTPUT_ROUNDING = {
    torch.float32: (0.0, 2.0**-150),
    torch.bfloat16: (2.0**-8, 2.0**-134),
    torch.float16: (2.0**-11, 2.0**-25),
}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def gamma(n: torch.Tensor | float) -> torch.Tensor | float:
    """gamma(n) = n u / (1 - n u) with u = fp32's unit roundoff plus float64's (the oracle)."""
    nu = n * (U + U_ORACLE)
    return nu / (1 - nu)


def _magnitudes(cache: torch.Tensor) -> torch.Tensor:
    """|cache| in its own dtype (exact; fp8: the sign bit cleared)."""
    if cache.dtype in FP8:
        return (cache.view(torch.uint8) & 0x7F).view(cache.dtype)
    return cache.abs()


def _exact(x: torch.Tensor, descale) -> torch.Tensor:
    """Cache values as float64 (fp8: stored number x descale)."""
    y = x.to(torch.float64)
    return y * float(descale) if x.dtype in FP8 and descale is not None else y


def _requests(q, k_cache, k, cache_seqlens, cache_batch_idx, cu_seqlens_q):
    """(query span as a tuple of indices into q, cache row, keys) per request, after the append."""
    if cu_seqlens_q is not None:
        cu = [int(x) for x in torch.as_tensor(cu_seqlens_q).tolist()]
        spans: List[Tuple[int, ...]] = [(a, b) for a, b in zip(cu, cu[1:])]
        new = [b - a if k is not None else 0 for a, b in spans]
        n = len(spans)
    else:
        n = q.shape[0]
        spans = [(i,) for i in range(n)]
        new = [k.shape[1] if k is not None else 0] * n
    if cache_seqlens is None:
        past = [k_cache.shape[1]] * n
    elif isinstance(cache_seqlens, int):
        past = [cache_seqlens] * n
    else:
        past = [int(x) for x in torch.as_tensor(cache_seqlens).reshape(-1).tolist()]
    rows = (
        list(range(n))
        if cache_batch_idx is None
        else [int(x) for x in torch.as_tensor(cache_batch_idx).tolist()]
    )
    return [(spans[i], rows[i], past[i] + new[i]) for i in range(n)]


def reference_and_bound(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    **kw,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The exact result (float64) of the kernel's call, and the bound on its error, per element.

    Takes :func:`vattention.attention.cpu_attention`'s arguments; like the kernel, appends k and v
    to the caches (give it copies). q's dtype is the kernel's output dtype.
    """
    q64 = q.to(torch.float64)
    want = reference_attention(q64, k_cache, v_cache, k, v, **kw)
    kd, vd = kw.get("k_descale"), kw.get("v_descale")
    reqs = _requests(
        q, k_cache, k, kw.get("cache_seqlens"), kw.get("cache_batch_idx"), kw.get("cu_seqlens_q")
    )
    same = {
        name: kw[name]
        for name in (
            "cache_batch_idx",
            "cu_seqlens_q",
            "softmax_scale",
            "causal",
            "window_size",
            "k_descale",
            "v_descale",
        )
        if name in kw
    }
    totals = torch.tensor([total for _, _, total in reqs], dtype=torch.int64)
    # A = sum_j w_j |V_j|: the oracle over |V| (the caches now hold the appended keys)
    v_abs = _magnitudes(v_cache)
    a = reference_attention(q64, k_cache, v_abs, cache_seqlens=totals, **same)
    d = q.shape[-1]
    heads, kv_heads = q.shape[-2], k_cache.shape[2]
    scale = kw.get("softmax_scale")
    # |c|: a negative scale (finite, so the kernel takes it) bounds the scores' magnitudes alike
    c = abs(1.0 / math.sqrt(d) if scale is None else float(scale)) * math.log2(math.e)
    s = torch.zeros(q.shape[:-1], dtype=torch.float64)  # S per row
    n = torch.zeros(q.shape[:-1], dtype=torch.float64)  # keys per row (at most)
    vmax = torch.zeros(q.shape[:-1], dtype=torch.float64)  # max |V| per row
    big = torch.ones(q.shape[:-1], dtype=torch.float64)  # M: max(1, max |q_x|, max |K_jx|)
    for span, row, total in reqs:
        idx = slice(*span) if len(span) == 2 else span[0]
        if total == 0:
            continue
        kmax = _exact(k_cache[row, :total], kd).norm(dim=-1).amax(0)
        s[idx] = c * q64[idx].norm(dim=-1) * kmax.repeat_interleave(heads // kv_heads)
        n[idx] = total
        vmax[idx] = _exact(v_cache[row, :total], vd).abs().max()
        kbig = _exact(k_cache[row, :total], kd).abs().max()
        big[idx] = torch.maximum(q64[idx].abs().amax(-1), kbig).clamp(min=1.0)
    s, n, vmax, big = s.unsqueeze(-1), n.unsqueeze(-1), vmax.unsqueeze(-1), big.unsqueeze(-1)
    e_s = gamma(d + DOT_CHAIN) * s + c * FLUSH * (d * big + d + DOT_CHAIN)
    rescales = torch.ceil(n / MIN_BLOCK_KEYS) + 1
    eta = torch.exp2(e_s + 6 * (U + U_ORACLE) * (s + e_s)) * (1 + EXP2_ERROR) ** (rescales + 2) - 1
    g = gamma(n + rescales + 2 * MAX_PARTIALS + SUM_EXTRA)
    g3 = gamma(3)
    a_moved = a * (1 + eta) / (1 - eta)  # A'
    flushed = FLUSH * (n * (vmax + 1) + 3 * n + 68 + rescales)  # step 3b
    e = (
        2 * eta / (1 - eta) * a
        + (2 * g / (1 - g) * (1 + g3) * SPLIT_TERMS + g3) * a_moved
        + SPLIT * a_moved
        + flushed
    )
    u_out, t_out = OUTPUT_ROUNDING[q.dtype]
    bound = e + u_out * (want.abs() + e) + t_out
    return want, torch.where(n > 0, bound, torch.zeros_like(bound) + t_out)


def check_within_bound(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str = ""):
    """Asserts |got - want| <= bound everywhere, naming the worst element and its ratio."""
    err = (got.to(torch.float64) - want).abs()
    ratio = err / bound
    worst = int(ratio.argmax()) if ratio.numel() else 0
    assert not (err > bound).any() and not got.isnan().any(), (
        f"{what}: {int((err > bound).sum())} of {err.numel()} outputs outside the derived bound; "
        f"worst at flat index {worst}: got {float(got.reshape(-1)[worst]):.8g}, exact "
        f"{float(want.reshape(-1)[worst]):.8g}, error {float(err.reshape(-1)[worst]):.3g} > "
        f"bound {float(bound.reshape(-1)[worst]):.3g} ({float(ratio.reshape(-1)[worst]):.3g}x)"
    )
