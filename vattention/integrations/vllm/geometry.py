"""How vLLM's block accounting and vattention's pages are made to agree.

vLLM's scheduler admits and preempts requests by counting KV blocks of ``block_size`` tokens
(every layer, K and V). vattention maps pages of ``tokens_per_page`` tokens per virtual tensor.
If a page held more tokens than a block, a request would need more physical memory than vLLM
counted for it, and the cache would run out of pages before vLLM preempted anyone. So a page
holds **exactly one block**: ``page_bytes = block_size * tensor_token_bytes``. Then the pages a
request holds are exactly the blocks vLLM charged it, and the memory vLLM would have allocated
(``num_blocks`` blocks) is exactly the budget of the page pool.

A page must also be a multiple of the backend's mapping granularity (the OS page size on the host,
2 MB for CUDA), which may force a larger block: :func:`aligned_block_size` gives the smallest
multiple of the requested block size that satisfies it.

Every size comes from the :class:`vattention.KVCacheConfig` of the cache (and so from the core's
one geometry); this module adds only vLLM's side of the bargain. It imports no vLLM, so it is
tested without vLLM.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ...config import KVCacheConfig

__all__ = ["KVGeometry", "aligned_block_size", "tensor_token_bytes"]

LAYOUTS = ("mega", "layer")
# An element type of each size: the geometry depends on the bytes only.
_BY_SIZE = {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.float64}
_LARGE_PAGE = 1 << 30  # bytes: holds any token row, to ask a config for its token stride


def _config(layout: str, num_layers: int, num_kv_heads: int, head_dim: int, element_bytes: int,
            page_bytes: int, max_seq_len: int = 1) -> KVCacheConfig:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
    return KVCacheConfig(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         max_batch_size=1, max_seq_len=max_seq_len,
                         dtype=_BY_SIZE[element_bytes], page_size=page_bytes, layout=layout)


def tensor_token_bytes(layout: str, num_layers: int, num_kv_heads: int, head_dim: int,
                       element_bytes: int) -> int:
    """Bytes one token occupies in one virtual tensor (``mega``: all layers; ``layer``: one).

    >>> tensor_token_bytes("mega", 2, 2, 32, 4), tensor_token_bytes("layer", 2, 2, 32, 4)
    (512, 256)
    """
    return _config(layout, num_layers, num_kv_heads, head_dim, element_bytes,
                   _LARGE_PAGE).tensor_token_bytes


def aligned_block_size(block_size: int, token_bytes: int, granularity: int) -> int:
    """Smallest multiple of ``block_size`` whose block is a whole number of ``granularity`` bytes.

    >>> aligned_block_size(128, 256, 4096)          # 128 * 256 = 32 KB: already aligned
    128
    >>> aligned_block_size(16, 2048, 2 << 20)       # CUDA, Llama-3-8B layer layout: 2 MB blocks
    1024
    """
    if block_size < 1 or token_bytes < 1 or granularity < 1:
        raise ValueError(f"block_size={block_size}, token_bytes={token_bytes} and "
                         f"granularity={granularity} must be >= 1")
    step = granularity // math.gcd(granularity, token_bytes)   # tokens per aligned unit
    return block_size * step // math.gcd(block_size, step)      # lcm(block_size, step)


@dataclasses.dataclass(frozen=True)
class KVGeometry:
    """The cache vLLM's KV config asks for, in vattention terms.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim, element_bytes : int
        Attention layers of this worker, KV heads of this tensor-parallel rank, head size, and
        bytes per element of the KV dtype.
    block_size : int
        vLLM's block size in tokens (already aligned, see :func:`aligned_block_size`).
    num_blocks : int
        Blocks vLLM's KV cache manager was sized for: the memory it would have allocated.
    layout : str
        ``"mega"`` or ``"layer"`` (see :class:`vattention.KVCacheConfig`).

    Examples
    --------
    >>> g = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=32, element_bytes=4,
    ...                block_size=128, num_blocks=64, layout="mega")
    >>> g.page_bytes, g.memory_budget, g.pages_per_block
    (65536, 8388608, 2)
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    element_bytes: int
    block_size: int
    num_blocks: int
    layout: str = "mega"

    @property
    def config(self) -> KVCacheConfig:
        """A one-slot, one-block ``KVCacheConfig`` of this geometry (its sizes are the cache's)."""
        token = tensor_token_bytes(self.layout, self.num_layers, self.num_kv_heads,
                                   self.head_dim, self.element_bytes)
        return _config(self.layout, self.num_layers, self.num_kv_heads, self.head_dim,
                       self.element_bytes, self.block_size * token, self.block_size)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token in one virtual tensor."""
        return self.config.tensor_token_bytes

    @property
    def page_bytes(self) -> int:
        """One page holds one block of one tensor."""
        return self.config.page_bytes

    @property
    def pages_per_block(self) -> int:
        """Pages backing one vLLM block: one per virtual tensor (2 for mega, 2 x layers else)."""
        return self.config.pages_per_index

    @property
    def memory_budget(self) -> int:
        """Bytes of the ``num_blocks`` blocks vLLM would have allocated up front."""
        return self.num_blocks * self.config.pages_for_tokens(self.block_size) * self.page_bytes
