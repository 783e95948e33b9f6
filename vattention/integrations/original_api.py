"""The original vAttention library's function-level API, on top of :class:`vattention.KVCache`.

Code written against the reference implementation (``import vattention`` as a CUDA extension with
module-level functions, one global cache per process) runs unchanged with
``import vattention.integrations.original_api as vattention``. Semantics follow the original;
where the original misbehaved, this module does the safe thing and ``docs/integrations.md`` lists
each difference:

* ``step`` is transactional: on a shortage it raises :class:`vattention.OutOfPagesError` with
  nothing mapped (the original raised ``RuntimeError`` after mapping some requests' pages).
* ``alloc_new_batch_idx`` prefers a free slot that still holds pages (the original's best-fit
  test could never leave the first free slot); it still returns ``-1`` when no slot is free.
* ``free_batch_idx`` of a slot that is not allocated raises :class:`vattention.InvalidSlotError`
  (the original silently accepted it); ``step`` with a non-zero length for an unallocated slot
  raises too (the original silently started mapping it).
* a length beyond ``max_context_length`` raises :class:`vattention.SequenceTooLongError` (the
  original built a ``runtime_error`` without throwing it and returned).

Units: a *KV block* is what the original counted: the pages that back ``tokens_per_page`` tokens
of one request in every K and V tensor (``2 * num_layers`` pages, or 2 with ``megacache``).

Examples
--------
>>> import torch, vattention.integrations.original_api as vattn
>>> kv = vattn.init_kvcache(2, 2, 16, 4, 128, "cpu", torch.float16, 4096)
>>> len(kv), tuple(kv[0].shape)
(4, (4, 128, 2, 16))
>>> idx = vattn.alloc_new_batch_idx(10)
>>> vattn.step([10 if i == idx else 0 for i in range(4)])
>>> kv[0][idx, :10].zero_().abs().sum().item()
0.0
>>> vattn.free_batch_idx(idx); vattn.cleanup()
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import torch

from .. import KVCache, KVCacheConfig
from ..errors import InvalidSlotError, VAttentionError

__all__ = [
    "init_kvcache",
    "reserve_physical_pages",
    "alloc_new_batch_idx",
    "free_batch_idx",
    "step",
    "step_async",
    "num_free_kvblocks",
    "set_deferred_reclamation",
    "set_verbose",
    "show_kvcache_config",
    "show_allocator_state",
    "cleanup",
    "get_cache",
]

logger = logging.getLogger(__name__)


class _State:
    """The process-wide cache the original kept in C++ globals."""

    def __init__(self, cache: KVCache, megacache: bool) -> None:
        self.cache = cache
        self.megacache = megacache
        self.deferred = True
        self.requested: dict[int, int] = {}  # slot -> seqlen given to alloc_new_batch_idx


_state: Optional[_State] = None


def _require() -> _State:
    if _state is None:
        raise VAttentionError(f"{__name__}: call init_kvcache() first")
    return _state


def _device_name(device: Union[int, str, torch.device]) -> str:
    if isinstance(device, bool):
        raise VAttentionError(f"device={device!r} must be a CUDA ordinal or 'cpu'/'cuda:N'")
    return f"cuda:{device}" if isinstance(device, int) else str(device)


def init_kvcache(
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    max_batch_size: int,
    max_context_length: int,
    device: Union[int, str, torch.device],
    dtype: torch.dtype,
    page_size: int,
    megacache: bool = False,
) -> list[torch.Tensor]:
    """Create the process-wide KV cache and return its virtual tensors.

    Parameters
    ----------
    num_layers, num_kv_heads, head_size : int
        Model dimensions (``head_size`` = head_dim).
    max_batch_size : int
        Request slots (batch indices).
    max_context_length : int
        Tokens per slot.
    device : int, str or torch.device
        CUDA ordinal as in the original (``0`` -> ``"cuda:0"``), or ``"cpu"`` / ``"cuda:N"``.
    dtype : torch.dtype
    page_size : int
        Bytes per physical page (the original accepted 2 MB, or 64/128/256 KB with its driver).
    megacache : bool
        One K and one V tensor ``[B, S, L, H, D]`` instead of one per layer.

    Returns
    -------
    list of Tensor
        ``num_layers`` K tensors then ``num_layers`` V tensors ``[B, S, H, D]``; with
        ``megacache``, ``[K, V]`` each ``[B, S, L, H, D]``.

    Examples
    --------
    >>> import torch, vattention.integrations.original_api as vattn
    >>> k, v = vattn.init_kvcache(4, 2, 16, 2, 64, "cpu", torch.float32, 4096, megacache=True)
    >>> tuple(k.shape), tuple(k[:, :, 1].stride())
    ((2, 64, 4, 2, 16), (8192, 128, 16, 1))
    >>> vattn.cleanup()
    """
    global _state
    if _state is not None:
        logger.warning("init_kvcache called again: releasing the previous cache")
        cleanup()
    cfg = KVCacheConfig(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_size,
        max_batch_size=max_batch_size,
        max_seq_len=max_context_length,
        dtype=dtype,
        device=_device_name(device),
        page_size=page_size,
        layout="mega" if megacache else "layer",
    )
    cache = KVCache(cfg)
    _state = _State(cache, megacache)
    # The config keeps V (value_cache=True): the filters below drop nothing.
    if not megacache:
        return list(cache.k_cache) + [v for v in cache.v_cache if v is not None]
    return [t for t in cache.mega_tensors() if t is not None]


def get_cache() -> KVCache:
    """The :class:`vattention.KVCache` behind this API (to mix both styles)."""
    return _require().cache


def reserve_physical_pages(free_memory: int) -> int:
    """Pre-create pages worth ``free_memory`` bytes; return the pages in the pool.

    Examples
    --------
    >>> import torch, vattention.integrations.original_api as vattn
    >>> _ = vattn.init_kvcache(1, 1, 64, 2, 64, "cpu", torch.float32, 4096)
    >>> vattn.reserve_physical_pages(8 * 4096)
    8
    >>> vattn.cleanup()
    """
    state = _require()
    # As in the original, asking for more than the cache can ever map is not an error: the pool
    # is filled up to the cache's virtual size (KVCache.reserve refuses sizes beyond it).
    state.cache.reserve(min(int(free_memory), state.cache.config.virtual_bytes))
    return int(state.cache.stats()["pages_total"])


def alloc_new_batch_idx(seqlen: int) -> int:
    """Claim a free batch index for a request of ``seqlen`` tokens; ``-1`` if none is free.

    Pages are mapped by the next :func:`step` / :func:`step_async`, as in the original.

    Examples
    --------
    >>> import torch, vattention.integrations.original_api as vattn
    >>> _ = vattn.init_kvcache(1, 1, 64, 1, 64, "cpu", torch.float32, 4096)
    >>> vattn.alloc_new_batch_idx(5), vattn.alloc_new_batch_idx(5)
    (0, -1)
    >>> vattn.cleanup()
    """
    state = _require()
    try:
        slot = state.cache.alloc()
    except InvalidSlotError:
        return -1
    state.requested[slot] = int(seqlen)
    return slot


def free_batch_idx(idx: int) -> None:
    """Release batch index ``idx``; its pages stay mapped until reclaimed (deferred reclamation)."""
    state = _require()
    state.cache.free(int(idx))
    state.requested.pop(int(idx), None)
    if not state.deferred:
        state.cache.reclaim()


def _lengths(state: _State, seq_lens: Sequence[int]) -> dict[int, int]:
    values = [int(x) for x in (seq_lens.tolist() if hasattr(seq_lens, "tolist") else seq_lens)]
    size = state.cache.config.max_batch_size
    if len(values) != size:
        raise InvalidSlotError(
            f"seq_lens has {len(values)} entries; expected max_batch_size={size}"
        )
    active = set(state.cache.active_slots())
    stray = [i for i, n in enumerate(values) if n and i not in active]
    if stray:
        raise InvalidSlotError(
            f"seq_lens gives tokens to batch indices {stray} that are not "
            "allocated; call alloc_new_batch_idx() first"
        )
    return {slot: values[slot] for slot in sorted(active)}


def step(seq_lens: Sequence[int], eager_reclaim: bool = False) -> None:
    """Map pages so batch index ``i`` backs ``seq_lens[i]`` tokens (length ``max_batch_size``).

    ``seq_lens[i]`` is the request's context length for this iteration, new tokens included;
    ``0`` for free indices. With ``eager_reclaim``, pages of free indices are unmapped afterwards.
    Raises :class:`vattention.OutOfPagesError` (nothing mapped) when pages run out.
    """
    state = _require()
    state.cache.step(_lengths(state, seq_lens))
    if eager_reclaim or not state.deferred:
        state.cache.reclaim()


def step_async(seq_lens: Sequence[int]) -> None:
    """:func:`step` for this iteration, then map the next one (``seq_lens + 1``) in the
    background."""
    state = _require()
    lengths = _lengths(state, seq_lens)
    state.cache.step(lengths)
    limit = state.cache.config.max_seq_len
    state.cache.prefetch({slot: min(n + 1, limit) for slot, n in lengths.items() if n})
    if not state.deferred:
        state.cache.reclaim()


def num_free_kvblocks() -> int:
    """KV blocks available to new tokens: free pool pages plus mapped pages beyond any need.

    Examples
    --------
    >>> import torch, vattention.integrations.original_api as vattn
    >>> _ = vattn.init_kvcache(2, 1, 64, 2, 256, "cpu", torch.float32, 4096)
    >>> _ = vattn.reserve_physical_pages(8 * 4096)
    >>> vattn.num_free_kvblocks()       # 8 pages / (2 tensors * 2 layers)
    2
    >>> vattn.cleanup()
    """
    cache = _require().cache
    # Free pool pages plus what reclaiming idle slots and look-ahead would give (the core's own
    # accounting, the one step() uses).
    capacity = cache.capacity()
    return (capacity.pages_free + capacity.pages_reclaimable) // cache.config.pages_per_index


def set_deferred_reclamation(flag: bool) -> None:
    """``True`` (default): freed indices keep their pages for reuse; ``False``: return them at
    once."""
    _require().deferred = bool(flag)


def set_verbose(flag: bool) -> None:
    """Log this module's messages at INFO (``True``) or WARNING (``False``)."""
    logger.setLevel(logging.INFO if flag else logging.WARNING)


