"""vattention's CPU attention kernel (``csrc/attention``): the argument checks, then one call.

The kernel takes raw pointers and strides, so every check that keeps it inside the tensors it was
given happens here, before the call: shapes, dtypes, devices, strides, and every per-request
integer fitting int32. A refused call raises before anything is written.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .. import _C
from .arguments import IntArg, Scale, descale_factor, window_bounds
from .fp8 import FP8_MAX

__all__ = ["cpu_attention", "kernel_isa", "supports"]

# The kernel's dtype codes for q and for the caches (DType in csrc/attention/attention.h).
_QUERY_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_CACHE_CODES = {**_QUERY_CODES, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
_INT32_MAX = 2**31 - 1


def kernel_isa() -> str:
    """The instruction set the CPU kernel runs here.

    ``"amx"`` (AMX-BF16 tiles for bf16 prefill, where the OS grants the tile state),
    ``"avx512bf16"`` (AVX-512 with the bf16 dot product), ``"avx512"``, ``"avx2"`` (with FMA and
    F16C) or ``"generic"`` (plain C++), chosen once from the CPU;
    ``VATTENTION_ATTENTION_ISA=<name>`` picks a lower one.

    Examples
    --------
    >>> kernel_isa() in ("amx", "avx512bf16", "avx512", "avx2", "generic")
    True
    """
    return _C.attention_kernel_isa()


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`cpu_attention` takes queries and a cache of these devices and dtypes.

    CPU tensors; q float32, bfloat16 or float16; the cache in q's dtype or fp8. Other tensors go
    to :func:`vattention.attention.reference_attention`, which takes any.

    Examples
    --------
    >>> import torch
    >>> supports(torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.float8_e5m2))
    True
    >>> supports(torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    False
    """
    return (
        q.device.type == "cpu"
        and q.dtype in _QUERY_CODES
        and (k_cache.dtype == q.dtype or k_cache.dtype in FP8_MAX)
    )


