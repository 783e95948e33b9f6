"""CoreHandle: what the classes making up :class:`vattention.KVCache` share.

``KVCache`` is its slot, step and tensor API (cache.py) plus the fork/swap API of
:class:`vattention.sharing.SharingMixin` (sharing.py). Both work on one C++ core and the config it
was built from; this base class owns those two and the slot check both use, so neither half
reaches into the other's privates.
"""

from __future__ import annotations

from . import _C
from .arguments import as_slot
from .config import KVCacheConfig

__all__ = ["CoreHandle"]


class CoreHandle:
    """One ``vattention._C.KVCacheCore`` and the :class:`KVCacheConfig` it was built from."""

    _config: KVCacheConfig
    _core: _C.KVCacheCore

    def _attach(self, config: KVCacheConfig, core: _C.KVCacheCore) -> None:
        self._config = config
        self._core = core

    def _slot(self, value, name: str = "slot") -> int:
        """``value`` as a slot index of this cache (typed errors naming ``name`` and the range)."""
        return as_slot(value, self._config.max_batch_size, name)