def show_kvcache_config() -> str:
    """Print (and return) the cache configuration, as the original's log lines."""
    cfg = _require().cache.config
    text = "\n".join(
        [
            f"Num layers: {cfg.num_layers}",
            f"Num kv_heads: {cfg.num_kv_heads}",
            f"Head size: {cfg.head_dim}",
            f"Max batch size: {cfg.max_batch_size}",
            f"Max context length: {cfg.max_seq_len}",
            f"Bytes per elem: {cfg.element_bytes}",
            f"Page size: {cfg.page_bytes}",
            f"Tokens per page: {cfg.tokens_per_page}",
            f"Layout: {cfg.layout}",
            f"virt_buff_size_per_req: {cfg.slot_bytes}",
            f"virt_buff_size: {cfg.max_batch_size * cfg.slot_bytes}",
        ]
    )
    print(text)
    return text


def show_allocator_state() -> str:
    """Print (and return) the free KV blocks and a ``reqId : seqlen : mapped : required`` table."""
    state = _require()
    cache, cfg = state.cache, state.cache.config
    per_block = cfg.pages_per_index  # pages of one KV block (page index) over all tensors
    lines = [
        f"Free pool: {int(cache.stats()['pages_free']) // per_block} KV blocks",
        "reqId : seqlen: mapped: required",
    ]
    for slot in range(cfg.max_batch_size):
        seq = cache.seq_len(slot) or state.requested.get(slot, 0)
        mapped = cfg.pages_for_tokens(cache.mapped_tokens(slot)) // per_block
        required = cfg.pages_for_tokens(seq) // per_block
        lines.append(f"{slot:>8}: {seq:>8} : {mapped:>8} : {required:>8}")
    text = "\n".join(lines)
    print(text)
    return text


def cleanup() -> None:
    """Wait for background mapping, release the cache and its pages; ``init_kvcache`` may follow."""
    global _state
    if _state is None:
        return
    state, _state = _state, None
    state.cache.wait()
    state.cache.close()
