"""FlashAttention-4 (``flash-attn-4``, CuTe DSL kernels for Hopper and Blackwell) over vattention
caches.

FA4's ``flash_attn_varlen_func(q, k, v, cu_seqlens_q=..., seqused_k=...)`` takes the whole
``[batch, max_seq, kv_heads, head_dim]`` K and V tensors with one length per row, no page table:
exactly a vattention cache's layer tensors (``cache.layer(i)``, either layout). This module is that
call over a cache, with what FA4 does not check for a virtual cache checked first:

* FA4 loads key tiles whole (TMA, bounded by the tensor's shape, not by ``seqused_k``), so a row
  of ``len`` keys is read up to ``len`` rounded up to the kernel's key tile
  (:func:`fa4_key_tile`). A cache created with ``kv_tile_tokens`` a multiple of that tile (the
  default on CUDA: 128) maps those tokens and keeps those past ``len`` finite (zeros), so no tile
  meets an unmapped page or a stale NaN (``P = 0`` times NaN is NaN); a cache without it is
  refused (:class:`vattention.ConfigError`), and so is a row read past what its ``step()`` made
  finite (:class:`vattention.UnmappedReadError`).
* FA4 silently copies a K or V tensor whose strides or address are not 16-byte aligned
  (``maybe_contiguous``): over a cache that copy would read every row, mapped or not. Such a
  tensor is refused instead (``ValueError`` naming the stride).

* :func:`flash_attn_varlen_func` -- FA4's signature (the arguments a KV cache uses) and return
  value ``(out, lse)``, for kernel developers.
* :func:`attend_slots` -- for serving loops: one call for a batch of slots, given each slot's length
  (as passed to ``KVCache.step``) and its number of queries.
* :func:`fa4_kernel` -- FA4's function when ``flash_attn.cute`` imports (``pip install
  ".[flash4]"`` from a clone on a GPU machine; docs/cuda.md for an offline one), else ``None``.
* :func:`fa4_key_tile` -- the key tile FA4 loads for a call's head dims, mask and GPU.

Read from ``flash_attn/cute/interface.py`` and ``cute_dsl_utils.py`` of the ``flash-attn-4``
4.0.0b36 wheel (PyPI): the signature, ``_get_fwd_config``/``_tile_size_fwd_sm90`` (tiles),
``_resolve_causal_local_window`` (windows), ``maybe_contiguous`` (the copy). None of this has run
over a vattention cache on a GPU yet (docs/integrations.md says what ran where); on the CPU it is
tested against a torch stand-in of FA4 (tests/support/fa4_stand_in.py). Without FA4 (CPU tensors,
or a GPU without the package) the same semantics run on vattention's own kernels
(:func:`vattention.integrations.flash_attn.flash_attn_with_kvcache`).

Examples
--------
Two slots of a CPU cache (vattention's kernel stands in for FA4 on the CPU): slot 0 decodes one
token, slot 1 prefills three.

>>> import torch, vattention
>>> cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64, max_batch_size=2,
...                                max_seq_len=512, dtype=torch.bfloat16, kv_tile_tokens=128)
>>> with vattention.KVCache(cfg) as cache:
...     rows = [cache.alloc(), cache.alloc()]
...     cache.step({rows[0]: 40, rows[1]: 3})
...     k, v = cache.layer(0)
...     for row, n in zip(rows, (40, 3)):                   # the model writes its K/V
...         _ = k[row, :n].normal_(), v[row, :n].normal_()
...     q = torch.randn(4, 2, 64, dtype=torch.bfloat16)    # 1 + 3 queries, 2 query heads
...     out = attend_slots(q, k, v, seq_lens=[40, 3], q_lens=[1, 3], slots=rows)
...     bool(v[rows[1], 3:128].eq(0).all())                 # the tail a tile reads: zeros
True
>>> out.shape
torch.Size([4, 2, 64])
"""

from __future__ import annotations

import os
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from ..attention import cpu_attention, reference_attention, supports
from ..cache_reads import CacheRows, cache_rows
from ..errors import ConfigError

