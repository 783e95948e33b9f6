"""KVCacheConfig: the shape, dtype, device and paging policy of one KV cache.

A config normalizes its arguments (types, dtypes, device strings, per-layer sequences) and hands
the numbers to the core's geometry (``vattention._C.CacheGeometry``, ``csrc/core/geometry.h``),
which checks them and computes every derived size (bytes per token, tokens per page, virtual
bytes, ...): each size and each check is written once, in C++. A config is a plain value that can
be printed, compared, hashed and pickled.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from typing import TYPE_CHECKING, Optional, Sequence, Tuple, Union

import torch

from . import _C
from .errors import ConfigError

__all__ = ["KVCacheConfig", "parse_size", "DTYPES"]

Size = Union[int, str]

# torch dtype -> (DLPack type code, bits). kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4.
# fp8 tensors leave as uint8 bytes and are viewed as their dtype (zero-copy, same item size): torch
# builds without DLPack's fp8 codes would refuse them, and the bytes are the same either way.
DTYPES = {
    torch.float16: (2, 16),
    torch.bfloat16: (4, 16),
    torch.float32: (2, 32),
    torch.float64: (2, 64),
    torch.int8: (0, 8),
    torch.uint8: (1, 8),
    torch.float8_e4m3fn: (1, 8),
    torch.float8_e5m2: (1, 8),
}

Window = Optional[Union[int, Sequence[Optional[int]]]]
PerLayer = Union[int, Sequence[int]]

LAYOUTS = ("layer", "mega")
RECLAIM_POLICIES = ("deferred", "eager")

MAX_SIZE = 2**63 - 1  # bytes: sizes cross into the core as int64/size_t
MAX_INT = 2**63 - 1  # every count crosses into the core as int64
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "tb": 1 << 40,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(size: Size, *, name: str = "size") -> int:
    """Convert a size in bytes (int) or a string such as ``"64KB"``, ``"2MB"``, ``"1.5GB"`` to
    bytes.

    Units are binary (1 KB = 1024 bytes), as in the CUDA documentation's "2 MB" granularity.

    >>> parse_size("2MB"), parse_size("64KiB"), parse_size(4096)
    (2097152, 65536, 4096)
    """
    if isinstance(size, bool):
        raise ConfigError(f"{name} must be an int (bytes) or a string like '2MB', got {size!r}")
    if (
        not isinstance(size, (int, str))
        and hasattr(size, "__index__")
        and not str(getattr(size, "dtype", "")).endswith("bool")
    ):
        size = operator.index(size)  # numpy and torch integer scalars
    if isinstance(size, int):
        value = size
    elif isinstance(size, str):
        m = _SIZE_RE.match(size)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(
                f"{name}={size!r} is not a size; use bytes or a number with one of "
                "B, KB, MB, GB, TB (binary units)"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(f"{name} must be an int (bytes) or a string like '2MB', got {size!r}")
    if value < 0:
        raise ConfigError(f"{name}={size!r} must be >= 0 bytes")
    if value > MAX_SIZE:
        raise ConfigError(
            f"{name}={size!r} ({value} bytes) exceeds the largest size the core "
            f"accepts, {MAX_SIZE} bytes (2**63 - 1)"
        )
    return value


def _normalize_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), dtype)
    if dtype not in DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in DTYPES)
        raise ConfigError(f"dtype={dtype!r} is not supported; supported dtypes: {names}")
    return dtype


def _normalize_window(window: Window, num_layers: int) -> Union[None, int, tuple]:
    """None, an int W >= 1 for every layer, or a tuple of num_layers entries (None = full)."""

    def check(value, where):
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"{where}={value!r} must be an int >= 1 (tokens) or None (full attention)"
            )
        return _int64(value, where)

    if window is None or isinstance(window, (int, bool)):
        return check(window, "sliding_window")
    if isinstance(window, (str, bytes)) or not isinstance(window, Sequence):
        raise ConfigError(
            f"sliding_window={window!r} must be an int, None, or a sequence of "
            f"{num_layers} ints/None (one per layer)"
        )
    if len(window) != num_layers:
        raise ConfigError(
            f"sliding_window has {len(window)} entries; it needs one per layer "
            f"(num_layers={num_layers})"
        )
    # Whether the layout allows per-layer windows is the core's check (geometry.h).
    return tuple(check(w, f"sliding_window[{i}]") for i, w in enumerate(window))


def _normalize_per_layer(value: PerLayer, name: str, num_layers: int) -> Union[int, tuple]:
    """An int >= 1, or a sequence of num_layers of them (collapsed to an int when all equal)."""

    def check(v, where):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{where}={v!r} must be a positive int (>= 1)")
        return _int64(v, where)

    if isinstance(value, (str, bytes)) or not isinstance(value, (int, Sequence)):
        raise ConfigError(
            f"{name}={value!r} must be a positive int, or a sequence of "
            f"{num_layers} positive ints (one per layer)"
        )
    if not isinstance(value, Sequence):
        return check(value, name)
    if len(value) != num_layers:
        raise ConfigError(
            f"{name} has {len(value)} entries; it needs one per layer (num_layers={num_layers})"
        )
    per_layer = tuple(check(v, f"{name}[{i}]") for i, v in enumerate(value))
    return per_layer[0] if len(set(per_layer)) == 1 else per_layer


def _int64(value: int, name: str) -> int:
    if value > MAX_INT:
        raise ConfigError(
            f"{name}={value} exceeds the largest value the core accepts, {MAX_INT} (2**63 - 1)"
        )
    return value


def _normalize_device(device) -> str:
    text = str(device) if isinstance(device, torch.device) else device
    if not isinstance(text, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise ConfigError(f"device={device!r} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
    return "cuda:0" if text == "cuda" else text


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheConfig:
    """Shape and paging policy of a KV cache.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Model dimensions (per tensor-parallel shard: pass the KV heads this process holds).
        ``num_kv_heads`` and ``head_dim`` may also be sequences with one entry per layer, for
        hybrid models whose layers differ (``layout="layer"`` only): layer ``i``'s tensors are
        ``[B, S, num_kv_heads[i], head_dim[i]]`` and all layers draw on one page pool. A sequence
        whose entries are all equal is stored as that int.
    max_batch_size : int
        Number of slots (rows); one request occupies one slot.
    max_seq_len : int
        Tokens per slot (virtual); physical pages are mapped only for tokens really used.
    dtype : torch.dtype or str
        Element type of K and V (float16, bfloat16, float32, float64, int8, uint8,
        float8_e4m3fn, float8_e5m2).
    device : str
        ``"cpu"`` (host backend) or ``"cuda"`` / ``"cuda:N"`` (CUDA driver backend).
    page_size : int or str
        Bytes per physical page, a multiple of the backend granularity (host: the OS page size;
        CUDA: 2 MB). Default ``"2MB"``.
    layout : str
        ``"layer"``: one K and one V tensor per layer, ``[B, S, H, D]``.
        ``"mega"``: one K and one V tensor ``[B, S, L, H, D]``; per-layer views have token stride
        ``L*H*D``, so a page covers all layers of a few tokens (less waste, fewer mappings).
    lookahead_tokens : int
        Extra tokens ``prefetch()`` maps beyond each length it is given. Default 0: callers pass
        next iteration's lengths, pages are already rounded up to whole pages, and the prefetch
        thread has a whole iteration to map the next page; every look-ahead page is memory other
        requests cannot use (up to 2 x num_layers pages per request in the ``layer`` layout).
        Raise it when ``prefetch()`` is not called every iteration.
    reclaim : str
        ``"deferred"`` (default): a freed slot keeps its pages until another slot needs them
        (least recently freed first, then look-ahead beyond active lengths), so a new request
        inherits mapped memory without map calls. ``"eager"``: unmap on ``free()``.
    scrub : bool
        Zero every page a request receives (a reused slot's pages, pages recycled through the
        pool, fresh driver pages). Default ``False``: a kernel that reads only ``[0, seq_len)``
        never sees another request's K/V, but one with padded reads, or a multi-tenant server
        that must not leak data between requests, should set it (docs/guide.md, "Scrubbing").
    kv_tile_tokens : int, optional
        The key tile, in tokens, of kernels that read a row past its length. FlashAttention 3
        and 4 (``seqused_k`` / ``cache_seqlens`` over the whole ``[batch, max_seq, ...]``
        tensor) load key tiles whole, so a row of ``len`` tokens is read up to ``len`` rounded
        up to their tile. With ``kv_tile_tokens=T`` every row maps ``len`` rounded up to ``T``
        (capped at ``max_seq_len``) and keeps the tokens past ``len`` up to there finite
        (``step()`` and the prefetch thread zero what the row has not written since its pages
        came to it, once), so a kernel whose tile divides ``T`` meets no unmapped page and no
        stale NaN
        (``P = 0`` times NaN is NaN). A sliding window keeps the tile below its first key
        mapped too. ``None`` (default): 128 on CUDA caches whose slots own their pages (FA4's and
        FA2's tiles at ``head_dim`` <= 128 divide it; it costs no page in the ``layer`` layout
        when ``tokens_per_page`` is a multiple of it), 0 on the CPU (its kernels read exactly
        ``[0, len)``) and with ``num_blocks`` (an engine's block table names what its kernels
        read). 0: no rule (docs/architecture.md, "Past a row's length").
    sliding_window : int, sequence of int/None, or None
        Window ``W`` in tokens of sliding-window attention (a query at ``q`` reads keys
        ``(q - W, q]``). An int applies to every layer; a sequence gives one entry per layer, with
        ``None`` for full-attention layers (Gemma 2/3, Qwen2 ``max_window_layers``); per-layer
        windows need ``layout="layer"``. Positions stay absolute; ``step()`` unmaps the pages
        of windowed layers that lie wholly before the window, so a request holds ``O(W)`` memory
        on them. ``None`` (default): every layer keeps all tokens.
    value_cache : bool
        ``False`` reserves K tensors only (MLA latent caches such as DeepSeek's
        ``[B, S, 1, kv_lora_rank + rope_dim]``, K-only caches); ``layer(i)`` returns ``(k, None)``.
    num_blocks : int, optional
        Name physical pages by a block-based engine's block ids ``[0, num_blocks)``: page index
        ``p`` of a slot's row maps the pages of block ``table[p]`` of the request's block table
        (``step(..., blocks=...)``), so a cache hit maps the same pages again (zero copy). One
        page index then holds one engine block (``tokens_per_page`` tokens). ``None`` (default):
        pages belong to slots (see docs/guide.md, "Pages named by an engine's blocks").
    block_cache : bool
        With ``num_blocks``: a block keeps its pages after the last row mapping it is gone, until
        the engine hands its id out as a fresh block (the engine's prefix cache may report it as
        a hit meanwhile). ``False``: a block's pages go back with its last mapping.
    layer_groups : sequence of int, optional
        With ``num_blocks``: the KV cache group of each layer (``0..G-1``); each group follows its
        own block table (hybrid models: sliding-window and full-attention layers). Every group
        must take the same pages per page index, and a group's layers share one window.
        ``None``: one group.

    Examples
    --------
    >>> import torch, vattention
    >>> cfg = vattention.KVCacheConfig(num_layers=32, num_kv_heads=8, head_dim=128,
    ...                                max_batch_size=8, max_seq_len=4096, dtype=torch.bfloat16)
    >>> cfg.bytes_per_token, cfg.tokens_per_page
    (131072, 1024)

    Per-layer shapes (a Gemma-4-like model: global layers with twice the head dim). A page index
    then holds 1024 tokens and takes 1 page in a local layer's tensors, 2 in a global one's:

    >>> cfg = vattention.KVCacheConfig(num_layers=6, num_kv_heads=4,
    ...                                head_dim=[256, 256, 256, 256, 256, 512],
    ...                                max_batch_size=8, max_seq_len=4096, dtype=torch.bfloat16)
    >>> cfg.tokens_per_page, [cfg.index_pages(i) for i in range(6)], cfg.pages_per_index
    (1024, [1, 1, 1, 1, 1, 2], 14)
    """

    num_layers: int
    num_kv_heads: PerLayer
    head_dim: PerLayer
    max_batch_size: int
    max_seq_len: int
    dtype: torch.dtype
    device: str = "cpu"
    page_size: Size = "2MB"
    layout: str = "layer"
    lookahead_tokens: int = 0
    reclaim: str = "deferred"
    scrub: bool = False
    kv_tile_tokens: Optional[int] = None
    sliding_window: Window = None
    value_cache: bool = True
    num_blocks: Optional[int] = None
    block_cache: bool = False
    layer_groups: Optional[Sequence[int]] = None
    if TYPE_CHECKING:
        # The core's geometry, set by __post_init__; not a field at run time (no __init__
        # argument, not printed, compared or hashed): declared for the type checker only.
        _geometry: _C.CacheGeometry = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "max_batch_size", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name}={value!r} must be a positive int (>= 1)")
            _int64(value, name)
        if self.num_layers < 1:  # the per-layer sequences below are checked against it
            raise ConfigError(f"num_layers={self.num_layers!r} must be a positive int (>= 1)")
        for name in ("num_kv_heads", "head_dim"):
            object.__setattr__(
                self, name, _normalize_per_layer(getattr(self, name), name, self.num_layers)
            )
        object.__setattr__(self, "dtype", _normalize_dtype(self.dtype))
        object.__setattr__(self, "device", _normalize_device(self.device))
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout={self.layout!r} must be one of {LAYOUTS}")
        if self.reclaim not in RECLAIM_POLICIES:
            raise ConfigError(f"reclaim={self.reclaim!r} must be one of {RECLAIM_POLICIES}")
        if not isinstance(self.scrub, bool):
            raise ConfigError(f"scrub={self.scrub!r} must be True or False")
        if not isinstance(self.value_cache, bool):
            raise ConfigError(f"value_cache={self.value_cache!r} must be True or False")
        object.__setattr__(
            self, "sliding_window", _normalize_window(self.sliding_window, self.num_layers)
        )
        if (
            isinstance(self.lookahead_tokens, bool)
            or not isinstance(self.lookahead_tokens, int)
            or self.lookahead_tokens < 0
        ):
            raise ConfigError(f"lookahead_tokens={self.lookahead_tokens!r} must be an int >= 0")
        _int64(self.lookahead_tokens, "lookahead_tokens")
        if self.num_blocks is not None and (
            isinstance(self.num_blocks, bool)
            or not isinstance(self.num_blocks, int)
            or self.num_blocks < 1
        ):
            raise ConfigError(f"num_blocks={self.num_blocks!r} must be an int >= 1, or None")
        if self.num_blocks is not None:
            _int64(self.num_blocks, "num_blocks")
        if not isinstance(self.block_cache, bool):
            raise ConfigError(f"block_cache={self.block_cache!r} must be True or False")
        if self.block_cache and self.num_blocks is None:
            raise ConfigError("block_cache=True needs num_blocks (pages named by engine blocks)")
        tile_tokens = self._tile_tokens()
        object.__setattr__(self, "kv_tile_tokens", tile_tokens)
        if self.layer_groups is not None:
            if (
                isinstance(self.layer_groups, (str, bytes))
                or not isinstance(self.layer_groups, Sequence)
                or any(isinstance(g, bool) or not isinstance(g, int) for g in self.layer_groups)
            ):
                raise ConfigError(
                    f"layer_groups={self.layer_groups!r} must be a sequence of "
                    f"{self.num_layers} ints (the KV cache group of each layer)"
                )
            object.__setattr__(self, "layer_groups", tuple(self.layer_groups))
        page_bytes = parse_size(self.page_size, name="page_size")
        if page_bytes < 1:
            raise ConfigError(f"page_size={self.page_size!r} must be > 0 bytes")
        per_layer = self.per_layer_shapes
        # The core checks every value and computes every size (csrc/core/geometry.h).
        object.__setattr__(
            self,
            "_geometry",
            _C.CacheGeometry(
                num_layers=self.num_layers,
                num_kv_heads=self.layer_kv_heads[0],
                head_dim=self.layer_head_dims[0],
                element_bytes=self.element_bytes,
                max_batch=self.max_batch_size,
                max_seq=self.max_seq_len,
                page_bytes=page_bytes,
                mega=self.layout == "mega",
                value_cache=self.value_cache,
                windows=list(self.layer_windows) if self.sliding_window else [],
                layer_kv_heads=list(self.layer_kv_heads) if per_layer else [],
                layer_head_dims=list(self.layer_head_dims) if per_layer else [],
                layer_groups=list(self.layer_groups or ()),
                tile_tokens=tile_tokens,
            ),
        )

    def _tile_tokens(self) -> int:
        """``kv_tile_tokens`` checked, and its default resolved (see the class docstring)."""
        tile = self.kv_tile_tokens
        if tile is None:
            return 128 if self.device.startswith("cuda") and self.num_blocks is None else 0
        if isinstance(tile, bool) or not isinstance(tile, int) or tile < 0:
            raise ConfigError(f"kv_tile_tokens={tile!r} must be an int >= 0 (0: no tile rule)")
        if tile and self.num_blocks is not None:
            raise ConfigError(
                f"kv_tile_tokens={tile} needs a cache whose slots own their pages (no "
                f"num_blocks={self.num_blocks}): an engine's block table names the pages its "
                "kernels read; pass kv_tile_tokens=0"
            )
        return tile

    @property
    def geometry(self) -> _C.CacheGeometry:
        """The core's geometry of this cache: every derived size below comes from it."""
        return self._geometry

    # ---- derived sizes (bytes) -------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes per physical page."""
        return self._geometry.page_bytes

    @property
    def layer_windows(self) -> Tuple[int, ...]:
        """Window of each layer in tokens, 0 for full attention."""
        w = self.sliding_window
        if w is None or isinstance(w, int):
            return (w or 0,) * self.num_layers
        return tuple(x or 0 for x in w)

    @property
    def num_groups(self) -> int:
        """KV cache groups: each follows its own engine block table (1 without ``layer_groups``)."""
        return self._geometry.num_groups

    @property
    def kv_tensors(self) -> int:
        """Tensors per layer: 2 (K and V), or 1 with ``value_cache=False``."""
        return self._geometry.kv_tensors

    @property
    def element_bytes(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPES[self.dtype][1] // 8

    @property
    def per_layer_shapes(self) -> bool:
        """True when layers differ in ``num_kv_heads`` or ``head_dim``."""
        return not (isinstance(self.num_kv_heads, int) and isinstance(self.head_dim, int))

    @property
    def layer_kv_heads(self) -> Tuple[int, ...]:
        """KV heads of each layer."""
        h = self.num_kv_heads
        return (h,) * self.num_layers if isinstance(h, int) else tuple(h)

    @property
    def layer_head_dims(self) -> Tuple[int, ...]:
        """Head dim of each layer."""
        d = self.head_dim
        return (d,) * self.num_layers if isinstance(d, int) else tuple(d)

    def layer_token_bytes(self, layer: int) -> int:
        """Bytes of one token of one layer's K (or V): ``num_kv_heads * head_dim * element``."""
        return self._geometry.layer_token_bytes(layer)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers, K and V: ``2 * L * H * D * element``
        (``L * H * D * element`` with ``value_cache=False``; summed over layers when their
        shapes differ)."""
        return self._geometry.bytes_per_token

    @property
    def num_tensors(self) -> int:
        """Virtual tensors reserved: ``2 * num_layers`` (layer layout) or 2 (mega layout);
        half as many with ``value_cache=False``."""
        return self._geometry.num_tensors

    @property
    def tensor_token_bytes(self) -> int:
        """Bytes of one token's row in one virtual tensor (the token stride, in bytes); the
        largest layer's with per-layer shapes."""
        return max(self._geometry.token_bytes(i) for i in range(self.num_layers))

    @property
    def unit_bytes(self) -> int:
        """Bytes per token of the page-index arithmetic: the gcd of the tensors' token strides
        (``tensor_token_bytes`` when every layer has the same shape). A slot grows by page
        indices of ``tokens_per_page`` tokens; layer ``i``'s tensors map
        :meth:`index_pages` ``(i)`` pages per index, exactly in proportion to their size."""
        return self._geometry.unit_bytes

    def index_pages(self, layer: int) -> int:
        """Physical pages one page index takes in each of layer ``layer``'s tensors (1 unless
        layers differ in shape: then a layer with 4x the bytes per token maps 4)."""
        return self._geometry.index_pages(layer)

    @property
    def pages_per_index(self) -> int:
        """Physical pages one page index takes over all tensors (``num_tensors`` when every
        layer has the same shape)."""
        return self._geometry.columns

    @property
    def tokens_per_page(self) -> int:
        """Whole tokens one page index holds (with one shape for every layer: one page of one
        tensor; tokens may straddle pages when not exact)."""
        return self._geometry.tokens_per_page

    @property
    def pages_per_slot(self) -> int:
        """Page indices that back a full ``max_seq_len`` row."""
        return self._geometry.max_indices

    @property
    def slot_bytes(self) -> int:
        """Virtual bytes of one slot's row in one tensor, padded up to a page multiple (with
        per-layer shapes: in a tensor of one page per index; layer ``i``'s row is
        ``index_pages(i)`` times that)."""
        return self.pages_per_slot * self.page_bytes

    @property
    def virtual_bytes(self) -> int:
        """Virtual address space reserved by the cache (no physical memory)."""
        return self._geometry.virtual_bytes

    @property
    def static_bytes(self) -> int:
        """Physical bytes a static allocator would hold for ``max_batch_size * max_seq_len``."""
        return self.max_batch_size * self.max_seq_len * self.bytes_per_token

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages (over all tensors) a slot of ``num_tokens`` tokens maps: those backing its
        :meth:`read_end` (``num_tokens`` itself without ``kv_tile_tokens``)."""
        return self._geometry.read_pages(num_tokens) * self._geometry.columns

    def read_end(self, num_tokens: int) -> int:
        """One past the last token a tile-loading kernel reads of a row of ``num_tokens``
        tokens: ``num_tokens`` rounded up to ``kv_tile_tokens`` (capped at ``max_seq_len``);
        ``num_tokens`` itself without a tile rule. A row of that length maps that far."""
        return self._geometry.read_end(num_tokens)
