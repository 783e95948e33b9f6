"""Which KV cache a tensor views, and whether a kernel's reads of it stay in mapped pages.

A cache tensor is a dense ``[max_batch, max_seq, heads, head_dim]`` view of a virtual range of
which only each row's first :meth:`~vattention.KVCache.mapped_tokens` are backed. A kernel told
to read a row past them (``cache_seqlens`` larger than the length ``step()`` was given) touches
unmapped memory: the process dies of SIGSEGV on the host backend, and on a GPU the illegal
address poisons the CUDA context. Every :class:`~vattention.KVCache` registers its tensors' virtual
ranges here when it is created, so that an integration handed any tensor can ask, before it runs a
kernel, whether the tensor is a cache's and whether the rows and lengths it is about to read are
backed; the answer is a typed :class:`~vattention.UnmappedReadError` instead of a dead process.

The lookup is a binary search over the registered ranges (no lock: the table is replaced whole
when a cache registers), and the check is one call into the core for the whole batch, under the
cache's lock. A cache is held weakly: once its core is collected its ranges find nothing, and the
next registration drops them (no weakref callback: one could run inside a registration, during a
garbage collection, and wait for the lock that registration holds).

Examples
--------
>>> import torch, vattention
>>> cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64, max_batch_size=2,
...                                max_seq_len=1024, dtype=torch.float32, page_size="4KB")
>>> with vattention.KVCache(cfg) as cache:
...     slot = cache.alloc()
...     cache.step({slot: 20})                      # 16 tokens a page: 32 mapped
...     k, _ = cache.layer(0)
...     rows = cache_rows(k)
...     rows.check([slot], ends=[32])               # backed: nothing to say
...     try:
...         rows.check([slot], ends=[900])
...     except vattention.UnmappedReadError as e:
...         print(e.slot, e.length, e.mapped_tokens)
0 900 32
>>> cache_rows(torch.zeros(2, 1024, 1, 64)) is None   # not a cache's memory
True
"""

from __future__ import annotations

import bisect
import threading
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch

__all__ = ["CacheRows", "cache_rows", "register"]


@dataclass(frozen=True)
class _Region:
    """One registered virtual tensor: bytes ``[start, end)``."""

    start: int
    end: int
    core: Any  # weakref.ref to the cache's core
    tensor: int  # the core's tensor index (geometry.h numbering)
    slot_bytes: int  # bytes of one row
    token_bytes: int  # bytes between consecutive tokens of a row
    windowed: bool  # a sliding-window layer's tensor: its rows may have released heads


# (starts, regions), sorted by start; replaced whole under _lock, read without it.
_table: Tuple[List[int], List[_Region]] = ([], [])
_lock = threading.Lock()


def register(core: Any, config: Any) -> None:
    """Record the virtual tensors of a cache's core (weakly: a collected core's ranges find
    nothing, and are dropped at the next registration).

    Parameters
    ----------
    core : vattention._C.KVCacheCore
        The cache's core (``tensor_base(t)`` for every tensor ``t``).
    config : vattention.KVCacheConfig
        Its configuration (rows, strides and windows of each tensor).
    """
    geo = config.geometry
    layers = config.num_layers
    ref = weakref.ref(core)
    windows = config.layer_windows
    regions = []
    for t in range(geo.num_tensors):
        layer = 0 if geo.mega else t % layers
        slot_bytes = geo.slot_bytes(layer)
        start = core.tensor_base(t)
        regions.append(
            _Region(
                start=start,
                end=start + slot_bytes * geo.max_batch,
                core=ref,
                tensor=t,
                slot_bytes=slot_bytes,
                token_bytes=geo.token_bytes(layer),
                windowed=not geo.mega and windows[layer] > 0,
            )
        )
    global _table
    with _lock:
        # A collected core's reservations may be reused by this cache: its ranges go first.
        live = [r for r in _table[1] if r.core() is not None]
        merged = sorted(live + regions, key=lambda r: r.start)
        _table = ([r.start for r in merged], merged)


class CacheRows:
    """The cache rows a tensor views: row ``r`` of the tensor is the cache's slot
    ``first_slot + r``, and its token ``j`` the row's token ``first_token + j``.

    Built by :func:`cache_rows`; :meth:`check` says whether a kernel's reads are backed.
    """

    __slots__ = ("_core", "_tensor", "first_slot", "first_token", "windowed")

    def __init__(
        self, core: Any, tensor: int, first_slot: int, first_token: int, windowed: bool
    ) -> None:
        self._core, self._tensor = core, tensor
        self.first_slot, self.first_token, self.windowed = first_slot, first_token, windowed

    def same_rows(self, other: CacheRows) -> bool:
        """Whether ``other`` views the same rows of the same cache (K and V of one layer do:
        one check covers both)."""
        return (
            self._core is other._core
            and self.first_slot == other.first_slot
            and self.first_token == other.first_token
            and self.windowed == other.windowed
        )

    def check(
        self,
        rows: Sequence[int],
        ends: Sequence[int],
        begins: Optional[Sequence[int]] = None,
    ) -> None:
        """Raise unless request ``i`` may read tokens ``[begins[i], ends[i])`` of tensor row
        ``rows[i]`` (tokens counted in the tensor, so a view starting mid-row is handled).

        Parameters
        ----------
        rows : sequence of int
            Tensor rows (``cache_batch_idx``), one per request.
        ends : sequence of int
            One past the last token each request reads (``cache_seqlens + new``).
        begins : sequence of int, optional
            First token each request reads (a sliding window's start); only looked at on
            sliding-window layers, whose released heads are unmapped too. Default: 0.

        Raises
        ------
        UnmappedReadError
            A request would read past ``mapped_tokens`` of its row, or below a sliding window's
            released head. Attributes ``request``, ``slot``, ``length``, ``mapped_tokens`` (and
            ``window_start``).
        InvalidSlotError
            A row outside the cache's ``[0, max_batch_size)``.
        CacheClosedError
            The cache was closed: none of its rows is backed.
        """
        s0, t0 = self.first_slot, self.first_token
        slots = [s0 + r for r in rows] if s0 else list(rows)
        last = [t0 + e for e in ends] if t0 else list(ends)
        first: List[int] = []
        if begins is not None and self.windowed:
            first = [t0 + b for b in begins] if t0 else list(begins)
        self._core.check_reads(self._tensor, slots, first, last)


def cache_rows(tensor: torch.Tensor) -> Optional[CacheRows]:
    """The cache rows ``tensor`` views, or ``None`` for memory no live cache owns.

    ``tensor`` is a ``[rows, tokens, ...]`` view whose first element lies in a registered cache
    tensor and whose two leading strides are that cache tensor's row and token strides: every
    tensor a cache hands out (:meth:`~vattention.KVCache.layer`,
    :meth:`~vattention.KVCache.host_alias`, ``mega`` layer views) and their slices along rows and
    tokens. Views with other strides are not followed (``None``).
    """
    if tensor.dim() < 2:
        return None
    ptr = tensor.data_ptr()
    starts, regions = _table
    i = bisect.bisect_right(starts, ptr) - 1
    if i < 0:
        return None
    region = regions[i]
    if ptr >= region.end:
        return None
    core = region.core()
    if core is None:
        return None
    size = tensor.element_size()
    if (
        tensor.stride(0) * size != region.slot_bytes
        or tensor.stride(1) * size != region.token_bytes
    ):
        return None
    first_slot, in_row = divmod(ptr - region.start, region.slot_bytes)
    return CacheRows(core, region.tensor, first_slot, in_row // region.token_bytes, region.windowed)