__all__ = [
    "flash_attn_varlen_func",
    "attend_slots",
    "fa4_kernel",
    "fa4_key_tile",
    "FA4_VERSION",
]

# The flash-attn-4 release whose interface this module follows (and whose wheel set docs/cuda.md
# lists); its tiles are in fa4_key_tile.
FA4_VERSION = "4.0.0b36"

Window = Tuple[Optional[int], Optional[int]]
_HALF = (torch.float16, torch.bfloat16)
_ALIGN_BYTES = 16  # FA4's maybe_contiguous: pointer and every stride but the last


def fa4_kernel() -> Optional[Callable[..., Any]]:
    """FA4's ``flash_attn.cute.flash_attn_varlen_func`` if it imports here, else ``None``.

    Examples
    --------
    >>> fa4_kernel() is None or callable(fa4_kernel())
    True
    """
    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4
    except Exception:  # not installed, or cutlass / the CUDA runtime failing to load
        return None
    return fa4


def _causal_local(causal: bool, window_size: Window) -> Tuple[bool, bool]:
    """FA4's ``_resolve_causal_local_window``: (causal, local) as its kernels see them."""
    left, right = window_size
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    if left is None and right is None:
        return causal, False
    if left is None and right == 0:
        return True, False
    return False, True


def fa4_key_tile(
    head_dim: int,
    head_dim_v: Optional[int] = None,
    *,
    causal: bool = False,
    window_size: Window = (None, None),
    arch: int = 90,
) -> int:
    """Keys FA4 4.0.0b36's forward kernel loads per tile (``tile_n``): a row of ``len`` keys is
    read up to ``len`` rounded up to it.

    From ``interface.py``'s ``_get_fwd_config`` and ``_tile_size_fwd_sm90``. A cache's
    ``kv_tile_tokens`` must be a multiple of it for FA4 to read only mapped, finite memory.

    Parameters
    ----------
    head_dim, head_dim_v : int
        Of Q/K and of V (default: ``head_dim``).
    causal, window_size
        As given to FA4 (a window makes the mask "local", which changes some Hopper tiles).
    arch : int
        Compute capability as FA4 writes it: 90 (Hopper), 100/110 (Blackwell), 80, 120.

    Examples
    --------
    >>> fa4_key_tile(128), fa4_key_tile(96), fa4_key_tile(96, causal=True), fa4_key_tile(256)
    (128, 144, 128, 80)
    """
    dv = head_dim if head_dim_v is None else head_dim_v
    _, local = _causal_local(causal, window_size)
    causal_or_local = causal or local
    family = arch // 10
    if family == 9:
        if head_dim <= 64:
            return 128
        if head_dim <= 96:
            return 128 if causal_or_local else 144
        if head_dim <= 128:
            return 128
        if head_dim <= 192:
            return 96 if local else (128 if dv <= 128 else 112)
        return 64 if local else 80
    if family == 8:
        return 64
    if family == 12:
        return 64 if head_dim > 64 else 128
    return 128  # 10.x/11.x: 128 (64 for split KV with head_dim != head_dim_v: a divisor)


