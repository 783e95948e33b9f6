"""FlashAttention's ``flash_attn_with_kvcache`` over vattention caches, on CPU and GPU.

vattention gives each request a contiguous row ``k_cache[slot, :seq_len]`` of a dense tensor
``[max_batch, max_seq, kv_heads, head_dim]``, which is exactly what FlashAttention's
``flash_attn_with_kvcache`` consumes without a block table. This module is FlashAttention's
signature over the right kernel for the tensors' device; the kernels themselves live in
:mod:`vattention.attention`.

* :func:`flash_attn_with_kvcache` -- FlashAttention's signature (FA2 arguments plus FA3's varlen
  ``cu_seqlens_q`` and fp8 ``k_descale``/``v_descale``). CUDA tensors go to flash-attn when it is
  installed; CPU tensors go to vattention's native kernel
  (:func:`vattention.attention.cpu_attention`).
* :func:`decode` -- one step for many slots: ``cache_batch_idx`` picks each query's slot,
  ``cache_seqlens`` is each slot's length *before* this step, and the new ``k``/``v`` are
  written in place at ``[cache_seqlens, cache_seqlens + new)``; attention then covers
  ``cache_seqlens + new`` keys, causal aligned to the bottom right.
* :func:`prefill` -- the prompt (or a chunk of it, ``start > 0``) of one slot.
* :func:`flash_attn_with_kvcache_reference` -- the same semantics with torch SDPA, one request at
  a time, on any device (:func:`vattention.attention.reference_attention`): the test oracle.

Also importable from here: :func:`kernel_isa` and :func:`fp8_store_like_vllm` (from
:mod:`vattention.attention`), :func:`flash_kernel`, and the ``Kernel`` and ``IntArg`` types.

None of them maps pages: call ``KVCache.step({slot: new_length})`` first, so positions up to the
new length are backed. None reads a key position at or beyond ``cache_seqlens + new``, nor below a
sliding window's start (those pages may be unmapped). Over a vattention cache's tensors each of
them checks first that every request's keys ``[0, cache_seqlens + new)`` (from the window's start
with ``window_size``) are mapped, and raises :class:`vattention.UnmappedReadError` naming the
request, the row, the length and ``mapped_tokens`` where they are not: a kernel would fault there
(SIGSEGV on the host, an illegal address that poisons the CUDA context on a GPU).

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

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..attention import (
    IntArg,
    Scale,
    cpu_attention,
    fp8_store_like_vllm,
    kernel_isa,
    reference_attention,
    supports,
)
from ..cache_reads import CacheRows, cache_rows

__all__ = [
    "flash_attn_with_kvcache",
    "check_cache_reads",
    "decode",
    "prefill",
    "flash_attn_with_kvcache_reference",
    "flash_kernel",
    "kernel_isa",
    "fp8_store_like_vllm",
    "Kernel",
    "IntArg",
]

# A function with flash_attn_with_kvcache's signature (decode's and prefill's ``kernel``).
Kernel = Callable[..., torch.Tensor]


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    cache_seqlens: IntArg = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    k_descale: Scale = None,
    v_descale: Scale = None,
    *,
    prefix_groups: Optional[torch.Tensor] = None,
    prefix_lens: Optional[torch.Tensor] = None,
    check_reads: bool = True,
) -> torch.Tensor:
    """Attention of a batch of queries over dense KV caches, appending new keys in place.

    FlashAttention's ``flash_attn_with_kvcache`` (no rotary, no paged block table). CPU tensors
    run vattention's native kernel (:func:`vattention.attention.cpu_attention`) on
    ``torch.get_num_threads()`` threads with the GIL released; CUDA tensors run flash-attn when it
    is installed (:func:`flash_kernel`), else the reference; other devices the reference.

    Parameters
    ----------
    q : Tensor ``[n, seqlen_q, heads, head_dim]``, or ``[total_q, heads, head_dim]`` with
        ``cu_seqlens_q``
        float32, bfloat16 or float16.
    k_cache, v_cache : Tensor ``[batch_cache, seqlen_cache, kv_heads, head_dim]``
        Any strides with a contiguous last dimension (a vattention ``layer`` or ``mega`` view).
        q's dtype, or ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (see ``k_descale``).
        ``heads`` must be a multiple of ``kv_heads`` (GQA: query head ``h`` reads KV head
        ``h // (heads // kv_heads)``).
    k, v : Tensor, optional
        New keys/values in q's dtype: ``[n, seqlen_new, kv_heads, head_dim]``, or
        ``[total_q, kv_heads, head_dim]`` aligned with q's tokens when ``cu_seqlens_q`` is
        given. Written at positions ``[cache_seqlens[i], cache_seqlens[i] + new_i)`` of row
        ``cache_batch_idx[i]`` before attention (rows must be distinct).
    cache_seqlens : int or int Tensor ``[n]``
        Tokens in each row *before* the append. Default (only without ``k``/``v``): the full
        ``seqlen_cache``. Request i attends over ``cache_seqlens[i] + new_i`` keys.
    cache_batch_idx : int Tensor ``[n]``, optional
        Row of the cache for each request (default ``0..n-1``).
    cu_seqlens_q : int Tensor ``[n + 1]``, optional
        Varlen form (FA3): request i's queries are ``q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]``.
    max_seqlen_q : int, optional
        Accepted for FA3 compatibility; the CPU kernel does not need it.
    softmax_scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    causal : bool
        Bottom-right aligned causal mask: query ``j`` of a request with ``Lq`` queries and ``Lk``
        keys sees keys ``t <= j + Lk - Lq``.
    window_size : (int, int)
        Sliding window ``(left, right)`` in absolute positions, -1 = unlimited: the query at
        position ``p = j + Lk - Lq`` sees keys ``[p - left, p + right]`` (``right`` is 0 when
        causal). Mistral's window ``W`` is ``(W - 1, 0)``.
    k_descale, v_descale : float or one-element Tensor, optional
        fp8 caches only (FA3 naming, per tensor, default 1): a cache value is the stored fp8
        number times the descale. New keys are stored as vLLM 0.32's CPU backend stores them:
        ``k * (1 / k_descale)``, clamped to the format's largest finite value (448 for e4m3fn,
        57344 for e5m2), mantissa truncated toward zero.
    prefix_groups, prefix_lens : int Tensor ``[n]``, optional, keyword only (vattention's own)
        A hint for the CPU kernel that never changes the result: requests with the same
        ``prefix_groups[i] >= 0`` hold the same K/V at positions ``[0, min(prefix_lens[i],
        prefix_lens[j]))`` of their rows (-1: no group), as prefix-cache hits give. The kernel
        then reads that prefix once per KV head for all the group's decode queries that see all
        of it (cascade attention), instead of once per request. The caller vouches for the
        sameness; a wrong hint gives wrong output. CUDA and the reference ignore it.
    check_reads : bool, keyword only (vattention's own)
        Over a vattention cache's tensors, first check that every request's keys are mapped
        (:func:`check_cache_reads`; default). ``False`` skips it, for a caller that stepped the
        cache to these very lengths itself (the vLLM plugin): on CUDA the check copies the
        lengths to the host, one synchronization per call.

    Returns
    -------
    Tensor shaped like q, in q's dtype. A query that sees no key gets zeros.

    Raises
    ------
    TypeError
        A dtype outside the ones above, or a float/bool where integers are due.
    ValueError
        A shape, stride, device or value out of range (the message names the argument); the
        caches are left unmodified.
    vattention.UnmappedReadError
        (a ValueError) Over a vattention cache: a request would read keys its row has no page
        for (``cache_seqlens + new`` past ``mapped_tokens``, or below a released window start);
        nothing was written. With CUDA lengths this check copies them to the host (one
        synchronization); it is skipped while a CUDA graph is being captured.

    Examples
    --------
    Mixed batch, varlen form: a prefill chunk of 3 tokens beside a decode of 1.

    >>> kc = torch.zeros(2, 16, 1, 8); vc = torch.zeros(2, 16, 1, 8)
    >>> q = torch.randn(4, 2, 8); k = torch.randn(4, 1, 8); v = torch.randn(4, 1, 8)
    >>> out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=torch.tensor([5, 0]),
    ...                               cache_batch_idx=torch.tensor([1, 0]),
    ...                               cu_seqlens_q=torch.tensor([0, 3, 4]), causal=True)
    >>> out.shape, bool(torch.equal(kc[1, 5:8], k[:3])), bool(torch.equal(kc[0, 0], k[3]))
    (torch.Size([4, 2, 8]), True, True)
    >>> bool(torch.equal(out[3], v[3].expand(2, 8)))   # the decode's one key: its value
    True

    Two decode rows over one shared 32-token prefix (rows 0 and 1 hold the same first 32 keys):

    >>> kc = torch.randn(2, 48, 1, 8); vc = torch.randn(2, 48, 1, 8)
    >>> kc[1, :32] = kc[0, :32]; vc[1, :32] = vc[0, :32]
    >>> q = torch.randn(2, 1, 2, 8); lens = torch.tensor([40, 45])
    >>> plain = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
    >>> hinted = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True,
    ...                                  prefix_groups=torch.tensor([0, 0]),
    ...                                  prefix_lens=torch.tensor([32, 32]))
    >>> bool(torch.allclose(plain, hinted, atol=1e-6))
    True
    """
    if check_reads:
        check_cache_reads(
            q, k_cache, v_cache, k, cache_seqlens, cache_batch_idx, cu_seqlens_q, window_size
        )
    fa_args = (
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens,
        cache_batch_idx,
        cu_seqlens_q,
        max_seqlen_q,
        softmax_scale,
        causal,
        window_size,
        k_descale,
        v_descale,
    )
    if q.device.type == "cuda":
        flash = flash_kernel()
        if flash is None:
            return flash_attn_with_kvcache_reference(*fa_args)
        extra: Dict[str, Any] = {
            name: value
            for name, value in (
                ("cu_seqlens_q", cu_seqlens_q),
                ("max_seqlen_q", max_seqlen_q),
                ("k_descale", k_descale),
                ("v_descale", v_descale),
            )
            if value is not None
        }
        if tuple(window_size) != (-1, -1):
            extra["window_size"] = tuple(window_size)
        return flash(
            q,
            k_cache,
            v_cache,
            k=k,
            v=v,
            cache_seqlens=cache_seqlens,
            cache_batch_idx=cache_batch_idx,
            softmax_scale=softmax_scale,
            causal=causal,
            **extra,
        )
    if q.device.type != "cpu":
        return flash_attn_with_kvcache_reference(*fa_args)
    # max_seqlen_q is FA3's launch hint; the CPU kernel reads the lengths from cu_seqlens_q.
    return cpu_attention(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx,
        cu_seqlens_q=cu_seqlens_q,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        k_descale=k_descale,
        v_descale=v_descale,
        prefix_groups=prefix_groups,
        prefix_lens=prefix_lens,
    )


def flash_attn_with_kvcache_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    cache_seqlens: IntArg = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    k_descale: Scale = None,
    v_descale: Scale = None,
    *,
    prefix_groups: Optional[torch.Tensor] = None,
    prefix_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reference (torch SDPA) of :func:`flash_attn_with_kvcache`: same arguments and semantics.

    FlashAttention's signature over :func:`vattention.attention.reference_attention`: one SDPA
    call per request, in q's dtype (any dtype, any device); fp8 caches are dequantized before
    SDPA, and new keys are written with the CPU kernel's rounding.

    Parameters
    ----------
    q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cu_seqlens_q, max_seqlen_q,
    softmax_scale, causal, window_size, k_descale, v_descale
        As in :func:`flash_attn_with_kvcache` (``max_seqlen_q`` is accepted and not needed).
    prefix_groups, prefix_lens
        Accepted and ignored (a hint for the CPU kernel's speed).

    Returns
    -------
    Tensor shaped like q.

    Examples
    --------
    >>> kc = torch.zeros(1, 8, 1, 4); vc = torch.zeros(1, 8, 1, 4)
    >>> kc[0, :2] = 1.0; vc[0, :2] = torch.tensor([1.0, 3.0]).view(2, 1, 1)
    >>> out = flash_attn_with_kvcache_reference(torch.ones(1, 1, 1, 4), kc, vc, cache_seqlens=2)
    >>> float(out[0, 0, 0, 0])      # equal scores: the mean of the two values
    2.0
    """
    check_cache_reads(
        q, k_cache, v_cache, k, cache_seqlens, cache_batch_idx, cu_seqlens_q, window_size
    )
    return reference_attention(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx,
        cu_seqlens_q=cu_seqlens_q,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        k_descale=k_descale,
        v_descale=v_descale,
    )


