"""Swap to host memory and preemption: save a slot's pages, restore them, pick whom to preempt.

A serving system that runs out of pages preempts requests: :meth:`SwapMixin.pick_victims`
suggests which, and :meth:`SwapMixin.swap_out` keeps a victim's tokens in host memory (or
``KVCache.free`` drops them for recomputation). :class:`vattention.KVCache` inherits these
methods; they work on the core and config of :class:`vattention.cache_base.CacheBase`. Pages a
swapped slot shares with others (:mod:`vattention.sharing`) are kept by reference, not copied.
"""

from __future__ import annotations

from typing import List, Optional

from .arguments import as_handle
from .cache_base import CacheBase
from .config import Size, parse_size

__all__ = ["SwapMixin"]


class SwapMixin(CacheBase):
    """swap_out / swap_in / swap_drop / set_swap_budget / pick_victims for KVCache."""

    def swap_out(self, slot: int, *, stream=None) -> int:
        """Save ``slot``'s tokens to host memory and free the slot; returns a handle.

        Saves whole pages up to :meth:`seq_len` (``pages_for`` rounding). Pages another active
        slot still maps are kept on the device by reference (freeing them would free nothing);
        the rest is copied to host memory (pinned on CUDA), each physical page once even when
        several handles hold it. The slot's pages are unmapped at once.

        Raises :class:`SwapSpaceError` (attributes ``bytes_needed``, ``bytes_available``) when the
        swap budget is too small, :class:`InvalidSlotError` if ``slot`` is not active; nothing
        changes in either case.

        Examples
        --------
        >>> import torch, vattention
        >>> cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64,
        ...         max_batch_size=2, max_seq_len=1024, dtype=torch.float16, page_size="64KB")
        >>> with vattention.KVCache(cfg, swap_budget="1MB") as cache:
        ...     slot = cache.alloc()
        ...     cache.step({slot: 300})
        ...     handle = cache.swap_out(slot)
        ...     slot = cache.swap_in(handle)
        ...     cache.seq_len(slot)
        300
        """
        return self._core.swap_out(self._slot(slot), self._stream(stream))

    def swap_in(self, handle: int, *, stream=None) -> int:
        """Restore a handle from :meth:`swap_out` into a slot (maybe another); returns the slot.

        Contents are bit-identical, ``seq_len`` and the read-only prefix are restored, the handle
        is consumed. Raises :class:`OutOfPagesError` or :class:`InvalidSlotError` (no slot free,
        unknown handle) with nothing changed.
        """
        return self._core.swap_in(as_handle(handle), self._stream(stream))

    def swap_drop(self, handle: int) -> None:
        """Discard a swapped-out slot: its host memory and device references are released."""
        self._core.swap_drop(as_handle(handle))

    def set_swap_budget(self, budget: Optional[Size]) -> None:
        """Cap host memory for swapped slots (bytes or ``"16GB"``; ``None``: no cap).

        Lowering it below what handles hold drops nothing; further swap_out calls fail instead.
        """
        value = -1 if budget is None else parse_size(budget, name="swap_budget")
        self._core.set_swap_budget(value)

    def pick_victims(self, bytes_needed: Size) -> List[int]:
        """Suggest active slots to preempt so that ``bytes_needed`` bytes of pages come free.

        Policy: least recently stepped first (its request has waited longest already), ties by
        fewest tokens (cheapest to recompute), then lowest slot. Only pages that would really
        return to the pool count: a page still mapped by a slot not in the list frees nothing.
        Returns the shortest such prefix of that order, every active slot if even that is not
        enough, ``[]`` for 0 bytes. The caller decides: :meth:`swap_out` or :meth:`free` them.

        Examples
        --------
        >>> import torch, vattention
        >>> cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64,
        ...         max_batch_size=2, max_seq_len=1024, dtype=torch.float16, page_size="64KB")
        >>> with vattention.KVCache(cfg) as cache:     # 512 tokens a page
        ...     a, b = cache.alloc(), cache.alloc()
        ...     cache.step({a: 600})                   # 2 pages of K, 2 of V
        ...     cache.step({b: 100})                   # b stepped last: a has waited longest
        ...     cache.pick_victims(cfg.page_bytes) == [a], len(cache.pick_victims(5 << 16))
        (True, 2)
        """
        return self._core.pick_victims(parse_size(bytes_needed, name="bytes_needed"))
