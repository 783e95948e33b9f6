"""The reference of the kernel in torch SDPA: one request at a time, any dtype, any device.

It is the oracle the kernel is tested against (and flash-attn on a GPU), so it favours being
obviously right over being fast: each request's keys are sliced out of its row and handed to
``torch.nn.functional.scaled_dot_product_attention`` with an explicit mask where one is needed.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple, overload

import torch
import torch.nn.functional as F

from .arguments import IntArg, Scale, descale_factor, window_bounds
from .fp8 import FP8_MAX, fp8_store_like_vllm

__all__ = ["reference_attention"]


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    *,
    cache_seqlens: IntArg = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    k_descale: Scale = None,
    v_descale: Scale = None,
    prefix_groups: Optional[torch.Tensor] = None,
    prefix_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`vattention.attention.cpu_attention`'s semantics in torch SDPA, on any device.

    One SDPA call per request, in q's dtype (any dtype, any device). Causal requests whose query
    count equals their key count use SDPA's ``is_causal`` (no mask) when there is no GQA grouping
    (the group's query heads are stacked as extra query rows); others get a boolean mask of the
    visible keys. Keys are read from the first query's window start to ``cache_seqlens + new``
    only. fp8 caches are dequantized (stored * descale) before SDPA, and new keys are written with
    the kernel's rounding (:func:`vattention.attention.fp8_store_like_vllm`).

    Parameters
    ----------
    q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cu_seqlens_q, softmax_scale, causal,
    window_size, k_descale, v_descale
        As in :func:`vattention.attention.cpu_attention`, on any device and in any dtype.
    prefix_groups, prefix_lens
        Accepted and ignored (a hint for the kernel's speed, never for its result).

    Returns
    -------
    Tensor
        Shaped like q, in q's dtype. A query that sees no key gets zeros.

    Raises
    ------
    ValueError
        GQA heads that do not divide, a request that overflows the cache length, ``k`` without
        ``v`` (or ``v`` without ``k``), or ``k``/``v`` without ``cache_seqlens``.

    Examples
    --------
    >>> import torch
    >>> kc = torch.zeros(1, 8, 1, 4); vc = torch.zeros(1, 8, 1, 4)
    >>> kc[0, :2] = 1.0; vc[0, :2] = torch.tensor([1.0, 3.0]).view(2, 1, 1)
    >>> out = reference_attention(torch.ones(1, 1, 1, 4), kc, vc, cache_seqlens=2)
    >>> float(out[0, 0, 0, 0])      # equal scores: the mean of the two values
    2.0
    """
    varlen = cu_seqlens_q is not None
    heads, head_dim = q.shape[-2], q.shape[-1]
    kv_heads = k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    if varlen:
        cu = [int(x) for x in torch.as_tensor(cu_seqlens_q).reshape(-1).tolist()]
        batch = len(cu) - 1
        spans = [(cu[i], cu[i + 1]) for i in range(batch)]
    else:
        batch, seqlen_q = q.shape[0], q.shape[1]
        spans = [(0, seqlen_q)] * batch
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if k is not None and cache_seqlens is None:
        raise ValueError("cache_seqlens is required when k/v are given")
    seqlens = _per_request(cache_seqlens, batch, default=k_cache.shape[1])
    rows = _per_request(cache_batch_idx, batch, default=None) or list(range(batch))
    left, right = window_bounds(window_size)
    if causal:
        right = 0
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    kd = descale_factor(k_descale, "k_descale", k_cache.dtype)
    vd = descale_factor(v_descale, "v_descale", v_cache.dtype)
    group = heads // kv_heads
    out = torch.empty_like(q)
    for i, (row, past) in enumerate(zip(rows, seqlens)):
        a, b = spans[i]
        qi = q[a:b] if varlen else q[i]  # [Lq, H, D]
        new_k = None if k is None else (k[a:b] if varlen else k[i])
        new_v = None if v is None else (v[a:b] if varlen else v[i])
        new = 0 if new_k is None else new_k.shape[0]
        total = past + new
        if total > k_cache.shape[1]:
            raise ValueError(
                f"batch entry {i}: {past} cached + {new} new tokens exceed the "
                f"cache length {k_cache.shape[1]}"
            )
        if new_k is not None and new_v is not None:  # both or neither (checked above)
            k_cache[row, past:total] = _to_cache(new_k, k_cache.dtype, kd)
            v_cache[row, past:total] = _to_cache(new_v, v_cache.dtype, vd)
        lq = qi.shape[0]
        if lq == 0:
            continue
        # visible keys of query j (absolute position p = j + total - lq): [lo_j, hi_j)
        pos = torch.arange(lq, device=q.device) + (total - lq)
        hi = torch.full_like(pos, total) if right < 0 else (pos + right + 1).clamp(max=total)
        lo = torch.zeros_like(pos) if left < 0 else (pos - left).clamp(min=0)
        start = int(lo[0]) if left >= 0 else 0  # first key read
        keys = _from_cache(k_cache[row, start:total], kd, q.dtype).transpose(0, 1)  # [Hkv, T, D]
        vals = _from_cache(v_cache[row, start:total], vd, q.dtype).transpose(0, 1)
        # GQA without copying K/V: the group query heads of one KV head become extra query rows
        # of it, ordered (group, position).
        qh = (
            qi.reshape(lq, kv_heads, group, head_dim)
            .permute(1, 2, 0, 3)
            .reshape(kv_heads, group * lq, head_dim)
        )
        mask, is_causal = None, False
        full = right < 0 and left < 0
        if causal and left < 0 and lq == total and group == 1:
            is_causal = lq > 1  # square, one query row per head: SDPA's causal path
        elif not full or (causal and lq > 1):
            t = torch.arange(start, total, device=q.device).view(1, -1)
            allowed = (t >= lo.view(-1, 1)) & (t < hi.view(-1, 1))
            if not bool(allowed.all()):
                mask = allowed.repeat(group, 1)
        if keys.shape[1] == 0:
            o = torch.zeros(kv_heads, group * lq, head_dim, dtype=q.dtype, device=q.device)
        else:
            # 4-D inputs: torch's CPU SDPA takes a faster path for them than for 3-D ones
            o = F.scaled_dot_product_attention(
                qh[None], keys[None], vals[None], attn_mask=mask, is_causal=is_causal, scale=scale
            )[0]
        if mask is not None:  # flash-attn returns 0 for a query row that sees no key
            o = o.masked_fill(~mask.any(-1).view(1, -1, 1), 0.0)
        res = o.view(kv_heads, group, lq, head_dim).permute(2, 0, 1, 3).reshape(lq, heads, head_dim)
        if varlen:
            out[a:b] = res
        else:
            out[i] = res
    return out


