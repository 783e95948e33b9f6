"""CacheBase: the config and C++ core that every part of :class:`vattention.KVCache` works on.

``KVCache`` is its slot, step and tensor API (cache.py) plus the prefix-sharing API of
:class:`vattention.sharing.SharingMixin` (sharing.py) and the swap and preemption API of
:class:`vattention.swap.SwapMixin` (swap.py). All of them drive one C++ core built from one
config; this base class owns those two and the slot check they all use, so no part reaches into
another's privates.
"""

from __future__ import annotations

from . import _C, cache_reads
from .arguments import as_slot, as_stream
from .config import KVCacheConfig
from .streams import current_stream

__all__ = ["CacheBase"]


class CacheBase:
    """One ``vattention._C.KVCacheCore`` and the :class:`KVCacheConfig` it was built from."""

    _config: KVCacheConfig
    _core: _C.KVCacheCore

    def _attach(self, config: KVCacheConfig, core: _C.KVCacheCore) -> None:
        self._config = config
        self._core = core
        cache_reads.register(core, config)  # integrations find the cache of a tensor they get

    def _slot(self, value, name: str = "slot") -> int:
        """``value`` as a slot index of this cache (typed errors naming ``name`` and the range)."""
        return as_slot(value, self._config.max_batch_size, name)

    def _stream(self, stream) -> int:
        """``stream`` as a driver handle; None: the caller's current torch stream on this cache's
        device (:func:`vattention.streams.current_stream`)."""
        return current_stream(self._config.device) if stream is None else as_stream(stream)
