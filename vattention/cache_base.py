"""CacheBase: the config and C++ core that every part of :class:`vattention.KVCache` works on.

``KVCache`` is its slot, step and tensor API (cache.py) plus the prefix-sharing API of
:class:`vattention.sharing.SharingMixin` (sharing.py) and the swap and preemption API of
:class:`vattention.swap.SwapMixin` (swap.py). All of them drive one C++ core built from one
config; this base class owns those two and the slot check they all use, so no part reaches into
another's privates.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from . import _C, cache_reads
from .arguments import as_slot, as_stream
from .config import KVCacheConfig
from .streams import current_stream

__all__ = ["CacheBase"]


class CacheBase:
    """One ``vattention._C.KVCacheCore`` and the :class:`KVCacheConfig` it was built from."""

    _config: KVCacheConfig
    _core: _C.KVCacheCore
    # The caller's current stream on this cache's device, looked up when called: what a call
    # that names no stream orders its work on. step() hands the lookup itself to the core, which
    # calls it only when the step has work to order (one that maps nothing never does: on a GPU,
    # asking torch for its current stream costs more than the rest of such a step).
    _caller_stream: Callable[[], int]
    # _core.step bound to the core as a plain function: the decode hot path's entry, which pays
    # none of pybind11's per-call dispatch.
    _core_step: Callable[..., None]

    def _attach(self, config: KVCacheConfig, core: _C.KVCacheCore) -> None:
        self._config = config
        self._core = core
        cache_reads.register(core, config)  # integrations find the cache of a tensor they get
        self._caller_stream = partial(current_stream, config.device)
        self._core_step = core.stepper()

    def _slot(self, value, name: str = "slot") -> int:
        """``value`` as a slot index of this cache (typed errors naming ``name`` and the range)."""
        return as_slot(value, self._config.max_batch_size, name)

    def _stream(self, stream) -> int:
        """``stream`` as a driver handle; None: the caller's current torch stream on this cache's
        device (:func:`vattention.streams.current_stream`)."""
        return self._caller_stream() if stream is None else as_stream(stream)