def _from_cache(x: torch.Tensor, descale: float, dtype: torch.dtype) -> torch.Tensor:
    if x.dtype in FP8_MAX:
        # in float32, or in q's dtype where it is wider (a float64 oracle: no fp32 rounding)
        return (x.to(torch.promote_types(dtype, torch.float32)) * descale).to(dtype)
    return x.to(dtype)


def _to_cache(x: torch.Tensor, cache_dtype: torch.dtype, descale: float) -> torch.Tensor:
    """New keys as the cache stores them (fp8: the kernel's, vLLM's, rounding)."""
    if cache_dtype not in FP8_MAX:
        return x.to(cache_dtype)
    # 1 / descale in float32 first, as the kernel multiplies by it (x / descale rounds otherwise)
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(descale, dtype=torch.float32)
    return fp8_store_like_vllm(x.float() * inv.to(x.device), cache_dtype)


@overload
def _per_request(values: IntArg, n: int, default: int) -> List[int]: ...
@overload
def _per_request(values: IntArg, n: int, default: None) -> Optional[List[int]]: ...


def _per_request(values: IntArg, n: int, default: Optional[int]) -> Optional[List[int]]:
    """One integer per request from an int, a sequence or a tensor (``default`` for None)."""
    if values is None:
        return None if default is None else [default] * n
    if isinstance(values, int):
        return [values] * n
    out = [int(x) for x in torch.as_tensor(values).reshape(-1).tolist()]
    if len(out) != n:
        raise ValueError(f"expected {n} per-batch values, got {len(out)}")
    return out
