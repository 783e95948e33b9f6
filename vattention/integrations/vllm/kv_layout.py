"""How vLLM's KV cache groups and blocks become one vattention cache whose pages its blocks name.

vLLM's KV cache manager hands every request a block table per KV cache group (one group for most
models; a full-attention group and sliding-window groups for hybrid models such as Gemma 3) and
decides which blocks are fresh and which are prefix-cache hits. The plugin's cache names its
physical pages by those block ids (``KVCacheConfig(num_blocks=...)``, docs/guide.md "Pages named by
an engine's blocks"): a page index of a request's row holds exactly one vLLM block, in every
tensor of the block's group. So:

* ``page_bytes = block_size x unit_bytes`` (``unit_bytes``: one token's bytes in one tensor, the
  gcd over tensors with per-layer shapes), and the block size must make that a multiple of the
  backend's mapping granularity (:func:`aligned_block_size`; the plugin sets it at start-up);
* the memory vLLM would have allocated, ``num_blocks`` blocks of its widest group, is the most
  the cache may hold; which blocks have pages, and how many pages a step may hold, the
  scheduler's elastic block pool decides (elastic.py).

This module reads vLLM's objects by their attributes only (no vLLM import), so it is tested without
vLLM.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Tuple

import torch

from ...config import KVCacheConfig
from ...errors import ConfigError

__all__ = [
    "KVLayout",
    "LAYOUTS",
    "aligned_block_size",
    "huge_block_size",
    "kv_cache_dtype",
    "kv_layout",
    "layer_layout_mappings",
    "model_unit_bytes",
    "token_unit_bytes",
]

LAYOUTS = ("mega", "layer")
# vLLM's --kv-cache-dtype -> the cache's element type ("auto": the model's dtype).
FP8_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_PROBE_PAGE = 1 << 30  # bytes: holds any token row, to ask a config for its token stride


def kv_cache_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for vLLM's ``--kv-cache-dtype``.

    >>> kv_cache_dtype("auto", torch.bfloat16), kv_cache_dtype("fp8", torch.bfloat16)
    (torch.bfloat16, torch.float8_e4m3fn)
    """
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype not in FP8_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype={cache_dtype!r} is not supported by vattention's vLLM "
            f"plugin; use auto or one of {sorted(FP8_DTYPES)}"
        )
    return FP8_DTYPES[cache_dtype]


def token_unit_bytes(
    layout: str, num_kv_heads: Sequence[int], head_dims: Sequence[int], dtype: torch.dtype
) -> int:
    """Bytes of one token per page-index unit: one layer's row (``layer``), every layer's
    (``mega``), the gcd over layers with per-layer shapes. A page of ``block_size`` times this
    holds one block.

    >>> token_unit_bytes("mega", [2, 2], [32, 32], torch.float32)
    512
    >>> token_unit_bytes("layer", [2, 4], [32, 32], torch.float32)
    256
    """
    if layout not in LAYOUTS:
        raise ConfigError(f"layout={layout!r} must be one of {LAYOUTS}")
    return KVCacheConfig(
        num_layers=len(num_kv_heads),
        num_kv_heads=list(num_kv_heads),
        head_dim=list(head_dims),
        max_batch_size=1,
        max_seq_len=1,
        dtype=dtype,
        page_size=_PROBE_PAGE,
        layout=layout,
    ).unit_bytes


def aligned_block_size(block_size: int, unit_bytes: int, granularity: int) -> int:
    """Smallest multiple of ``block_size`` whose block is a whole number of ``granularity`` bytes.

    >>> aligned_block_size(128, 256, 4096)          # 128 * 256 = 32 KB: already aligned
    128
    >>> aligned_block_size(16, 2048, 2 << 20)       # CUDA, Llama-3-8B layer layout: 2 MB blocks
    1024
    """
    if block_size < 1 or unit_bytes < 1 or granularity < 1:
        raise ValueError(
            f"block_size={block_size}, unit_bytes={unit_bytes} and "
            f"granularity={granularity} must be >= 1"
        )
    step = granularity // math.gcd(granularity, unit_bytes)  # tokens per aligned unit
    return block_size * step // math.gcd(block_size, step)  # lcm(block_size, step)


