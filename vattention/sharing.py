"""Prefix sharing, swap to host memory and victim selection: the KVCache methods of issue 7.

Kept out of cache.py so that file stays small; :class:`vattention.KVCache` inherits these. Both
work on the core and config of :class:`vattention.core_handle.CoreHandle`.

The read-only contract
----------------------
After ``fork``/``share_prefix`` the tokens below the fork point are backed, in whole pages, by
physical pages that several slots map (the same page at several virtual addresses). **A slot's
tokens below its fork point are read-only**: only append past them. A serving system does that
naturally (KV entries of past tokens never change). To rewrite them (beam search rewinding into
the shared prefix), call :meth:`ensure_private` first; it replaces the shared pages from a token
on with private copies. Writing into a shared page without it silently changes every slot and
swap handle that shares it.
"""

from __future__ import annotations

from typing import List, Optional

from .arguments import as_handle, as_stream as _stream, as_tokens
from .config import Size, parse_size
from .core_handle import CoreHandle


class SharingMixin(CoreHandle):
    """fork / share_prefix / ensure_private / swap_out / swap_in / pick_victims for KVCache."""

    def fork(self, src_slot: int, num_tokens: Optional[int] = None, *, stream=None) -> int:
        """A new active slot whose first ``num_tokens`` tokens equal ``src_slot``'s, in every layer.

        Pages wholly below ``num_tokens`` are shared (mapped, not copied); the partial last page is
        copied into a fresh page now, so both slots may append independently. The new slot's
        :meth:`seq_len` is ``num_tokens``; tokens below it are read-only in both slots (see the
        module docstring). Costs ``num_tensors`` fresh pages at most, whatever the prefix length.

        Parameters
        ----------
        src_slot : int
            An active slot.
        num_tokens : int, optional
            Tokens to share, ``0 <= num_tokens <= seq_len(src_slot)``; default: all of them.
        stream : torch.cuda.Stream or int, optional
            Orders the copy (CUDA); the call waits for it before returning.

        Raises :class:`InvalidSlotError` (src not active, no slot free),
        :class:`SequenceTooLongError` (num_tokens out of range), :class:`OutOfPagesError`
        (nothing changed).

        Examples
        --------
        >>> import torch, vattention
        >>> cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64,
        ...         max_batch_size=4, max_seq_len=4096, dtype=torch.float16, page_size="64KB")
        >>> with vattention.KVCache(cfg) as cache:
        ...     parent = cache.alloc()
        ...     cache.step({parent: 1000})
        ...     child = cache.fork(parent)
        ...     (cache.seq_len(child), cache.stats()["shared_pages"])  # 512 tokens/page: K, V
        (1000, 2)
        """
        n = as_tokens(num_tokens, "num_tokens", self._config.max_seq_len, none_as=-1)
        return self._core.fork(self._slot(src_slot, "src_slot"), n, _stream(stream))

    def share_prefix(self, src_slot: int, dst_slot: int, num_tokens: int, *, stream=None) -> None:
        """Make ``dst_slot``'s first ``num_tokens`` tokens those of ``src_slot`` (prefix reuse).

        ``dst_slot`` must be fresh: active with ``seq_len 0``, as returned by :meth:`alloc`. The
        serving system decides what matches (e.g. by hashing prompt tokens). Same mechanics and
        errors as :meth:`fork`; afterwards ``seq_len(dst_slot) == num_tokens``. Pages ``dst_slot``
        inherited from an earlier request go back to the pool.
        """
        n = as_tokens(num_tokens, "num_tokens", self._config.max_seq_len)
        self._core.share_prefix(self._slot(src_slot, "src_slot"), self._slot(dst_slot, "dst_slot"),
                                n, _stream(stream))

    def ensure_private(self, slot: int, start_token: int, *, stream=None) -> int:
        """Give ``slot`` private copies of its shared pages from ``start_token``'s page on.

        Afterwards tokens ``>= start_token`` of ``slot`` may be rewritten without affecting other
        slots. Returns the number of pages copied (0 when none was shared). All or nothing on
        :class:`OutOfPagesError`. ``0 <= start_token <= seq_len(slot)``.
        """
        start = as_tokens(start_token, "start_token", self._config.max_seq_len)
        return self._core.ensure_private(self._slot(slot), start, _stream(stream))

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
        return self._core.swap_out(self._slot(slot), _stream(stream))

    def swap_in(self, handle: int, *, stream=None) -> int:
        """Restore a handle from :meth:`swap_out` into a slot (maybe another); returns the slot.

        Contents are bit-identical, ``seq_len`` and the read-only prefix are restored, the handle
        is consumed. Raises :class:`OutOfPagesError` or :class:`InvalidSlotError` (no slot free,
        unknown handle) with nothing changed.
        """
        return self._core.swap_in(as_handle(handle), _stream(stream))

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
        """
        return self._core.pick_victims(parse_size(bytes_needed, name="bytes_needed"))