def _device_arch(device: torch.device) -> int:
    """FA4's ``_get_device_arch`` (``FLASH_ATTENTION_ARCH`` overrides); 90 off CUDA."""
    override = os.environ.get("FLASH_ATTENTION_ARCH")
    if override:
        digits = "".join(ch for ch in override if ch.isdigit())
        if digits:
            return int(digits)
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    seqused_k: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Window = (None, None),
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,
    return_lse: bool = False,
    *,
    kernel: Optional[Callable[..., Any]] = None,
    arch: Optional[int] = None,
    check_reads: bool = True,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """FA4's ``flash_attn_varlen_func`` over a vattention cache's K and V, ``seqused_k`` form.

    Row ``i`` of ``k``/``v`` holds request ``i``'s keys ``[0, seqused_k[i])``; its queries are
    ``q[cu_seqlens_q[i]:cu_seqlens_q[i + 1]]`` (or ``q[i]`` without ``cu_seqlens_q``). Causal
    masks are aligned to the bottom right: query ``j`` of ``Lq`` sees keys ``t <= j + Lk - Lq``.

    Parameters
    ----------
    q : Tensor ``[total_q, heads, head_dim]`` with ``cu_seqlens_q``, else ``[batch, seqlen_q,
        heads, head_dim]``
        float16 or bfloat16 (fp8 is FA4's on Blackwell only, not taken here).
    k, v : Tensor ``[batch, max_seq, kv_heads, head_dim]`` (``head_dim_v`` for v)
        q's dtype; ``heads`` a multiple of ``kv_heads``. A cache's layer tensors (the rows
        ``[0, batch)`` of them: pass ``k[a:b]`` for rows ``a..b-1``) or any tensor with a
        contiguous last dimension and 16-byte aligned strides and address.
    cu_seqlens_q : int32 Tensor ``[batch + 1]``, optional
        Query offsets (non-decreasing, ending at ``total_q``).
    max_seqlen_q, max_seqlen_k : int, optional
        FA4's launch hints (host ints): the most queries of a request, the most keys.
    seqused_k : int32 Tensor ``[batch]``
        Keys of each row, ``0 <= seqused_k[i] <= max_seq`` (required: the cache form).
    softmax_scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    causal : bool
        Bottom-right aligned causal mask.
    window_size : (int or None, int or None)
        FA4's sliding window ``(left, right)`` in keys, ``None`` (or both negative) = unlimited;
        Mistral's window ``W`` is ``(W - 1, 0)``.
    num_splits, pack_gqa
        Passed to FA4 (split-KV count, 1 by default; GQA packing, FA4's choice by default).
    return_lse : bool
        Also return the log-sum-exp ``[heads, total_q]`` (FA4 only).
    kernel : callable, optional, keyword only
        A function with FA4's signature (tests pass a stand-in). Default: FA4 for CUDA tensors
        when it imports, else vattention's kernels with the same semantics (no LSE).
    arch : int, optional, keyword only
        The compute capability whose key tile the reads are checked with (default: the
        tensors' GPU, 90 off CUDA; ``FLASH_ATTENTION_ARCH`` overrides it, as in FA4).
    check_reads : bool, keyword only
        Check that every row's tile-rounded reads are mapped and finite (default). On CUDA the
        check copies ``seqused_k`` to the host (one synchronization); skipped while a CUDA graph
        is being captured.

    Returns
    -------
    (out, lse)
        ``out`` shaped like ``q`` (``head_dim_v`` last), in q's dtype; ``lse`` or ``None``.

    Raises
    ------
    TypeError
        A tensor argument that is not one, or a dtype outside the ones above.
    ValueError
        A shape, device, stride, address or length out of range (the message names it).
    vattention.ConfigError
        (a ValueError) The cache's ``kv_tile_tokens`` is not a multiple of FA4's key tile for
        this call: its tiles could reach unmapped pages or stale NaN.
    vattention.UnmappedReadError
        (a ValueError) A row's tile-rounded reads pass the tokens its ``step()`` mapped and
        made finite (or start below a released sliding-window head).

    Examples
    --------
    >>> kc = torch.zeros(2, 256, 1, 64, dtype=torch.bfloat16); vc = torch.ones_like(kc)
    >>> q = torch.randn(3, 2, 64, dtype=torch.bfloat16)
    >>> out, lse = flash_attn_varlen_func(q, kc, vc, cu_seqlens_q=torch.tensor([0, 1, 3],
    ...     dtype=torch.int32), seqused_k=torch.tensor([5, 9], dtype=torch.int32), causal=True)
    >>> out.shape, bool(out.eq(1).all()), lse is None
    (torch.Size([3, 2, 64]), True, True)
    """
    _check_tensors(q, k, v, varlen=cu_seqlens_q is not None)
    batch = k.shape[0]
    if cu_seqlens_q is not None:
        _check_int32("cu_seqlens_q", cu_seqlens_q, batch + 1, q.device)
    if seqused_k is None:
        raise ValueError("seqused_k is required: one length per row of k (FA4's cache form)")
    _check_int32("seqused_k", seqused_k, batch, q.device)
    if check_reads and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        # Host copies of the lengths (one synchronization on CUDA), checked against the cache.
        lens = seqused_k.tolist()
        q_lens = _query_counts(cu_seqlens_q, q, batch)
        device_arch = arch if arch is not None else _device_arch(q.device)
        _check_cache_reads(k, v, lens, q_lens, causal, window_size, device_arch)
    if kernel is None and q.is_cuda:
        kernel = fa4_kernel()
    if kernel is None:
        if return_lse:
            raise ValueError("return_lse=True needs FlashAttention-4 (flash_attn.cute): not here")
        return _own_kernels(q, k, v, cu_seqlens_q, seqused_k, softmax_scale, causal, window_size)
    out = kernel(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        seqused_k=seqused_k,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        num_splits=num_splits,
        pack_gqa=pack_gqa,
        return_lse=return_lse,
    )
    return out[0], out[1]


