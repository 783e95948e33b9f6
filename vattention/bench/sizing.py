"""What one request or one budget needs under each allocator (page arithmetic, OS limits).

Mirrors ``KVCacheConfig``: a ``layer`` cache has ``2 * L`` tensors with ``H * D * elem`` bytes
per token, a ``mega`` cache 2 tensors with ``L * H * D * elem`` bytes per token; a slot grows by
page indices, one page per tensor (with per-layer shapes: ``token_bytes / unit_bytes`` pages per
tensor, ``unit_bytes`` the gcd of the layers' token bytes).
"""

from __future__ import annotations

import math
from typing import Optional

from .workload import ModelShape

__all__ = ["page_geometry", "window_pages_per_index", "min_bytes_for_request",
           "host_mapping_problem"]


def min_bytes_for_request(name: str, model: ModelShape, num_tokens: int,
                          max_seq_len: int) -> int:
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
    pages_per_index, unit_bytes, page_bytes = page_geometry(model, parts[1], parts[2])
    return pages_per_index * -(-num_tokens * unit_bytes // page_bytes) * page_bytes


def page_geometry(model: ModelShape, layout: str, page_size: str):
    """``(pages_per_index, unit_bytes, page_bytes)`` of a vattention cache, as in
    ``KVCacheConfig``: one page index holds ``page_bytes // unit_bytes`` tokens and takes
    ``pages_per_index`` pages (``2 * L`` or 2 with one shape for every layer).

    >>> from vattention.bench.workload import MODELS
    >>> page_geometry(MODELS["llama3-8b"], "mega", "2MB")
    (2, 65536, 2097152)
    >>> page_geometry(MODELS["gemma4-defaults"], "layer", "2MB")   # 25 x 1 + 5 x 2 pages, K and V
    (70, 2048, 2097152)
    """
    page_bytes = int(page_size[:-2]) << {"KB": 10, "MB": 20, "GB": 30}[page_size[-2:].upper()]
    if layout == "layer":
        unit, pages = _layer_index_pages(model)
        return 2 * sum(pages), unit, page_bytes
    return 2, sum(model.layer_token_bytes()), page_bytes


def _layer_index_pages(model: ModelShape):
    """``layer`` layout: the gcd of the layers' token bytes, and each layer's pages per index."""
    per_layer = model.layer_token_bytes()
    unit = math.gcd(*per_layer)
    return unit, [b // unit for b in per_layer]


def window_pages_per_index(model: ModelShape, layout: str) -> int:
    """Pages of one page index that lie in sliding-window tensors (what a released index frees).

    >>> from vattention.bench.workload import MODELS
    >>> window_pages_per_index(MODELS["gemma4-defaults"], "layer")
    50
    """
    if not (model.window and model.window_layers):
        return 0
    if layout == "mega":
        return 2
    return 2 * sum(_layer_index_pages(model)[1][:model.window_layers])


def host_mapping_problem(name: str, model: ModelShape, budget_bytes: int) -> Optional[str]:
    """Why the real host-backend cache for ``name`` cannot fill ``budget_bytes``, or None.

    The host backend maps every page with its own ``mmap``; Linux caps a process's mappings at
    ``vm.max_map_count``, so the backend refuses page mappings beyond its share of that limit
    (``vattention._C.host_mapping_limit()``) with ``OutOfPagesError``. A run whose budget needs
    more page mappings would measure that limit instead of the allocator, so it is skipped.

    Examples
    --------
    >>> from vattention.bench.workload import MODELS
    >>> host_mapping_problem("ideal", MODELS["llama3-8b"], 8 << 30) is None
    True
    """
    if not name.startswith("vattention-"):
        return None
    from vattention import _C

    limit = _C.host_mapping_limit()
    _, layout, page = name.split("-")[:3]
    _, _, page_bytes = page_geometry(model, layout, page)
    pages = budget_bytes // page_bytes
    if pages <= limit:
        return None
    return (f"skipped: the host backend maps each {page} page separately; this budget needs up "
            f"to {pages} page mappings, over the {limit} this process may hold (vm.max_map_count). "
            f"Use 2MB pages, a budget <= {(limit * page_bytes) >> 20}MB, or raise vm.max_map_count")
