"""What one request or one budget needs under each allocator (page arithmetic, OS limits).

Every vattention number comes from the :class:`vattention.KVCacheConfig` of the cache the
benchmark builds (:func:`cache_config`), whose sizes come from the core's one geometry: nothing
here re-derives page arithmetic.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..backends import host_mapping_limit
from ..config import KVCacheConfig
from .workload import ModelShape

__all__ = [
    "cache_config",
    "page_geometry",
    "window_pages_per_index",
    "min_bytes_for_request",
    "host_mapping_problem",
]


def cache_config(
    model: ModelShape,
    layout: str,
    page_size: str,
    *,
    max_batch_size: int = 1,
    max_seq_len: int = 1,
    release: bool = True,
    reclaim: str = "deferred",
) -> KVCacheConfig:
    """The host-backend ``KVCacheConfig`` that holds ``model`` in ``layout`` with ``page_size``.

    ``release``: give the cache the model's sliding windows (``False``: every layer keeps every
    token). Raises :class:`vattention.ConfigError` for what the cache cannot hold (e.g. per-layer
    shapes or windows in the ``mega`` layout).

    >>> from vattention.bench.workload import MODELS
    >>> cache_config(MODELS["llama3-8b"], "mega", "2MB").tokens_per_page
    32
    """
    heads, dims = zip(*model.layer_shapes())
    return KVCacheConfig(
        num_layers=model.num_layers,
        num_kv_heads=heads,
        head_dim=dims,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        dtype=getattr(torch, model.dtype),
        device="cpu",
        page_size=page_size,
        layout=layout,
        reclaim=reclaim,
        sliding_window=model.sliding_window() if release else None,
    )


def min_bytes_for_request(name: str, model: ModelShape, num_tokens: int, max_seq_len: int) -> int:
    """Bytes allocator ``name`` needs to hold one request of ``num_tokens`` tokens alone.

    For vattention rows this is the page arithmetic of ``KVCacheConfig.pages_for_tokens``:
    each of the ``2 * L`` (layer) or 2 (mega) tensors rounds up to whole pages.

    Examples
    --------
    >>> from vattention.bench.workload import MODELS
    >>> m = MODELS["llama3-8b"]
    >>> min_bytes_for_request("vattention-layer-2MB", m, 1, 4096) >> 20  # 64 pages
    128
    >>> min_bytes_for_request("vattention-mega-2MB", m, 1, 4096) >> 20   # 2 pages
    4
    """
    bpt = model.bytes_per_token
    if name == "static-max":
        return max_seq_len * bpt
    if name == "paged-16":
        return -(-num_tokens // 16) * 16 * bpt
    if not name.startswith("vattention-"):
        return num_tokens * bpt
    parts = name.split("-")
    if parts[3:] == ["padded"]:
        model = model.padded()
    cfg = cache_config(model, parts[1], parts[2], release=False)
    return cfg.pages_for_tokens(num_tokens) * cfg.page_bytes


def page_geometry(model: ModelShape, layout: str, page_size: str):
    """``(pages_per_index, unit_bytes, page_bytes)`` of the vattention cache for ``model``: one
    page index holds ``page_bytes // unit_bytes`` tokens and takes ``pages_per_index`` pages.

    >>> from vattention.bench.workload import MODELS
    >>> page_geometry(MODELS["llama3-8b"], "mega", "2MB")
    (2, 65536, 2097152)
    >>> page_geometry(MODELS["gemma4-defaults"], "layer", "2MB")   # 25 x 1 + 5 x 2 pages, K and V
    (70, 2048, 2097152)
    """
    cfg = cache_config(model, layout, page_size, release=False)
    return cfg.pages_per_index, cfg.unit_bytes, cfg.page_bytes


def window_pages_per_index(model: ModelShape, layout: str) -> int:
    """Pages of one page index that lie in sliding-window tensors (what a released index frees).

    >>> from vattention.bench.workload import MODELS
    >>> window_pages_per_index(MODELS["gemma4-defaults"], "layer")
    50
    """
    if not (model.window and model.window_layers):
        return 0
    cfg = cache_config(model, layout, "2MB", release=False)
    if layout == "mega":
        return cfg.pages_per_index  # one page per tensor holds every layer, windowed ones too
    return cfg.kv_tensors * sum(cfg.index_pages(i) for i in range(model.window_layers))


def host_mapping_problem(name: str, model: ModelShape, budget_bytes: int) -> Optional[str]:
    """Why the real host-backend cache for ``name`` cannot fill ``budget_bytes``, or None.

    The host backend maps every page with its own ``mmap``; Linux caps a process's mappings at
    ``vm.max_map_count``, so the backend refuses page mappings beyond its share of that limit
    (:func:`vattention.backends.host_mapping_limit`) with ``OutOfPagesError``. A run whose budget
    needs more page mappings would measure that limit instead of the allocator, so it is skipped.

    Examples
    --------
    >>> from vattention.bench.workload import MODELS
    >>> host_mapping_problem("ideal", MODELS["llama3-8b"], 8 << 30) is None
    True
    """
    if not name.startswith("vattention-"):
        return None
    limit = host_mapping_limit()
    _, layout, page = name.split("-")[:3]
    _, _, page_bytes = page_geometry(model, layout, page)
    pages = budget_bytes // page_bytes
    if pages <= limit:
        return None
    return (
        f"skipped: the host backend maps each {page} page separately; this budget needs up "
        f"to {pages} page mappings, over the {limit} this process may hold (vm.max_map_count). "
        f"Use 2MB pages, a budget <= {(limit * page_bytes) >> 20}MB, or raise vm.max_map_count"
    )
