"""Prefix sharing: fork a slot, reuse another slot's prefix, copy shared pages before a rewrite.

:class:`vattention.KVCache` inherits these methods; they work on the core and config of
:class:`vattention.cache_base.CacheBase`.

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

from typing import Optional

from .arguments import as_tokens
from .cache_base import CacheBase

__all__ = ["SharingMixin"]


class SharingMixin(CacheBase):
    """fork / share_prefix / ensure_private for KVCache."""

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
        return self._core.fork(self._slot(src_slot, "src_slot"), n, self._stream(stream))

    def share_prefix(self, src_slot: int, dst_slot: int, num_tokens: int, *, stream=None) -> None:
        """Make ``dst_slot``'s first ``num_tokens`` tokens those of ``src_slot`` (prefix reuse).

        ``dst_slot`` must be fresh: active with ``seq_len 0``, as returned by :meth:`alloc`. The
        serving system decides what matches (e.g. by hashing prompt tokens). Same mechanics and
        errors as :meth:`fork`; afterwards ``seq_len(dst_slot) == num_tokens``. Pages ``dst_slot``
        inherited from an earlier request go back to the pool.
        """
        n = as_tokens(num_tokens, "num_tokens", self._config.max_seq_len)
        self._core.share_prefix(
            self._slot(src_slot, "src_slot"),
            self._slot(dst_slot, "dst_slot"),
            n,
            self._stream(stream),
        )

    def ensure_private(self, slot: int, start_token: int, *, stream=None) -> int:
        """Give ``slot`` private copies of its shared pages from ``start_token``'s page on.

        Afterwards tokens ``>= start_token`` of ``slot`` may be rewritten without affecting other
        slots. Returns the number of pages copied (0 when none was shared). All or nothing on
        :class:`OutOfPagesError`. ``0 <= start_token <= seq_len(slot)``.
        """
        start = as_tokens(start_token, "start_token", self._config.max_seq_len)
        return self._core.ensure_private(self._slot(slot), start, self._stream(stream))