def flash_kernel() -> Optional[Kernel]:
    """Return ``flash_attn.flash_attn_with_kvcache`` if flash-attn is importable, else ``None``.

    Examples
    --------
    >>> flash_kernel() is None or callable(flash_kernel())
    True
    """
    try:
        from flash_attn import flash_attn_with_kvcache as flash
    except Exception:  # ImportError, or a CUDA/ABI error raised while loading the extension
        return None
    return flash


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cache_batch_idx: torch.Tensor,
    *,
    softmax_scale: Optional[float] = None,
    kernel: Optional[Kernel] = None,
    check_int32_offsets: bool = True,
) -> torch.Tensor:
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
        when installed, :func:`flash_attn_with_kvcache` (the native kernel) for CPU tensors of
        float32/bfloat16/float16, else :func:`flash_attn_with_kvcache_reference`.
    check_int32_offsets : bool
        With flash-attn or another outside kernel, refuse slots whose element offset
        ``slot * k_cache.stride(0)`` reaches ``2**31``: flash-attn has an open report of
        ``cache_batch_idx`` writes landing in the wrong row once batch offsets overflow 32 bits
        (Dao-AILab/flash-attention#772), and vattention rows are long (``max_seq_len`` tokens,
        times ``num_layers`` in the mega layout). vattention's own kernels compute offsets in 64
        bits and are never restricted. Pass ``False`` for a kernel known to be safe.

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
    kernel = kernel or _default_kernel(q, k_cache)
    if check_int32_offsets and kernel not in _OWN_KERNELS:
        _check_offsets(k_cache, v_cache, cache_batch_idx)
    if kernel not in _CHECKING_KERNELS:
        check_cache_reads(q, k_cache, v_cache, k, cache_seqlens, cache_batch_idx)
    return kernel(
        q,
        k_cache,
        v_cache,
        k=k,
        v=v,
        cache_seqlens=_int32(cache_seqlens, q.device),
        cache_batch_idx=_int32(cache_batch_idx, q.device),
        softmax_scale=softmax_scale,
        causal=True,
    )


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: int,
    *,
    start: int = 0,
    softmax_scale: Optional[float] = None,
    kernel: Optional[Kernel] = None,
    check_int32_offsets: bool = True,
) -> torch.Tensor:
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
    kernel = kernel or _default_kernel(q, k_cache)
    if check_int32_offsets and kernel not in _OWN_KERNELS:
        _check_offsets(k_cache, v_cache, [slot])
    if kernel not in _CHECKING_KERNELS:
        check_cache_reads(q[None], k_cache, v_cache, k[None], [start], [slot])
    device = q.device
    out = kernel(
        q.unsqueeze(0),
        k_cache,
        v_cache,
        k=k.unsqueeze(0),
        v=v.unsqueeze(0),
        cache_seqlens=_int32([start], device),
        cache_batch_idx=_int32([slot], device),
        softmax_scale=softmax_scale,
        causal=True,
    )
    return out.squeeze(0)