def cpu_attention(
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
    out: Optional[torch.Tensor] = None,
    prefix_groups: Optional[torch.Tensor] = None,
    prefix_lens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of a batch of queries over dense KV caches on the CPU, appending new keys in place.

    FlashAttention's ``flash_attn_with_kvcache`` semantics (no rotary, no paged block table) in
    vattention's native kernel: one call for the whole batch on ``torch.get_num_threads()``
    OpenMP threads with the GIL released, hand-vectorized for the CPU (:func:`kernel_isa`).
    Positions are absolute token indices of a cache row; sizes below are in elements or tokens.
    No key position at or beyond ``cache_seqlens[i] + new_i``, nor below a sliding window's
    start, is read (those pages of a vattention cache may be unmapped).

    Parameters
    ----------
    q : Tensor ``[n, seqlen_q, heads, head_dim]``, or ``[total_q, heads, head_dim]`` with
        ``cu_seqlens_q``
        float32, bfloat16 or float16, on the CPU.
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
        Varlen form: request i's queries are ``q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]``.
    softmax_scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    causal : bool
        Bottom-right aligned causal mask: query ``j`` of a request with ``Lq`` queries and ``Lk``
        keys sees keys ``t <= j + Lk - Lq``.
    window_size : (int, int)
        Sliding window ``(left, right)`` in tokens, -1 = unlimited: the query at position
        ``p = j + Lk - Lq`` sees keys ``[p - left, p + right]`` (``right`` is 0 when causal).
        Mistral's window ``W`` is ``(W - 1, 0)``.
    k_descale, v_descale : float or one-element Tensor, optional
        fp8 caches only (per tensor, default 1): a cache value is the stored fp8 number times the
        descale. New keys are stored as vLLM 0.32's CPU backend stores them
        (:func:`vattention.attention.fp8_store_like_vllm` of ``k / k_descale``).
    out : Tensor, optional
        Receives the output instead of a new tensor: q's shape and dtype, on the CPU, last
        dimension contiguous, any other strides (a slice of an engine's output buffer: no
        allocation, no copy).
    prefix_groups, prefix_lens : int Tensor ``[n]``, optional
        A hint that never changes the result: requests with the same ``prefix_groups[i] >= 0``
        hold the same K/V at positions ``[0, min(prefix_lens[i], prefix_lens[j]))`` of their rows
        (-1: no group), as prefix-cache hits give. The kernel then reads that prefix once per KV
        head for all the group's decode queries that see all of it (cascade attention), instead
        of once per request. The caller vouches for the sameness; a wrong hint gives wrong output.

    Returns
    -------
    Tensor
        Shaped like q, in q's dtype (``out`` when given). A query that sees no key gets zeros.

    Raises
    ------
    TypeError
        A dtype outside the ones above, or a float/bool where integers are due.
    ValueError
        A shape, stride, device or value out of range (the message names the argument); the
        caches are left unmodified.

    Examples
    --------
    Mixed batch, varlen form: a prefill chunk of 3 tokens beside a decode of 1, written into a
    caller's buffer.

    >>> import torch
    >>> kc = torch.zeros(2, 16, 1, 8); vc = torch.zeros(2, 16, 1, 8)
    >>> q = torch.randn(4, 2, 8); k = torch.randn(4, 1, 8); v = torch.randn(4, 1, 8)
    >>> buffer = torch.empty(4, 2, 8)
    >>> out = cpu_attention(q, kc, vc, k, v, cache_seqlens=torch.tensor([5, 0]),
    ...                     cache_batch_idx=torch.tensor([1, 0]),
    ...                     cu_seqlens_q=torch.tensor([0, 3, 4]), causal=True, out=buffer)
    >>> out is buffer, bool(torch.equal(kc[1, 5:8], k[:3])), bool(torch.equal(kc[0, 0], k[3]))
    (True, True, True)
    >>> bool(torch.equal(out[3], v[3].expand(2, 8)))   # the decode's one key: its value
    True

    Two decode rows over one shared 32-token prefix (rows 0 and 1 hold the same first 32 keys):

    >>> kc = torch.randn(2, 48, 1, 8); vc = torch.randn(2, 48, 1, 8)
    >>> kc[1, :32] = kc[0, :32]; vc[1, :32] = vc[0, :32]
    >>> q = torch.randn(2, 1, 2, 8); lens = torch.tensor([40, 45])
    >>> plain = cpu_attention(q, kc, vc, cache_seqlens=lens, causal=True)
    >>> hinted = cpu_attention(q, kc, vc, cache_seqlens=lens, causal=True,
    ...                        prefix_groups=torch.tensor([0, 0]),
    ...                        prefix_lens=torch.tensor([32, 32]))
    >>> bool(torch.allclose(plain, hinted, atol=1e-6))
    True
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_cpu:
            raise ValueError(
                f"{name} is on {t.device}, q on cpu: all tensors must be on one device"
            )
    dtype = q.dtype
    if dtype not in _QUERY_CODES:
        raise TypeError(
            f"q dtype must be float32, bfloat16 or float16 on CPU, got {dtype} "
            "(vattention.attention.reference_attention takes any dtype)"
        )
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(
            f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share a dtype"
        )
    if k_cache.dtype != dtype and k_cache.dtype not in FP8_MAX:
        raise TypeError(
            f"k_cache/v_cache dtype must be q's ({dtype}) or torch.float8_e4m3fn / "
            f"torch.float8_e5m2, got {k_cache.dtype}"
        )
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
        cu, n = _query_offsets(cu_seqlens_q)
    else:
        n = q.shape[0]
    if k is not None and v is not None:  # both or neither (checked above)
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
    seqlens, rows, prefix_groups, prefix_lens = _per_request(
        n,
        seqlen_cache if cache_seqlens is None else cache_seqlens,
        cache_batch_idx,
        prefix_groups,
        prefix_lens,
    )
    left, right = window_bounds(window_size)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    kd = descale_factor(k_descale, "k_descale", k_cache.dtype)
    vd = descale_factor(v_descale, "v_descale", v_cache.dtype)
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
    # The kernel checks the per-request values (lengths against the cache, rows in range and
    # distinct, cu_seqlens_q ordered) before it writes anything.
    zero = (0, 0, 0, 0)
    _C.flash_attn_with_kvcache(
        num_requests=n,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=_QUERY_CODES[dtype],
        cache_dtype=_CACHE_CODES[k_cache.dtype],
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


def _query_offsets(cu_seqlens_q: IntArg) -> Tuple[torch.Tensor, int]:
    """cu_seqlens_q as an int32 CPU tensor, and the n requests it delimits."""
    cu = _int32_tensor(cu_seqlens_q, "cu_seqlens_q")
    n = cu.numel() - 1
    if n < 0:
        raise ValueError("cu_seqlens_q must hold n + 1 >= 1 offsets")
    return cu, n


def _per_request(
    n: int,
    cache_seqlens: IntArg,
    cache_batch_idx: IntArg,
    prefix_groups: IntArg,
    prefix_lens: IntArg,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The per-request integers of n requests as int32 CPU tensors of n entries, checked:
    (cache_seqlens (one int: the same for every request), cache_batch_idx, prefix_groups,
    prefix_lens), the last three None where not given. A tensor that already is so is returned
    as it is."""
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        seqlens = torch.full((n,), cache_seqlens, dtype=torch.int32)
    else:
        seqlens = _int32_tensor(cache_seqlens, "cache_seqlens", n)
    rows = None if cache_batch_idx is None else _int32_tensor(cache_batch_idx, "cache_batch_idx", n)
    if (prefix_groups is None) != (prefix_lens is None):
        raise ValueError("prefix_groups and prefix_lens must be given together")
    groups = lens = None
    if prefix_groups is not None:
        groups = _int32_tensor(prefix_groups, "prefix_groups", n)
        lens = _int32_tensor(prefix_lens, "prefix_lens", n)
    return seqlens, rows, groups, lens


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
    if (  # already so (an engine's metadata, layer after layer): nothing to convert
        isinstance(values, torch.Tensor)
        and values.dtype == torch.int32
        and values.dim() == 1
        and (n is None or values.shape[0] == n)
        and values.is_cpu
        and values.is_contiguous()
    ):
        return values
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