def attend_slots(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: Sequence[int],
    *,
    q_lens: Optional[Sequence[int]] = None,
    slots: Optional[Sequence[int]] = None,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    window_size: Window = (None, None),
    kernel: Optional[Callable[..., Any]] = None,
    arch: Optional[int] = None,
    check_reads: bool = True,
) -> torch.Tensor:
    """One FA4 call for a batch of slots of a cache: request ``i`` (row ``slots[i]``) attends
    over its first ``seq_lens[i]`` keys with its ``q_lens[i]`` queries.

    The call covers every row of ``k_cache`` (FA4 has no batch index): rows not listed get no
    query and no key. Lengths are host ints (no synchronization for the read check).

    Parameters
    ----------
    q : Tensor ``[sum(q_lens), heads, head_dim]``
        The queries, request by request in the order of ``slots``.
    k_cache, v_cache : Tensor ``[max_batch, max_seq, kv_heads, head_dim]``
        One layer of a cache (``cache.layer(i)``), K/V of this step already written.
    seq_lens : sequence of int
        Keys of each request: its row's length as given to ``KVCache.step``.
    q_lens : sequence of int, optional
        Queries of each request (default 1 each: decode); at most ``seq_lens[i]`` when causal.
    slots : sequence of int, optional
        The row of each request, distinct (default ``0..n-1``).
    causal, softmax_scale, window_size, kernel, arch, check_reads
        As in :func:`flash_attn_varlen_func`.

    Returns
    -------
    Tensor ``[sum(q_lens), heads, head_dim_v]``, in the order of ``q``.

    Raises
    ------
    ValueError
        Counts that differ, a slot out of range or listed twice, a negative length, or any
        refusal of :func:`flash_attn_varlen_func`.

    Examples
    --------
    >>> kc = torch.zeros(4, 128, 1, 64, dtype=torch.bfloat16); vc = torch.zeros_like(kc)
    >>> vc[3, :7] = 2.0
    >>> q = torch.randn(1, 2, 64, dtype=torch.bfloat16)
    >>> out = attend_slots(q, kc, vc, seq_lens=[7], slots=[3])
    >>> bool(out.eq(2).all())
    True
    """
    n = len(seq_lens)
    rows = list(range(n)) if slots is None else [int(s) for s in slots]
    counts = [1] * n if q_lens is None else [int(x) for x in q_lens]
    if len(rows) != n or len(counts) != n:
        raise ValueError(
            f"seq_lens has {n} entries, slots {len(rows)} and q_lens {len(counts)}: "
            "give one per request"
        )
    batch = k_cache.shape[0] if k_cache.dim() == 4 else 0
    for i, (row, length, count) in enumerate(zip(rows, seq_lens, counts)):
        if not 0 <= row < batch:
            raise ValueError(f"slots[{i}]={row} is outside the cache's rows [0, {batch})")
        if length < 0 or count < 0:
            raise ValueError(f"seq_lens[{i}]={length} and q_lens[{i}]={count} must be >= 0")
    if len(set(rows)) != n:
        raise ValueError(f"slots={rows} lists a row twice: each request has its own row")
    if q.dim() != 3 or q.shape[0] != sum(counts):
        raise ValueError(
            f"q has shape {tuple(q.shape)}; expected [sum(q_lens)={sum(counts)}, heads, head_dim]"
        )
    order = sorted(range(n), key=lambda i: rows[i])  # FA4 reads rows in order: queries too
    per_row_q = [0] * batch
    used = [0] * batch
    for i in range(n):
        per_row_q[rows[i]], used[rows[i]] = counts[i], seq_lens[i]
    cu = [0]
    for count in per_row_q:
        cu.append(cu[-1] + count)
    starts = [sum(counts[:i]) for i in range(n)]
    if order != list(range(n)):
        index = torch.cat(
            [torch.arange(starts[i], starts[i] + counts[i], dtype=torch.long) for i in order]
        ).to(q.device)
        q_rows = q.index_select(0, index)
    else:
        index, q_rows = None, q
    _check_tensors(q_rows, k_cache, v_cache, varlen=True)
    if check_reads and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        device_arch = arch if arch is not None else _device_arch(q.device)
        _check_cache_reads(k_cache, v_cache, used, per_row_q, causal, window_size, device_arch)
    out, _ = flash_attn_varlen_func(
        q_rows,
        k_cache,
        v_cache,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=q.device),
        max_seqlen_q=max(counts, default=0),
        max_seqlen_k=max(seq_lens, default=0),
        seqused_k=torch.tensor(used, dtype=torch.int32, device=q.device),
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        kernel=kernel,
        arch=arch,
        check_reads=False,
    )
    if index is None:
        return out
    result = torch.empty_like(out)
    result.index_copy_(0, index, out)
    return result


