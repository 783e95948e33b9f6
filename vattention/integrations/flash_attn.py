"""FlashAttention's ``flash_attn_with_kvcache`` over vattention caches, on CPU and GPU.

vattention gives each request a contiguous row ``k_cache[slot, :seq_len]`` of a dense tensor
``[max_batch, max_seq, kv_heads, head_dim]``, which is exactly what FlashAttention's
``flash_attn_with_kvcache`` consumes without a block table.

* :func:`flash_attn_with_kvcache` -- FlashAttention's signature (FA2 arguments plus FA3's varlen
  ``cu_seqlens_q`` and fp8 ``k_descale``/``v_descale``). CUDA tensors go to flash-attn when it is
  installed; CPU tensors go to vattention's native kernel (``csrc/attention``): one call for the
  whole batch, OpenMP threads over (request[, KV head, query block, key split]) items,
  hand-vectorized for AVX-512 (with AVX512-BF16 where present) / AVX2 / any CPU, the new K/V
  appended in place by the same call.
* :func:`decode` -- one step for many slots: ``cache_batch_idx`` picks each query's slot,
  ``cache_seqlens`` is each slot's length *before* this step, and the new ``k``/``v`` are
  written in place at ``[cache_seqlens, cache_seqlens + new)``; attention then covers
  ``cache_seqlens + new`` keys, causal aligned to the bottom right.
* :func:`prefill` -- the prompt (or a chunk of it, ``start > 0``) of one slot.
* :func:`flash_attn_with_kvcache_reference` -- the same semantics with torch SDPA, one request at
  a time, on any device: the test oracle.

None of them maps pages: call ``KVCache.step({slot: new_length})`` first, so positions up to the
new length are backed. None reads a key position at or beyond ``cache_seqlens + new``, nor below a
sliding window's start (those pages may be unmapped).

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
from typing import Callable, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

__all__ = [
    "flash_attn_with_kvcache",
    "decode",
    "prefill",
    "flash_attn_with_kvcache_reference",
    "flash_kernel",
    "kernel_isa",
    "fp8_store_like_vllm",
]

Kernel = Callable[..., torch.Tensor]
IntArg = Union[int, torch.Tensor, Sequence[int], None]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_FP8 = {torch.float8_e4m3fn: (3, 448.0), torch.float8_e5m2: (4, 57344.0)}
_INT32_MAX = 2**31 - 1


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
    k_descale: Union[float, torch.Tensor, None] = None,
    v_descale: Union[float, torch.Tensor, None] = None,
    *,
    prefix_groups: Optional[torch.Tensor] = None,
    prefix_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of a batch of queries over dense KV caches, appending new keys in place.

    FlashAttention's ``flash_attn_with_kvcache`` (no rotary, no paged block table). CPU tensors
    run vattention's native kernel on ``torch.get_num_threads()`` threads with the GIL released;
    CUDA tensors run flash-attn when it is installed (:func:`flash_kernel`), else the reference.

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
    if q.device.type == "cuda":
        flash = flash_kernel()
        if flash is None:
            return flash_attn_with_kvcache_reference(
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
        extra = {
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
        return flash_attn_with_kvcache_reference(
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
    return _cpu_kernel(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens,
        cache_batch_idx,
        cu_seqlens_q,
        softmax_scale,
        causal,
        window_size,
        k_descale,
        v_descale,
        prefix_groups=prefix_groups,
        prefix_lens=prefix_lens,
    )


def kernel_isa() -> str:
    """The instruction set the CPU kernel runs here.

    ``"avx512bf16"`` (AVX-512 with the bf16 dot product), ``"avx512"``, ``"avx2"`` (with FMA and
    F16C) or ``"generic"`` (plain C++), chosen once from the CPU;
    ``VATTENTION_ATTENTION_ISA=<name>`` picks a lower one.

    Examples
    --------
    >>> kernel_isa() in ("avx512bf16", "avx512", "avx2", "generic")
    True
    """
    from .. import _C

    return _C.attention_kernel_isa()


# ---- the native CPU path: argument checks, then one call into csrc/attention.


def _cpu_kernel(
    q,
    k_cache,
    v_cache,
    k,
    v,
    cache_seqlens,
    cache_batch_idx,
    cu_seqlens_q,
    softmax_scale,
    causal,
    window_size,
    k_descale,
    v_descale,
    out: Optional[torch.Tensor] = None,
    prefix_groups=None,
    prefix_lens=None,
) -> torch.Tensor:
    """The CPU path of flash_attn_with_kvcache; `out` (q's shape and dtype, last dimension
    contiguous, any other strides) receives the output in place of a new tensor (the vLLM
    plugin passes its output buffer: no allocation, no copy)."""
    from .. import _C

    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t is not None and t.device.type != "cpu":
            raise ValueError(
                f"{name} is on {t.device}, q on cpu: all tensors must be on one device"
            )
    dtype = q.dtype
    if dtype not in _DTYPE_CODES:
        raise TypeError(
            f"q dtype must be float32, bfloat16 or float16 on CPU, got {dtype} "
            "(flash_attn_with_kvcache_reference takes any dtype)"
        )
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(
            f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share a dtype"
        )
    fp8 = _FP8.get(k_cache.dtype)
    if k_cache.dtype != dtype and fp8 is None:
        raise TypeError(
            f"k_cache/v_cache dtype must be q's ({dtype}) or torch.float8_e4m3fn / "
            f"torch.float8_e5m2, got {k_cache.dtype}"
        )
    cache_code = fp8[0] if fp8 else _DTYPE_CODES[dtype]
    varlen = cu_seqlens_q is not None
    if q.dim() != (3 if varlen else 4):
        want = (
            "[total_q, heads, head_dim] with cu_seqlens_q"
            if varlen
            else "[n, seqlen_q, heads, head_dim]"
        )
        raise ValueError(f"q must be {want}, got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must be [batch_cache, seqlen_cache, kv_heads, head_dim] of one "
            f"shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    batch_cache, seqlen_cache, kv_heads, head_dim = k_cache.shape
    heads = q.shape[-2]
    if q.shape[-1] != head_dim:
        raise ValueError(f"q head_dim {q.shape[-1]} != the cache's head_dim {head_dim}")
    if heads % kv_heads:
        raise ValueError(
            f"q heads ({heads}) must be a multiple of the cache's KV heads ({kv_heads})"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1 and head_dim > 1:
            raise ValueError(
                f"{name} must have a contiguous last dimension (stride 1), got strides "
                f"{tuple(t.stride())}"
            )
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    q = _last_dim_contiguous(q)
    if varlen:
        cu = _int32_tensor(cu_seqlens_q, "cu_seqlens_q")
        n = cu.numel() - 1
        if n < 0:
            raise ValueError("cu_seqlens_q must hold n + 1 >= 1 offsets")
    else:
        n = q.shape[0]
    if k is not None:
        if k.dtype != dtype or v.dtype != dtype:
            raise TypeError(f"k/v dtype must be q's ({dtype}), got {k.dtype} and {v.dtype}")
        if varlen and tuple(k.shape) != (q.shape[0], kv_heads, head_dim):
            raise ValueError(
                f"k must be [total_q, kv_heads, head_dim] = {[q.shape[0], kv_heads, head_dim]} "
                f"(aligned with q's tokens), got {tuple(k.shape)}"
            )
        if not varlen and (
            k.dim() != 4 or k.shape[0] != n or tuple(k.shape[2:]) != (kv_heads, head_dim)
        ):
            raise ValueError(
                f"k must be [n, seqlen_new, kv_heads, head_dim] = [{n}, *, {kv_heads}, "
                f"{head_dim}], got {tuple(k.shape)}"
            )
        if v.shape != k.shape:
            raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required when k/v are given")
    if cache_seqlens is None:
        seqlens = torch.full((n,), seqlen_cache, dtype=torch.int32)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        seqlens = torch.full((n,), cache_seqlens, dtype=torch.int32)
    else:
        seqlens = _int32_tensor(cache_seqlens, "cache_seqlens", n)
    rows = None if cache_batch_idx is None else _int32_tensor(cache_batch_idx, "cache_batch_idx", n)
    if (prefix_groups is None) != (prefix_lens is None):
        raise ValueError("prefix_groups and prefix_lens must be given together")
    if prefix_groups is not None:
        prefix_groups = _int32_tensor(prefix_groups, "prefix_groups", n)
        prefix_lens = _int32_tensor(prefix_lens, "prefix_lens", n)
    left, right = _window(window_size)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    kd, vd = _descale(k_descale, "k_descale", fp8), _descale(v_descale, "v_descale", fp8)
    if out is None:
        out = torch.empty(q.shape, dtype=dtype)
    elif (
        out.shape != q.shape
        or out.dtype != dtype
        or out.device.type != "cpu"
        or (out.stride(-1) != 1 and head_dim > 1)
    ):
        raise ValueError(
            f"out must be a CPU tensor of q's shape {tuple(q.shape)} and dtype {dtype} with a "
            f"contiguous last dimension, got {tuple(out.shape)} {out.dtype} on {out.device} "
            f"with strides {tuple(out.stride())}"
        )
    if n == 0 or (out.numel() == 0 and (k is None or k.numel() == 0)):
        return out
    zero = (0, 0, 0, 0)
    _C.flash_attn_with_kvcache(
        num_requests=n,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=_DTYPE_CODES[dtype],
        cache_dtype=cache_code,
        q=_operand(q, varlen),
        out=_operand(out, varlen),
        k_new=zero if k is None else _operand(k, varlen),
        v_new=zero if v is None else _operand(v, varlen),
        k_cache=_operand(k_cache, False),
        v_cache=_operand(v_cache, False),
        cu_seqlens_q=cu.data_ptr() if varlen else 0,
        seqlen_q=0 if varlen else q.shape[1],
        q_tokens=q.shape[0] if varlen else 0,
        seqlen_new=0 if (k is None or varlen) else k.shape[1],
        cache_batch=batch_cache,
        cache_len=seqlen_cache,
        cache_seqlens=seqlens.data_ptr(),
        cache_batch_idx=0 if rows is None else rows.data_ptr(),
        softmax_scale=scale,
        causal=bool(causal),
        window_left=left,
        window_right=right,
        k_descale=kd,
        v_descale=vd,
        num_threads=torch.get_num_threads(),
        prefix_group=0 if prefix_groups is None else prefix_groups.data_ptr(),
        prefix_len=0 if prefix_lens is None else prefix_lens.data_ptr(),
    )
    return out


def _operand(t: torch.Tensor, varlen: bool) -> Tuple[int, int, int, int]:
    """(data pointer, batch, token, head strides) of a [n, tokens, heads, D] or [tokens, heads,
    D]."""
    s = t.stride()
    if varlen:
        return (t.data_ptr(), 0, s[0], s[1])
    return (t.data_ptr(), s[0], s[1], s[2])


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _int32_tensor(values, name: str, n: Optional[int] = None) -> torch.Tensor:
    """values as a contiguous int32 CPU tensor of n entries, checked to fit int32."""
    if isinstance(values, torch.Tensor):
        t = values
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got {t.dtype}")
    else:
        seq = [values] if isinstance(values, int) else list(values)
        if any(isinstance(x, bool) or not isinstance(x, int) for x in seq):
            raise TypeError(f"{name} must hold integers, got {values!r}")
        t = torch.tensor(seq, dtype=torch.int64)
    if t.dim() != 1 or (n is not None and t.numel() != n):
        raise ValueError(
            f"{name} must be 1-D with {n if n is not None else 'n + 1'} entries, got shape "
            f"{tuple(t.shape)}"
        )
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype != torch.int32:
        if t.numel() and (int(t.min()) < -_INT32_MAX - 1 or int(t.max()) > _INT32_MAX):
            raise ValueError(
                f"{name} values must fit in int32, got range [{int(t.min())}, {int(t.max())}]"
            )
        t = t.to(torch.int32)
    return t.contiguous()


def _window(window_size) -> Tuple[int, int]:
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    for x in (left, right):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"window_size entries must be integers, got {window_size!r}")
        if x < -1:
            raise ValueError(
                f"window_size entries must be >= -1 (-1: unlimited), got {window_size!r}"
            )
    return left, right


def _descale(value, name: str, fp8) -> float:
    if value is None:
        return 1.0
    if fp8 is None:
        raise ValueError(f"{name} applies to fp8 caches only (float8_e4m3fn, float8_e5m2)")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be one value per tensor, got shape {tuple(value.shape)}")
        value = float(value.reshape(()).item())
    x = float(value)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be finite and > 0, got {x}")
    return x


# ---- the reference (torch SDPA, one request at a time, any device).


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
    k_descale: Union[float, torch.Tensor, None] = None,
    v_descale: Union[float, torch.Tensor, None] = None,
    *,
    prefix_groups: Optional[torch.Tensor] = None,
    prefix_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reference (torch SDPA) of :func:`flash_attn_with_kvcache`: same arguments and semantics.

    One SDPA call per request, in q's dtype (any dtype, any device). Causal requests whose query
    count equals their key count use SDPA's ``is_causal`` (no mask) when there is no GQA grouping
    (the group's query heads are stacked as extra query rows); others get a boolean mask of the
    visible keys. Keys are read from the first query's window start to ``cache_seqlens + new``
    only. fp8 caches are dequantized (stored * descale) before SDPA, and new keys are written with
    the same rounding as the CPU kernel (vLLM's; see :func:`flash_attn_with_kvcache`).

    Parameters
    ----------
    q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cu_seqlens_q, max_seqlen_q,
    softmax_scale, causal, window_size, k_descale, v_descale
        As in :func:`flash_attn_with_kvcache`.
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
    if k is not None and cache_seqlens is None:
        raise ValueError("cache_seqlens is required when k/v are given")
    seqlens = _per_batch(cache_seqlens, batch, default=k_cache.shape[1])
    rows = _per_batch(cache_batch_idx, batch, default=None) or list(range(batch))
    left, right = _window(window_size)
    if causal:
        right = 0
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    fp8 = _FP8.get(k_cache.dtype)
    kd, vd = _descale(k_descale, "k_descale", fp8), _descale(v_descale, "v_descale", fp8)
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
        if new_k is not None:
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
    if x.dtype in _FP8:
        return (x.float() * descale).to(dtype)
    return x.to(dtype)


def _to_cache(x: torch.Tensor, cache_dtype: torch.dtype, descale: float) -> torch.Tensor:
    """New keys as the cache stores them (fp8: vLLM 0.32's CPU rounding, see convert.h)."""
    if cache_dtype not in _FP8:
        return x.to(cache_dtype)
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(descale, dtype=torch.float32)
    return fp8_store_like_vllm(x.float() * inv.to(x.device), cache_dtype)


def fp8_store_like_vllm(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values (already divided by the descale) as vLLM 0.32's CPU backend stores them in fp8.

    Clamped to ``[-max, max]`` (NaN to ``+max``), +-0 stored as 0, mantissa truncated toward zero
    (torch's ``.to(float8)`` rounds to nearest instead). Used by the reference and the tests.

    Parameters
    ----------
    v : float32 Tensor
    dtype : ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``

    Returns
    -------
    Tensor of ``dtype``, shaped like ``v``.

    Examples
    --------
    >>> x = torch.tensor([1.1, -1e9, 0.003, -0.0])
    >>> fp8_store_like_vllm(x, torch.float8_e4m3fn).float().tolist()   # truncated, saturated
    [1.0, -448.0, 0.001953125, 0.0]
    """
    code, fmax = _FP8[dtype]
    v = v.float()
    v = torch.where(v < fmax, v, torch.full_like(v, fmax))  # NaN -> +max, as vLLM
    v = torch.where(-fmax < v, v, torch.full_like(v, -fmax))
    u = v.view(torch.int32)
    sign = (u >> 24) & 0x80
    if code == 3:  # e4m3fn
        a = v.abs()
        normal = ((u & 0x7FFFFFFF) - (120 << 23)) >> 20
        sub = torch.round(a * 2.0**29).to(torch.int32) >> 20  # RNE, as the fp32 denormal
        payload = torch.where(a >= 2.0**-6, normal, sub) & 0x7F
        q = torch.where(payload == 0, sign, sign | payload.clamp(max=0x7E))
    else:  # e5m2
        exp = ((u >> 23) & 0xFF) - 127
        man2 = (u >> 21) & 3
        shift = (-14 - exp).clamp(min=0)
        m = ((0x800000 | (u & 0x7FFFFF)) >> (shift + 21).clamp(max=31)).clamp(max=3)
        m = torch.where(shift + 21 >= 32, torch.zeros_like(m), m)
        q = torch.where(exp < -14, sign | m, sign | ((exp + 15) << 2) | man2)
    q = torch.where(v == 0, torch.zeros_like(q), q)
    return q.to(torch.uint8).view(dtype)


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


_OWN_KERNELS = (flash_attn_with_kvcache, flash_attn_with_kvcache_reference)


def _default_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> Kernel:
    if q.is_cuda:
        flash = flash_kernel()
        if flash is not None:
            return flash
        return flash_attn_with_kvcache_reference
    if (
        q.device.type == "cpu"
        and q.dtype in _DTYPE_CODES
        and (k_cache.dtype == q.dtype or k_cache.dtype in _FP8)
    ):
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


def _per_batch(values, batch: int, default) -> Optional[list[int]]:
    if values is None:
        return None if default is None else [default] * batch
    if isinstance(values, int):
        return [values] * batch
    out = [int(x) for x in torch.as_tensor(values).reshape(-1).tolist()]
    if len(out) != batch:
        raise ValueError(f"expected {batch} per-batch values, got {len(out)}")
    return out
