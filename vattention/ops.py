"""Compile-safe writes into cache tensors: ``append`` and ``append_kv`` (torch.library custom ops).

Why they exist: a cache tensor is a virtual reservation of which only the mapped pages are memory.
Under ``torch.compile`` (torch 2.13, inductor), writing new tokens through a *view* of a cache
tensor, e.g. ``k_cache[slot, pos] = x`` with a Python-int ``slot``, or ``k_cache[slot][a:b] = x``,
is an input mutation through a view: functionalization turns it into "copy the whole input,
scatter into the copy, copy back", and the compiled code reads every byte of the virtual tensor,
unmapped pages included: SIGSEGV on the host backend, an illegal address on a GPU, and a
full-cache copy per step even where everything is mapped. These ops are opaque to the compiler
and declare the cache tensor they mutate (``mutates_args``), so a compiled graph calls them in
place on the whole tensor, and they write only the rows they are given (one ``index_put_``).

Rules for compiled code and CUDA graphs (docs/compile.md): pass the whole tensor from
:meth:`vattention.KVCache.layer` (not a slice of it), give slots and positions as int64 tensors,
and make sure :meth:`vattention.KVCache.step` has mapped every position written or read before the
compiled function or captured graph runs.

>>> import torch, vattention
>>> from vattention.ops import append_kv
>>> cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=2,
...                                max_seq_len=256, dtype=torch.float32, page_size="64KB")
>>> with vattention.KVCache(cfg) as cache:
...     slot = cache.alloc()
...     cache.step({slot: 4})
...     k_cache, v_cache = cache.layer(0)
...     new = torch.ones(1, 2, 64)
...     append_kv(k_cache, v_cache, new, 2 * new, torch.tensor([slot]), torch.tensor([3]))
...     float(v_cache[slot, 3].sum())
256.0
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import ConfigError

__all__ = ["append", "append_kv"]


def _check(cache: Tensor, x: Tensor, slots: Tensor, positions: Tensor) -> None:
    if cache.dim() < 3:
        raise ConfigError(
            f"cache must be a [batch, seq, ...] cache tensor, got shape {tuple(cache.shape)}"
        )
    for name, idx in (("slots", slots), ("positions", positions)):
        if idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32):
            raise ConfigError(
                f"{name} must be a 1-D int64 or int32 tensor, got shape "
                f"{tuple(idx.shape)} and dtype {idx.dtype}"
            )
    n = slots.shape[0]
    if positions.shape[0] != n:
        raise ConfigError(f"positions has {positions.shape[0]} entries but slots has {n}")
    want = (n,) + tuple(cache.shape[2:])
    if tuple(x.shape) != want:
        raise ConfigError(
            f"new tokens have shape {tuple(x.shape)}; this cache takes {want} "
            f"(one row per slot: [n, *cache.shape[2:]])"
        )
    if x.dtype != cache.dtype:
        raise ConfigError(f"new tokens have dtype {x.dtype}; the cache holds {cache.dtype}")


@torch.library.custom_op("vattention::append", mutates_args=("cache",))
def append(cache: Tensor, x: Tensor, slots: Tensor, positions: Tensor) -> None:
    """Write ``x[i]`` at ``cache[slots[i], positions[i]]`` for every i, in place.

    Parameters
    ----------
    cache : Tensor
        A whole cache tensor ``[max_batch, max_seq, *rest]`` from :meth:`vattention.KVCache.layer`.
    x : Tensor
        ``[n, *rest]``, the cache's dtype: one new token per entry.
    slots, positions : Tensor
        ``[n]`` int64 (or int32): batch row and token position (``0 <= position < max_seq``) of
        each new token. Their pages must be mapped (``step()`` with a length > position).

    Raises ConfigError on a shape or dtype mismatch. Safe under ``torch.compile(fullgraph=True)``
    and in CUDA graphs: never reads or copies the cache outside the written rows.

    >>> import torch, vattention
    >>> cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64,
    ...                                max_batch_size=1, max_seq_len=128, dtype=torch.float32,
    ...                                page_size="64KB")
    >>> with vattention.KVCache(cfg) as cache:
    ...     s = cache.alloc(); cache.step({s: 1})
    ...     k, _ = cache.layer(0)
    ...     x = torch.full((1, 1, 64), 3.0)
    ...     vattention.ops.append(k, x, torch.tensor([s]), torch.tensor([0]))
    ...     float(k[s, 0, 0, 0])
    3.0
    """
    _check(cache, x, slots, positions)
    cache.index_put_((slots.long(), positions.long()), x)


@append.register_fake
def _append_fake(cache: Tensor, x: Tensor, slots: Tensor, positions: Tensor) -> None:
    return None


def append_kv(
    k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slots: Tensor, positions: Tensor
) -> None:
    """:func:`append` into a layer's K and V caches: ``k[i]``, ``v[i]`` at
    ``(slots[i], positions[i])``.

    ``k`` and ``v`` are ``[n, num_kv_heads, head_dim]``; see :func:`append` for the rest.

    >>> import torch, vattention
    >>> cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64,
    ...                                max_batch_size=2, max_seq_len=128, dtype=torch.float32,
    ...                                page_size="64KB")
    >>> with vattention.KVCache(cfg) as cache:
    ...     a, b = cache.alloc(), cache.alloc(); cache.step({a: 8, b: 8})
    ...     kc, vc = cache.layer(0)
    ...     x = torch.ones(2, 1, 64)
    ...     vattention.ops.append_kv(kc, vc, x, x, torch.tensor([a, b]), torch.tensor([7, 2]))
    ...     float(kc[a, 7].sum() + kc[b, 2].sum())
    128.0
    """
    append(k_cache, k, slots, positions)
    append(v_cache, v, slots, positions)