# ---- checks -------------------------------------------------------------------------------------


def _check_tensors(q: Any, k: Any, v: Any, varlen: bool) -> None:
    """Types, dtypes, shapes, devices and layouts FA4 needs, and those it would not refuse over a
    cache (it copies a misaligned tensor: every row of it, mapped or not)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        if t.dtype not in _HALF:
            raise TypeError(f"{name} has dtype {t.dtype}; FA4 over a cache takes float16/bfloat16")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype: got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"k and v must be [batch, max_seq, kv_heads, head_dim]: got {tuple(k.shape)} and "
            f"{tuple(v.shape)}"
        )
    batch, max_seq, kv_heads, head_dim = k.shape
    if tuple(v.shape[:3]) != (batch, max_seq, kv_heads):
        raise ValueError(f"v has shape {tuple(v.shape)}; k's is {tuple(k.shape)}")
    if q.dim() != (3 if varlen else 4):
        form = (
            "[total_q, heads, head_dim] with cu_seqlens_q"
            if varlen
            else "[batch, seqlen_q, heads, head_dim] without cu_seqlens_q"
        )
        raise ValueError(f"q has shape {tuple(q.shape)}; expected {form}")
    heads, q_dim = q.shape[-2:]
    if q_dim != head_dim:
        raise ValueError(f"q's head_dim is {q_dim}, k's {head_dim}: they must be equal")
    if heads % kv_heads:
        raise ValueError(f"q has {heads} heads, not a multiple of k's {kv_heads} KV heads")
    for name, dim in (("head_dim", head_dim), ("v's head_dim", v.shape[-1])):
        if not 8 <= dim <= 256 or dim % 8:
            raise ValueError(f"{name}={dim}: FA4 takes multiples of 8 in [8, 256]")
    if not varlen and q.shape[0] != batch:
        raise ValueError(f"q has {q.shape[0]} rows, k {batch}: one per row")
    for name, t in (("k", k), ("v", v), ("q", q)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: one device")
        _check_layout(name, t)


def _query_counts(cu_seqlens_q: Optional[torch.Tensor], q: torch.Tensor, batch: int) -> List[int]:
    """Queries of each row: from ``cu_seqlens_q`` (a host copy, checked), else ``q.shape[1]``."""
    if cu_seqlens_q is None:
        return [q.shape[1]] * batch
    cu = cu_seqlens_q.tolist()
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] != q.shape[0]:
        raise ValueError(
            f"cu_seqlens_q={cu} must start at 0, never decrease and end at total_q={q.shape[0]}"
        )
    return [b - a for a, b in zip(cu, cu[1:])]


def _check_layout(name: str, t: torch.Tensor) -> None:
    """FA4 copies what ``maybe_contiguous`` finds misaligned: a cache tensor must never be."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} has a last-dimension stride of {t.stride(-1)}; it must be 1")
    unit = max(1, _ALIGN_BYTES // t.element_size())
    if t.data_ptr() % _ALIGN_BYTES:
        raise ValueError(
            f"{name} starts at an address that is not {_ALIGN_BYTES}-byte aligned: FA4 would copy "
            "it (over a cache: every row, mapped or not)"
        )
    for dim, stride in enumerate(t.stride()[:-1]):
        if stride % unit:
            raise ValueError(
                f"{name}.stride({dim})={stride} elements is not a multiple of {unit} "
                f"({_ALIGN_BYTES} bytes): FA4 would copy it (over a cache: every row, mapped or "
                "not)"
            )


def _check_int32(name: str, t: Any, length: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor, not {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {t.dtype}; FA4 takes int32")
    if t.dim() != 1 or t.shape[0] != length or t.stride(0) != 1:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)} (stride {t.stride()}); expected a contiguous "
            f"[{length}]"
        )
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}: one device")