# vattention's own kernels compute row offsets in 64 bits: no int32 check for them.
_OWN_KERNELS = (
    flash_attn_with_kvcache,
    flash_attn_with_kvcache_reference,
    cpu_attention,
    reference_attention,
)


# The functions that run check_cache_reads themselves.
_CHECKING_KERNELS = (flash_attn_with_kvcache, flash_attn_with_kvcache_reference)


def check_cache_reads(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    cache_seqlens: IntArg = None,
    cache_batch_idx: IntArg = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    window_size: Tuple[int, int] = (-1, -1),
) -> None:
    """Raise :class:`vattention.UnmappedReadError` if a kernel called with these
    :func:`flash_attn_with_kvcache` arguments would read a vattention cache row past its mapped
    tokens (or below a released sliding-window start).

    Request ``i`` reads keys ``[0, cache_seqlens[i] + new_i)`` of row ``cache_batch_idx[i]``
    (from ``p - left`` with ``window_size = (left, right)``, ``p`` its first query's position).
    Caches that are not a vattention cache's tensors cost one lookup and are not checked;
    arguments the kernels refuse themselves (counts that do not match, a row outside the tensor,
    non-integer lengths) are left to them. CUDA lengths are copied to the host (one
    synchronization); under CUDA graph capture nothing is checked (the graph's replays read the
    lengths of their own time).

    Examples
    --------
    >>> import torch
    >>> check_cache_reads(torch.zeros(1, 1, 1, 8), torch.zeros(1, 4, 1, 8),
    ...                   torch.zeros(1, 4, 1, 8), cache_seqlens=4)   # plain tensors: nothing
    """
    views: List[CacheRows] = []
    for cache in (k_cache, v_cache):
        rows = cache_rows(cache) if isinstance(cache, torch.Tensor) else None
        if rows is not None and not any(rows.same_rows(seen) for seen in views):
            views.append(rows)
    if not views:
        return
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    windowed = any(view.windowed for view in views)
    plan = _reads(
        q, k_cache, k, cache_seqlens, cache_batch_idx, cu_seqlens_q, window_size, windowed
    )
    if plan is None:
        return
    rows, ends, begins = plan
    for view in views:
        view.check(rows, ends, begins)


