"""The CPU kernel prepared once per layer and once per step: a serving loop's :func:`cpu_attention`.

An engine calls attention once per layer per step with the same caches, heads, scale and window,
and the same requests in every layer of a step. :func:`cpu_attention` checks all of it on every
call; here a :class:`CpuAttentionPlan` checks a layer's fixed arguments once, a
:class:`CpuAttentionBatch` a step's per-request ones once, and each call checks only its own
tensors (shape, dtype, device, strides) before the kernel runs. In an engine each layer's call
comes after the layer's matmuls have evicted the interpreter's code and data from the caches,
where the generic call's checks cost several times what they cost in a loop (docs/benchmarks.md).
Results are bit for bit :func:`cpu_attention`'s, and so are its errors: a call this form does not
cover (tensors of another dtype or layout, no new keys, an empty batch) goes through
:func:`cpu_attention` itself.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .. import _C
from .arguments import IntArg, Scale, descale_factor, window_bounds
from .fp8 import FP8_MAX
from .kernel import (
    _CACHE_CODES,
    _QUERY_CODES,
    _operand,
    _per_request,
    _query_offsets,
    cpu_attention,
)

__all__ = ["CpuAttentionBatch", "CpuAttentionPlan"]


def _own(t: torch.Tensor, given: object) -> torch.Tensor:
    """t, or a copy where it is the caller's own tensor (taken as it is): nothing the caller does
    later changes or frees what a batch holds."""
    return t.clone() if t is given else t


class CpuAttentionBatch:
    """One step's requests, for every layer's :class:`CpuAttentionPlan` call of that step.

    The varlen form of :func:`cpu_attention`'s per-request arguments, checked and copied once:
    request ``i``'s queries (and new keys) are tokens ``[cu_seqlens_q[i], cu_seqlens_q[i + 1])``
    of the call's tensors, which hold ``q_tokens = cu_seqlens_q[-1]`` tokens; it has
    ``cache_seqlens[i]`` tokens cached in row ``cache_batch_idx[i]`` (default ``i``) before the
    call; ``prefix_groups`` / ``prefix_lens`` are the shared-prefix hint. The values are read when
    the batch is built: changing the tensors given afterwards does not change the batch. The
    kernel checks them against the caches at each call (lengths, distinct rows, ordered offsets)
    and raises ``ValueError``, writing nothing, where they do not fit.

    Examples
    --------
    >>> import torch
    >>> batch = CpuAttentionBatch(torch.tensor([0, 3, 4]), cache_seqlens=[5, 0],
    ...                           cache_batch_idx=[1, 0])
    >>> batch.num_requests, batch.q_tokens
    (2, 4)
    """

    __slots__ = (
        "num_requests",
        "q_tokens",
        "cu_seqlens_q",
        "cache_seqlens",
        "cache_batch_idx",
        "prefix_groups",
        "prefix_lens",
        "_native",
    )

    def __init__(
        self,
        cu_seqlens_q: IntArg,
        cache_seqlens: IntArg,
        cache_batch_idx: IntArg = None,
        *,
        prefix_groups: IntArg = None,
        prefix_lens: IntArg = None,
    ) -> None:
        cu, n = _query_offsets(cu_seqlens_q)
        seqlens, rows, groups, lens = _per_request(
            n, cache_seqlens, cache_batch_idx, prefix_groups, prefix_lens
        )
        # this batch's own copies where the caller's tensors were taken as they are
        cu, seqlens = _own(cu, cu_seqlens_q), _own(seqlens, cache_seqlens)
        if rows is not None:
            rows = _own(rows, cache_batch_idx)
        if groups is not None and lens is not None:
            groups, lens = _own(groups, prefix_groups), _own(lens, prefix_lens)
        self.num_requests = n
        self.q_tokens = int(cu[-1])
        self.cu_seqlens_q = cu
        self.cache_seqlens = seqlens
        self.cache_batch_idx = rows
        self.prefix_groups = groups
        self.prefix_lens = lens
        # the kernel's view of the batch; None: nothing to run (cpu_attention returns at once)
        self._native = (
            None
            if n == 0 or self.q_tokens <= 0
            else (
                n,
                self.q_tokens,
                cu.data_ptr(),
                seqlens.data_ptr(),
                0 if rows is None else rows.data_ptr(),
                0 if groups is None else groups.data_ptr(),
                0 if lens is None else lens.data_ptr(),
            )
        )

    def __repr__(self) -> str:
        return f"CpuAttentionBatch(num_requests={self.num_requests}, q_tokens={self.q_tokens})"


class CpuAttentionPlan:
    """One layer's :func:`cpu_attention`, its fixed arguments checked once: call it with a step's
    tensors and :class:`CpuAttentionBatch`.

    ``plan(q, k, v, batch, out=None)`` is ``cpu_attention(q, k_cache, v_cache, k, v,
    cache_seqlens=batch.cache_seqlens, cache_batch_idx=batch.cache_batch_idx,
    cu_seqlens_q=batch.cu_seqlens_q, prefix_groups=..., prefix_lens=..., out=out, ...)`` with
    this plan's ``softmax_scale``, ``causal``, ``window_size`` and descales, bit for bit, errors
    included: ``q`` ``[q_tokens, num_heads, head_dim]``, ``k`` / ``v`` (the new keys and values,
    appended in place) ``[q_tokens, kv_heads, head_dim]``, in the plan's ``dtype``; ``out``,
    like ``q``, receives the output (a new tensor when ``None``) and is returned.

    The plan holds ``k_cache`` and ``v_cache`` and reads their addresses and strides once:
    changing those tensors' metadata in place afterwards (``set_``, ``resize_``) is not seen;
    build a new plan instead. Their contents are read at each call, as always.

    Parameters
    ----------
    k_cache, v_cache : Tensor ``[batch_cache, seqlen_cache, kv_heads, head_dim]``
        As for :func:`cpu_attention` (a vattention ``layer`` or ``mega`` view).
    num_heads : int
        Query heads, a multiple of the caches' KV heads.
    dtype : torch.dtype, optional
        The queries' dtype (float32, bfloat16 or float16); default the caches' (required for fp8
        caches).
    softmax_scale, causal, window_size, k_descale, v_descale
        As for :func:`cpu_attention`.

    Raises
    ------
    TypeError, ValueError
        As :func:`cpu_attention` would for these arguments, naming the bad one.

    Examples
    --------
    A step of two requests (a 3-token prefill chunk, a decode) through two layers' plans:

    >>> import torch
    >>> caches = [(torch.zeros(2, 16, 1, 8), torch.zeros(2, 16, 1, 8)) for _ in range(2)]
    >>> plans = [CpuAttentionPlan(kc, vc, num_heads=2, causal=True) for kc, vc in caches]
    >>> batch = CpuAttentionBatch([0, 3, 4], cache_seqlens=[5, 0], cache_batch_idx=[1, 0])
    >>> q, k, v = torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    >>> outs = [plan(q, k, v, batch) for plan in plans]
    >>> want = cpu_attention(q, torch.zeros(2, 16, 1, 8), torch.zeros(2, 16, 1, 8), k, v,
    ...                      cache_seqlens=torch.tensor([5, 0]),
    ...                      cache_batch_idx=torch.tensor([1, 0]),
    ...                      cu_seqlens_q=torch.tensor([0, 3, 4]), causal=True)
    >>> all(torch.equal(out, want) for out in outs), bool(torch.equal(caches[1][0][1, 5:8], k[:3]))
    (True, True)
    """

    def __init__(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
        *,
        dtype: Optional[torch.dtype] = None,
        softmax_scale: Optional[float] = None,
        causal: bool = False,
        window_size: Tuple[int, int] = (-1, -1),
        k_descale: Scale = None,
        v_descale: Scale = None,
    ) -> None:
        if isinstance(num_heads, bool) or not isinstance(num_heads, int):
            raise TypeError(f"num_heads must be an int, got {num_heads!r}")
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(
                    f"{name} must be [batch_cache, seqlen_cache, kv_heads, head_dim], got shape "
                    f"{tuple(t.shape)}"
                )
        if dtype is None:
            if k_cache.dtype in FP8_MAX:
                raise TypeError(
                    f"dtype (the queries') is required with an fp8 cache ({k_cache.dtype})"
                )
            dtype = k_cache.dtype
        if dtype not in _QUERY_CODES:
            raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        head_dim = k_cache.shape[-1]
        # Every check cpu_attention makes of these arguments, made by cpu_attention itself on an
        # empty batch (it returns before the kernel): the same rules and messages.
        cpu_attention(
            torch.empty(0, num_heads, head_dim, dtype=dtype),
            k_cache,
            v_cache,
            cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            k_descale=k_descale,
            v_descale=v_descale,
        )
        batch_cache, seqlen_cache, kv_heads, _ = k_cache.shape
        left, right = window_bounds(window_size)
        self.k_cache, self.v_cache = k_cache, v_cache
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.dtype = dtype
        self.softmax_scale = (
            1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
        )
        self.causal = bool(causal)
        self.window_size = (left, right)
        self.k_descale = descale_factor(k_descale, "k_descale", k_cache.dtype)
        self.v_descale = descale_factor(v_descale, "v_descale", v_cache.dtype)
        # the generic call's descales: the values read here, as the kernel's are (it refuses
        # any for caches that are not fp8)
        fp8 = k_cache.dtype in FP8_MAX
        self._descales = dict(k_descale=self.k_descale, v_descale=self.v_descale) if fp8 else {}
        self._run = _C.prepare_attention(
            num_heads=num_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=_QUERY_CODES[dtype],
            cache_dtype=_CACHE_CODES[k_cache.dtype],
            k_cache=_operand(k_cache, False),
            v_cache=_operand(v_cache, False),
            cache_batch=batch_cache,
            cache_len=seqlen_cache,
            softmax_scale=self.softmax_scale,
            causal=self.causal,
            window_left=left,
            window_right=right,
            k_descale=self.k_descale,
            v_descale=self.v_descale,
        )

    def __call__(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        batch: CpuAttentionBatch,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if type(batch) is not CpuAttentionBatch:
            raise TypeError(f"batch must be a CpuAttentionBatch, got {type(batch).__name__}")
        native = batch._native
        tensor = torch.Tensor
        if native is not None and type(q) is tensor and type(k) is tensor and type(v) is tensor:
            dt, t = self.dtype, batch.q_tokens
            q_shape = (t, self.num_heads, self.head_dim)
            kv_shape = (t, self.num_kv_heads, self.head_dim)
            qs, ks, vs = q.stride(), k.stride(), v.stride()
            if (
                q.shape == q_shape
                and k.shape == kv_shape
                and v.shape == kv_shape
                and q.dtype is dt
                and k.dtype is dt
                and v.dtype is dt
                and q.is_cpu
                and k.is_cpu
                and v.is_cpu
                and qs[2] == 1
                and ks[2] == 1
                and vs[2] == 1
            ):
                o = torch.empty(q_shape, dtype=dt) if out is None else out
                os_ = o.stride() if type(o) is tensor else None
                if (
                    os_ is not None
                    and o.shape == q_shape
                    and o.dtype is dt
                    and o.is_cpu
                    and os_[2] == 1
                ):
                    self._run(
                        native,
                        (qs[0], qs[1], os_[0], os_[1], ks[0], ks[1], vs[0], vs[1]),
                        q.data_ptr(),
                        o.data_ptr(),
                        k.data_ptr(),
                        v.data_ptr(),
                        torch.get_num_threads(),
                    )
                    return o
        # everything else (other dtypes or layouts, no new keys, an empty batch, bad arguments):
        # the generic call, with its conversions and its errors
        return cpu_attention(
            q,
            self.k_cache,
            self.v_cache,
            k,
            v,
            cache_seqlens=batch.cache_seqlens,
            cache_batch_idx=batch.cache_batch_idx,
            cu_seqlens_q=batch.cu_seqlens_q,
            softmax_scale=self.softmax_scale,
            causal=self.causal,
            window_size=self.window_size,
            out=out,
            prefix_groups=batch.prefix_groups,
            prefix_lens=batch.prefix_lens,
            **self._descales,
        )

    def __repr__(self) -> str:
        return (
            f"CpuAttentionPlan(num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, cache={self.k_cache.dtype})"
        )