def _check_cache_reads(
    k: torch.Tensor,
    v: torch.Tensor,
    lens: List[int],
    q_lens: List[int],
    causal: bool,
    window_size: Window,
    arch: int,
) -> None:
    """Every row's reads, rounded to FA4's key tile, lie in mapped, finite tokens of its cache
    row (caches only: a plain tensor costs one lookup)."""
    max_seq = k.shape[1]
    for i, n in enumerate(lens):
        if not 0 <= n <= max_seq:
            raise ValueError(f"seqused_k[{i}]={n} is outside [0, {max_seq}] (k's max_seq)")
    views: List[CacheRows] = []
    for tensor in (k, v):
        rows = cache_rows(tensor)
        if rows is not None and not any(rows.same_rows(seen) for seen in views):
            views.append(rows)
    if not views:
        return
    tile = fa4_key_tile(k.shape[-1], v.shape[-1], causal=causal, window_size=window_size, arch=arch)
    for view in views:
        if view.tile_tokens == 0 or view.tile_tokens % tile:
            raise ConfigError(
                f"this cache has kv_tile_tokens={view.tile_tokens}; FA4 (sm_{arch}, head_dim "
                f"{k.shape[-1]}) loads {tile}-key tiles, which could reach unmapped pages or stale "
                f"NaN past a row's length: create the cache with kv_tile_tokens a multiple of "
                f"{tile}"
            )
    # A row of length 0 loads no tile (FA4 aims its first load at block -1: zero filled).
    ends = [min(max_seq, -(-n // tile) * tile) for n in lens]
    begins = None
    _, local = _causal_local(causal, window_size)
    left = window_size[0]
    if local and left is not None and left >= 0:
        # Row i's first query sits at lens[i] - q_lens[i]; FA4 starts at the tile of its window.
        begins = [max(0, n - lq - left) // tile * tile for n, lq in zip(lens, q_lens)]
    for view in views:
        view.check(list(range(len(lens))), ends, begins, finite=True)


def _own_kernels(q, k, v, cu_seqlens_q, seqused_k, softmax_scale, causal, window_size):
    """FA4's semantics on vattention's kernels (FlashAttention's ``flash_attn_with_kvcache``
    with no new keys: ``cache_seqlens`` are the keys): the CPU kernel for CPU tensors it takes,
    else the SDPA reference."""
    left, right = window_size
    window = (
        -1 if left is None or left < 0 else int(left),
        -1 if right is None or right < 0 else int(right),
    )
    own = cpu_attention if q.device.type == "cpu" and supports(q, k) else reference_attention
    out = own(
        q,
        k,
        v,
        cache_seqlens=seqused_k,
        cu_seqlens_q=cu_seqlens_q,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window,
    )
    return out, None