def _reads(q, k_cache, k, cache_seqlens, cache_batch_idx, cu_seqlens_q, window_size, windowed):
    """(rows, key ends, first keys or None) per request, or None where the kernel's own argument
    checks refuse the call (they name the argument). First keys only for ``windowed`` caches:
    elsewhere every key from token 0 is mapped if the last is."""
    if cu_seqlens_q is not None:
        cu = _host_ints(cu_seqlens_q)
        if cu is None or len(cu) < 1:
            return None
        q_lens: Optional[List[int]] = [b - a for a, b in zip(cu, cu[1:])]
        n = len(cu) - 1
    else:
        if q.dim() != 4:
            return None
        q_lens, n = None, q.shape[0]
    if cache_seqlens is None:
        seqlens: Optional[List[int]] = [k_cache.shape[1]] * n
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        seqlens = [cache_seqlens] * n
    else:
        seqlens = _host_ints(cache_seqlens)
    rows = list(range(n)) if cache_batch_idx is None else _host_ints(cache_batch_idx)
    if seqlens is None or rows is None or len(seqlens) != n or len(rows) != n:
        return None
    if n and (min(rows) < 0 or max(rows) >= k_cache.shape[0]):
        return None
    if k is None:
        ends = seqlens
    elif q_lens is not None:  # varlen: k holds each request's new tokens, aligned with q's
        ends = [s + a for s, a in zip(seqlens, q_lens)]
    else:
        added = k.shape[1] if k.dim() == 4 else 0
        ends = [s + added for s in seqlens] if added else seqlens
    if not windowed:
        return rows, ends, None
    left = window_size[0] if isinstance(window_size, (tuple, list)) and window_size else -1
    if not isinstance(left, int) or left < 0:  # no window: every key from token 0
        return rows, ends, [0] * n
    lens_q = q_lens if q_lens is not None else [q.shape[1]] * n
    return rows, ends, [max(0, e - lq - left) for e, lq in zip(ends, lens_q)]