def huge_block_size(block_size: int, unit_bytes: int, huge_bytes: int, max_factor: int = 2) -> int:
    """``block_size``, or its smallest multiple whose block is a whole number of ``huge_bytes``
    (the host backend's huge pages, :func:`vattention.backends.host_huge_unit`) where that is at
    most ``max_factor`` times ``block_size``: a prefix-cache hit then lands on a boundary at most
    that much coarser.

    >>> huge_block_size(128, 8192, 2 << 20)     # a 1 MB page becomes one 2 MB huge page
    256
    >>> huge_block_size(128, 2048, 2 << 20)     # 256 KB: 8x the block would be needed
    128
    >>> huge_block_size(128, 16384, 2 << 20)    # already 2 MB
    128
    >>> huge_block_size(128, 8192, 0)           # no huge pages here
    128
    """
    if huge_bytes <= 0:
        return block_size
    huge = aligned_block_size(block_size, unit_bytes, huge_bytes)
    return huge if huge <= max_factor * block_size else block_size


def layer_layout_mappings(
    num_slots: int, max_seq_len: int, block_size: int, num_layers: int
) -> int:
    """The most page mappings a ``layer``-layout cache can hold: every page index of every row,
    in each layer's K and V tensors. Each mapping sits at its own page of the reserved rows, so
    no budget or sharing of pages between rows (prefix hits) can exceed this.

    >>> layer_layout_mappings(16, 4096, 128, 4)       # bench vllm's small model: 16 x 32 x 2 x 4
    4096
    >>> layer_layout_mappings(256, 8192, 128, 32)     # vLLM's CPU defaults, an 8B model
    1048576
    >>> layer_layout_mappings(4, 1000, 128, 2)        # a row's last page index is partly used
    128
    """
    return num_slots * -(-max_seq_len // block_size) * 2 * num_layers


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """vLLM's KV cache (groups, blocks) as one vattention cache.

    ``layer_names[i]`` is the vLLM attention layer whose K/V are ``cache.layer(i)``; layers are in
    group order (group 0's, then group 1's, ...), ``layer_groups[i]`` is layer i's group.

    Examples
    --------
    >>> from types import SimpleNamespace as NS
    >>> full = NS(block_size=16, num_kv_heads=2, head_size=32, sliding_window=None)
    >>> swa = NS(block_size=16, num_kv_heads=2, head_size=32, sliding_window=64)
    >>> kv = NS(num_blocks=100, kv_cache_groups=[NS(kv_cache_spec=full, layer_names=["l.1"]),
    ...                                          NS(kv_cache_spec=swa, layer_names=["l.0"])])
    >>> layout = kv_layout(kv, torch.float32, "auto")
    >>> layout.layout, layout.layer_groups, layout.windows, layout.block_size
    ('layer', (0, 1), (None, 64), 16)
    >>> cfg = layout.cache_config(max_batch_size=4, max_seq_len=256, device="cpu",
    ...                           block_cache=True)
    >>> cfg.page_bytes, cfg.tokens_per_page, layout.memory_budget(cfg)   # 100 blocks x 2 pages
    (4096, 16, 819200)
    """

    layer_names: Tuple[str, ...]
    layer_groups: Tuple[int, ...]
    windows: Tuple[Optional[int], ...]
    num_kv_heads: Tuple[int, ...]
    head_dims: Tuple[int, ...]
    dtype: torch.dtype
    block_size: int
    num_blocks: int
    layout: str

    @property
    def num_groups(self) -> int:
        return max(self.layer_groups) + 1

    def cache_config(
        self, *, max_batch_size: int, max_seq_len: int, device: str, block_cache: bool
    ) -> KVCacheConfig:
        """The cache: one page index per vLLM block, pages named by vLLM's block ids."""
        unit = token_unit_bytes(self.layout, self.num_kv_heads, self.head_dims, self.dtype)
        return KVCacheConfig(
            num_layers=len(self.layer_names),
            num_kv_heads=list(self.num_kv_heads),
            head_dim=list(self.head_dims),
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            dtype=self.dtype,
            device=device,
            page_size=self.block_size * unit,
            layout=self.layout,
            sliding_window=list(self.windows) if any(self.windows) else None,
            num_blocks=self.num_blocks,
            block_cache=block_cache,
            layer_groups=list(self.layer_groups) if self.num_groups > 1 else None,
        )

    def block_bytes(self) -> int:
        """Bytes of one vLLM block's pages in this worker's cache (every tensor of its group)."""
        config = self.cache_config(
            max_batch_size=1, max_seq_len=self.block_size, device="cpu", block_cache=True
        )
        return config.geometry.group_width * config.page_bytes

    def memory_budget(self, config: KVCacheConfig) -> int:
        """Bytes of the ``num_blocks`` blocks vLLM would have allocated (its widest group's)."""
        return self.num_blocks * config.geometry.group_width * config.page_bytes


def kv_layout(kv_cache_config, dtype: torch.dtype, layout: str) -> KVLayout:
    """vLLM's ``KVCacheConfig`` (groups of layers sharing a spec, ``num_blocks``) as a
    :class:`KVLayout`. ``layout``: ``"auto"`` (``mega`` for one group, ``layer`` for several),
    ``"mega"`` or ``"layer"``. Raises :class:`ConfigError` for what one cache cannot hold, naming
    it.
    """
    groups = list(kv_cache_config.kv_cache_groups)
    names, group_of, windows, heads, dims, block_sizes = [], [], [], [], [], set()
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        for needed in ("block_size", "num_kv_heads", "head_size"):
            if not hasattr(spec, needed):
                raise ConfigError(
                    f"vattention's vLLM plugin serves attention KV caches; KV cache "
                    f"group {g} is a {kind} (unset VATTENTION_VLLM)"
                )
        if getattr(spec, "attention_chunk_size", None):
            raise ConfigError(
                f"KV cache group {g} ({kind}) uses chunked local attention, which "
                "vattention's vLLM plugin does not serve (unset VATTENTION_VLLM)"
            )
        block_sizes.add(spec.block_size)
        for name in group.layer_names:
            names.append(name)
            group_of.append(g)
            windows.append(getattr(spec, "sliding_window", None) or None)
            heads.append(spec.num_kv_heads)
            dims.append(spec.head_size)
    if len(block_sizes) != 1:
        raise ConfigError(
            f"vLLM's KV cache groups have block sizes {sorted(block_sizes)}; one "
            "vattention cache holds one block per page index in every group, so "
            "they must share one block size (layers of different page sizes)"
        )
    if layout == "auto":
        layout = "mega" if len(groups) == 1 and len(set(zip(heads, dims))) == 1 else "layer"
    if layout == "mega" and len(groups) > 1:
        raise ConfigError(
            f"this model has {len(groups)} KV cache groups (hybrid sliding-window "
            "and full-attention layers): they need VATTENTION_VLLM_LAYOUT=layer"
        )
    return KVLayout(
        tuple(names),
        tuple(group_of),
        tuple(windows),
        tuple(heads),
        tuple(dims),
        dtype,
        block_sizes.pop(),
        int(kv_cache_config.num_blocks),
        layout,
    )


def model_unit_bytes(
    layout: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """:func:`token_unit_bytes` of a model of uniform layers (what start-up knows)."""
    return token_unit_bytes(layout, [num_kv_heads] * num_layers, [head_dim] * num_layers, dtype)
