"""FlashAttention helpers for vattention caches, and a CPU reference with the same signature.

vattention gives each request a contiguous row ``k_cache[slot, :seq_len]`` of a dense tensor
``[max_batch, max_seq, kv_heads, head_dim]``, which is exactly what FlashAttention's
``flash_attn_with_kvcache`` consumes without a block table. The two patterns a serving loop needs:

* :func:`decode` -- one step for many slots: ``cache_batch_idx`` picks each query's slot,
  ``cache_seqlens`` is each slot's length *before* this step, and the new ``k``/``v`` are
  written in place at ``[cache_seqlens, cache_seqlens + new)``; attention then covers
  ``cache_seqlens + new`` keys, causal aligned to the bottom right.
* :func:`prefill` -- the prompt (or a chunk of it, ``start > 0``) of one slot.

Both map no pages: call ``KVCache.step({slot: new_length})`` first, so positions up to the new
length are backed. Both dispatch to ``flash_attn.flash_attn_with_kvcache`` for CUDA tensors when
flash-attn is installed, else to :func:`flash_attn_with_kvcache_reference` (torch SDPA, any
device), which implements the same semantics (GQA, in-place append, ``cache_batch_idx``,
bottom-right causal mask) and reads no key position at or beyond ``cache_seqlens + new``.

Examples
--------
>>> import torch
>>> k_cache = torch.zeros(4, 16, 2, 8); v_cache = torch.zeros(4, 16, 2, 8)
>>> q = torch.randn(2, 1, 4, 8); k = torch.randn(2, 1, 2, 8); v = torch.randn(2, 1, 2, 8)
>>> out = decode(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([3, 0]),
...              cache_batch_idx=torch.tensor([2, 0]))
>>> out.shape, bool(torch.equal(k_cache[2, 3], k[0, 0]))
(torch.Size([2, 1, 4, 8]), True)
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

__all__ = ["decode", "prefill", "flash_attn_with_kvcache_reference", "flash_kernel"]

Kernel = Callable[..., torch.Tensor]


def flash_attn_with_kvcache_reference(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
        cache_seqlens: Union[int, torch.Tensor, None] = None,
        cache_batch_idx: Optional[torch.Tensor] = None,
        softmax_scale: Optional[float] = None, causal: bool = False) -> torch.Tensor:
    """Reference (torch SDPA) of ``flash_attn.flash_attn_with_kvcache`` without paging or rotary.

    Parameters
    ----------
    q : Tensor ``[batch, seqlen_q, heads, head_dim]``
    k_cache, v_cache : Tensor ``[batch_cache, seqlen_cache, kv_heads, head_dim]``
        Updated in place when ``k``/``v`` are given. ``heads`` must be a multiple of ``kv_heads``
        (GQA: query head ``h`` reads KV head ``h // (heads // kv_heads)``).
    k, v : Tensor ``[batch, seqlen_new, kv_heads, head_dim]``, optional
        New keys/values, written at positions ``[cache_seqlens[i], cache_seqlens[i] + seqlen_new)``
        of row ``cache_batch_idx[i]``.
    cache_seqlens : int or Tensor ``[batch]``
        Tokens already in each row *before* the append (default: the full ``seqlen_cache``).
    cache_batch_idx : Tensor ``[batch]``, optional
        Row of the cache for each batch entry (default ``0..batch-1``).
    softmax_scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    causal : bool
        Bottom-right aligned causal mask: query ``j`` sees keys ``t <= j + seqlen_k - seqlen_q``.

    Returns
    -------
    Tensor ``[batch, seqlen_q, heads, head_dim]``

    Examples
    --------
    >>> kc = torch.zeros(1, 8, 1, 4); vc = torch.zeros(1, 8, 1, 4)
    >>> kc[0, :2] = 1.0; vc[0, :2] = torch.tensor([1.0, 3.0]).view(2, 1, 1)
    >>> out = flash_attn_with_kvcache_reference(torch.ones(1, 1, 1, 4), kc, vc, cache_seqlens=2)
    >>> float(out[0, 0, 0, 0])      # equal scores: the mean of the two values
    2.0
    """
    batch, seqlen_q, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    seqlens = _per_batch(cache_seqlens, batch, default=k_cache.shape[1])
    rows = _per_batch(cache_batch_idx, batch, default=None) or list(range(batch))
    new = 0 if k is None else k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = heads // kv_heads
    out = torch.empty_like(q)
    for i, (row, past) in enumerate(zip(rows, seqlens)):
        total = past + new
        if total > k_cache.shape[1]:
            raise ValueError(f"batch entry {i}: {past} cached + {new} new tokens exceed the "
                             f"cache length {k_cache.shape[1]}")
        if k is not None:
            k_cache[row, past:total] = k[i]
            v_cache[row, past:total] = v[i]
        keys = k_cache[row, :total].transpose(0, 1)        # [kv_heads, total, D]: views, no copy
        vals = v_cache[row, :total].transpose(0, 1)
        # GQA without copying K/V: query head h reads KV head h // group, so the group query
        # heads of one KV head become extra query rows of it, ordered (group, position).
        qi = (q[i].view(seqlen_q, kv_heads, group, head_dim).permute(1, 2, 0, 3)
              .reshape(kv_heads, group * seqlen_q, head_dim))
        mask = None
        if causal and seqlen_q > 1:   # one query at the bottom right sees every key: no mask
            q_pos = torch.arange(seqlen_q, device=q.device).view(-1, 1) + (total - seqlen_q)
            mask = (torch.arange(total, device=q.device).view(1, -1) <= q_pos).repeat(group, 1)
        # 4-D inputs: torch's CPU SDPA takes a faster path for them than for 3-D ones
        o = F.scaled_dot_product_attention(qi[None], keys[None], vals[None], attn_mask=mask,
                                           scale=scale)[0]
        if mask is not None:  # flash-attn returns 0 for a query row that sees no key
            o = o.masked_fill(~mask.any(-1).view(1, -1, 1), 0.0)
        out[i] = (o.view(kv_heads, group, seqlen_q, head_dim).permute(2, 0, 1, 3)
                  .reshape(seqlen_q, heads, head_dim))
    return out


def flash_kernel() -> Optional[Kernel]:
    """Return ``flash_attn.flash_attn_with_kvcache`` if flash-attn is importable, else ``None``.

    Examples
    --------
    >>> flash_kernel() is None or callable(flash_kernel())
    True
    """
    try:
        from flash_attn import flash_attn_with_kvcache
    except Exception:  # ImportError, or a CUDA/ABI error raised while loading the extension
        return None
    return flash_attn_with_kvcache


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, cache_seqlens: torch.Tensor, cache_batch_idx: torch.Tensor, *,
           softmax_scale: Optional[float] = None, kernel: Optional[Kernel] = None,
           check_int32_offsets: bool = True) -> torch.Tensor:
    """One decode step over many slots: append ``k``/``v`` in place, attend causally.

    Parameters
    ----------
    q : Tensor ``[n, q_len, heads, head_dim]``
        Queries of ``n`` requests (``q_len`` is 1 for plain decode, more for speculative tokens).
    k_cache, v_cache : Tensor ``[max_batch, max_seq, kv_heads, head_dim]``
        One layer of a vattention cache (``cache.layer(i)``).
    k, v : Tensor ``[n, q_len, kv_heads, head_dim]``
        New keys/values, written at ``[cache_seqlens, cache_seqlens + q_len)`` of each slot.
    cache_seqlens : Tensor ``[n]``
        Tokens each slot held *before* this step (converted to int32).
    cache_batch_idx : Tensor ``[n]``
        Slot of each request (converted to int32); the slots must be distinct.
    softmax_scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    kernel : callable, optional
        ``flash_attn_with_kvcache``-compatible function; default: flash-attn for CUDA tensors
        when installed, else :func:`flash_attn_with_kvcache_reference`.
    check_int32_offsets : bool
        With a kernel other than the reference, refuse slots whose element offset
        ``slot * k_cache.stride(0)`` reaches ``2**31``: flash-attn has an open report of
        ``cache_batch_idx`` writes landing in the wrong row once batch offsets overflow 32 bits
        (Dao-AILab/flash-attention#772), and vattention rows are long (``max_seq_len`` tokens,
        times ``num_layers`` in the mega layout). Pass ``False`` for a kernel known to be safe.

    Returns
    -------
    Tensor ``[n, q_len, heads, head_dim]``

    Examples
    --------
    >>> kc = torch.zeros(2, 8, 1, 4); vc = torch.zeros(2, 8, 1, 4)
    >>> out = decode(torch.randn(1, 1, 2, 4), kc, vc, torch.ones(1, 1, 1, 4),
    ...              torch.full((1, 1, 1, 4), 5.0), torch.tensor([0]), torch.tensor([1]))
    >>> out[0, 0].tolist() == [[5.0] * 4, [5.0] * 4]   # a single key: its value, for each head
    True
    """
    kernel = kernel or _default_kernel(q)
    if check_int32_offsets and kernel is not flash_attn_with_kvcache_reference:
        _check_offsets(k_cache, v_cache, cache_batch_idx)
    return kernel(q, k_cache, v_cache, k=k, v=v, cache_seqlens=_int32(cache_seqlens, q.device),
                  cache_batch_idx=_int32(cache_batch_idx, q.device),
                  softmax_scale=softmax_scale, causal=True)


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, slot: int, *, start: int = 0,
            softmax_scale: Optional[float] = None, kernel: Optional[Kernel] = None,
            check_int32_offsets: bool = True) -> torch.Tensor:
    """Prefill one slot: write the prompt's ``k``/``v`` at ``[start, start + len)``, attend
    causally.

    Parameters
    ----------
    q : Tensor ``[len, heads, head_dim]``
        Queries of the prompt (or of one chunk of it).
    k, v : Tensor ``[len, kv_heads, head_dim]``
    k_cache, v_cache : Tensor ``[max_batch, max_seq, kv_heads, head_dim]``
    slot : int
        The slot (batch row) of the request.
    start : int
        Tokens already cached for this slot (chunked prefill); 0 for a whole prompt.
    softmax_scale, kernel, check_int32_offsets
        As in :func:`decode`.

    Returns
    -------
    Tensor ``[len, heads, head_dim]``

    Examples
    --------
    >>> kc = torch.zeros(2, 8, 1, 4); vc = torch.zeros(2, 8, 1, 4)
    >>> out = prefill(torch.randn(3, 2, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 4), kc, vc, 1)
    >>> out.shape, bool(kc[1, 3:].eq(0).all())
    (torch.Size([3, 2, 4]), True)
    """
    kernel = kernel or _default_kernel(q)
    if check_int32_offsets and kernel is not flash_attn_with_kvcache_reference:
        _check_offsets(k_cache, v_cache, [slot])
    device = q.device
    out = kernel(q.unsqueeze(0), k_cache, v_cache, k=k.unsqueeze(0), v=v.unsqueeze(0),
                 cache_seqlens=_int32([start], device), cache_batch_idx=_int32([slot], device),
                 softmax_scale=softmax_scale, causal=True)
    return out.squeeze(0)


def _default_kernel(q: torch.Tensor) -> Kernel:
    if q.is_cuda:
        flash = flash_kernel()
        if flash is not None:
            return flash
    return flash_attn_with_kvcache_reference


def _check_offsets(k_cache: torch.Tensor, v_cache: torch.Tensor, slots) -> None:
    top = int(torch.as_tensor(slots).max()) if len(slots) else 0
    stride = max(k_cache.stride(0), v_cache.stride(0))
    if top * stride >= 2**31:
        raise ValueError(
            f"slot {top} starts {top * stride} elements into the cache (batch stride {stride}), "
            "beyond 2**31: flash-attn may compute this offset in 32 bits and write another row "
            "(Dao-AILab/flash-attention#772). Use fewer slots or a shorter max_seq_len, the "
            "'layer' layout, or pass check_int32_offsets=False for a kernel known to be safe.")


def _int32(values, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(values, device=device).to(torch.int32)


def _per_batch(values, batch: int, default) -> Optional[list[int]]:
    if values is None:
        return None if default is None else [default] * batch
    if isinstance(values, int):
        return [values] * batch
    out = [int(x) for x in torch.as_tensor(values).reshape(-1).tolist()]
    if len(out) != batch:
        raise ValueError(f"expected {batch} per-batch values, got {len(out)}")
    return out