def _host_ints(values) -> Optional[List[int]]:
    """A 1-D integer tensor or a sequence of ints as a list (a CUDA tensor is copied: a
    synchronization), or None for anything else."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
            return None
        return values.tolist()
    try:
        out = list(values)
    except TypeError:
        return None
    if any(isinstance(x, bool) or not isinstance(x, int) for x in out):
        return None
    return out


def _default_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> Kernel:
    if q.is_cuda:
        flash = flash_kernel()
        if flash is not None:
            return flash
        return flash_attn_with_kvcache_reference
    if supports(q, k_cache):
        return flash_attn_with_kvcache
    return flash_attn_with_kvcache_reference


def _check_offsets(k_cache: torch.Tensor, v_cache: torch.Tensor, slots) -> None:
    top = int(torch.as_tensor(slots).max()) if len(slots) else 0
    stride = max(k_cache.stride(0), v_cache.stride(0))
    if top * stride >= 2**31:
        raise ValueError(
            f"slot {top} starts {top * stride} elements into the cache (batch stride {stride}), "
            "beyond 2**31: flash-attn may compute this offset in 32 bits and write another row "
            "(Dao-AILab/flash-attention#772). Use fewer slots or a shorter max_seq_len, the "
            "'layer' layout, or pass check_int32_offsets=False for a kernel known to be safe."
        )


def _int32(values, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(values, device=device).to(torch.int32)
