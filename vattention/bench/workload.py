"""Workload of the memory benchmark: model shapes and request lengths from a trace.

A request is a pair ``(prefill_tokens, decode_tokens)``. Model shapes give the bytes one token
of KV cache takes over all layers, K and V (``2 * L * H * D * element_bytes``, summed over layers
when the full-attention layers have a shape of their own).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Optional, Tuple

import numpy as np

from .traces import load_trace

__all__ = [
    "ModelShape",
    "MODELS",
    "parse_model",
    "Workload",
    "load_workload",
    "default_max_seq_len",
]

logger = logging.getLogger(__name__)

_ELEMENT_BYTES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """KV-cache shape of one model (per tensor-parallel shard).

    Parameters
    ----------
    name : str
        Label printed in reports.
    num_layers, num_kv_heads, head_dim : int
        Model dimensions; ``num_kv_heads`` is the heads one shard holds.
    dtype : str
        Element type name (``"bfloat16"``, ``"float16"``, ``"float32"``, ...).

    Examples
    --------
    >>> MODELS["llama3-8b"].bytes_per_token
    131072
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    # Sliding-window attention: `window_layers` of the layers attend to the last
    # `window` tokens only (0: none). Which layers does not matter to the byte counts.
    window: int = 0
    window_layers: int = 0
    # Per-layer shapes: the layers after the first `window_layers` (the full-attention
    # ones) have `full_kv_heads` x `full_head_dim` when set (0: num_kv_heads x head_dim), as
    # Gemma 4's global layers have their own head dim.
    full_kv_heads: int = 0
    full_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.window < 0 or not 0 <= self.window_layers <= self.num_layers:
            raise ValueError(
                f"window={self.window}, window_layers={self.window_layers}: need "
                f"window >= 0 and 0 <= window_layers <= num_layers={self.num_layers}"
            )
        if self.dtype not in _ELEMENT_BYTES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {sorted(_ELEMENT_BYTES)}")
        for field in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}={getattr(self, field)} must be >= 1")
        for field in ("full_kv_heads", "full_head_dim"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field}={getattr(self, field)} must be >= 0 (0: same shape)")

    @property
    def element_bytes(self) -> int:
        """Bytes per element of ``dtype``."""
        return _ELEMENT_BYTES[self.dtype]

    def layer_shapes(self) -> Tuple[Tuple[int, int], ...]:
        """``(kv_heads, head_dim)`` of each layer: the ``window_layers`` first, then the others.

        >>> MODELS["gemma4-defaults"].layer_shapes()[-6:]
        ((4, 256), (4, 512), (4, 512), (4, 512), (4, 512), (4, 512))
        """
        full = (self.full_kv_heads or self.num_kv_heads, self.full_head_dim or self.head_dim)
        window = (self.num_kv_heads, self.head_dim)
        return (window,) * self.window_layers + (full,) * (self.num_layers - self.window_layers)

    def layer_token_bytes(self) -> Tuple[int, ...]:
        """Bytes of one token of each layer's K (or V)."""
        return tuple(h * d * self.element_bytes for h, d in self.layer_shapes())

    def padded(self) -> ModelShape:
        """The same model with every layer at its largest shape: the one cache a uniform
        ``KVCacheConfig`` could hold it in."""
        h, d = max(self.layer_shapes(), key=lambda s: s[0] * s[1])
        return dataclasses.replace(
            self,
            name=f"{self.name}-padded",
            num_kv_heads=h,
            head_dim=d,
            full_kv_heads=0,
            full_head_dim=0,
        )

    @functools.cached_property  # a frozen value; kv_bytes() needs it per request and step
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers, K and V."""
        return 2 * sum(self.layer_token_bytes())

    @functools.cached_property
    def windowed_bytes_per_token(self) -> int:
        """The part of :attr:`bytes_per_token` in sliding-window layers."""
        if not self.window:
            return 0
        return 2 * sum(self.layer_token_bytes()[: self.window_layers])

    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes a request of ``num_tokens`` tokens really needs: all tokens on full layers, the
        last ``window`` on windowed ones."""
        win = self.windowed_bytes_per_token
        kept = min(num_tokens, self.window) if self.window else num_tokens
        return num_tokens * (self.bytes_per_token - win) + kept * win

    def sliding_window(self):
        """``KVCacheConfig(sliding_window=...)`` for this shape (windowed layers first)."""
        if not self.window or not self.window_layers:
            return None
        if self.window_layers == self.num_layers:
            return self.window
        full_layers = self.num_layers - self.window_layers
        return (self.window,) * self.window_layers + (None,) * full_layers


MODELS = {
    "llama3-8b": ModelShape("llama3-8b", 32, 8, 128),
    "yi-6b": ModelShape("yi-6b", 32, 4, 128),
    "llama3-70b-tp8": ModelShape("llama3-70b-tp8", 80, 1, 128),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 28, 4, 128),
    # an fp8 KV cache, and sliding-window models with their real windows
    "llama3-8b-fp8": ModelShape("llama3-8b-fp8", 32, 8, 128, "float8_e4m3fn"),
    "mistral-7b": ModelShape("mistral-7b", 32, 8, 128, window=4096, window_layers=32),
    "gemma3-12b": ModelShape("gemma3-12b", 48, 8, 256, window=1024, window_layers=40),
    # per-layer shapes: transformers' Gemma4TextConfig defaults (30 layers, 5 local :
    # 1 global, 4 KV heads, head_dim 256 local / global_head_dim 512, window 512), no KV sharing
    "gemma4-defaults": ModelShape(
        "gemma4-defaults", 30, 4, 256, window=512, window_layers=25, full_head_dim=512
    ),
}


def parse_model(model: Optional[str] = None, dims: Optional[str] = None) -> ModelShape:
    """Return the shape named ``model`` or given as ``dims`` = ``"L,H,D[,dtype]"``.

    Examples
    --------
    >>> parse_model(dims="32,8,128,float16").bytes_per_token
    131072
    """
    if dims:
        parts = [p.strip() for p in dims.split(",")]
        if len(parts) not in (3, 4):
            raise ValueError(f"--dims {dims!r}: expected L,H,D or L,H,D,dtype")
        try:
            layers, heads, head_dim = (int(p) for p in parts[:3])
        except ValueError:
            raise ValueError(f"--dims {dims!r}: L, H and D must be integers") from None
        dtype = parts[3] if len(parts) == 4 else "bfloat16"
        return ModelShape(
            f"custom-{layers}x{heads}x{head_dim}-{dtype}", layers, heads, head_dim, dtype
        )
    name = model or "llama3-8b"
    if name not in MODELS:
        raise ValueError(f"--model {name!r} is not one of {sorted(MODELS)}; or use --dims")
    return MODELS[name]


@dataclasses.dataclass(frozen=True)
class Workload:
    """The request sequence every allocator sees.

    Attributes
    ----------
    name : str
        Trace name or path.
    prefill_tokens, decode_tokens : numpy.ndarray
        int64 arrays, one entry per request, in arrival (FCFS) order.
    sampled_with_replacement : bool
        True when more requests were asked for than the trace holds.
    trace_rows : int
        Rows in the trace the requests were drawn from.
    """

    name: str
    prefill_tokens: np.ndarray
    decode_tokens: np.ndarray
    sampled_with_replacement: bool
    trace_rows: int

    @property
    def num_requests(self) -> int:
        """Number of requests."""
        return int(len(self.prefill_tokens))

    @property
    def total_tokens(self) -> np.ndarray:
        """Final KV length of each request (prefill + decode tokens)."""
        return self.prefill_tokens + self.decode_tokens


def load_workload(trace: str, num_requests: int, seed: int = 0) -> Workload:
    """Draw ``num_requests`` requests from ``trace`` with a seeded generator.

    Without replacement when the trace has enough rows, else with replacement (flagged in
    the result and in the report).

    Parameters
    ----------
    trace : str
        ``sharegpt``, ``arxiv_summarization``, ``arxiv_long`` or a CSV path whose header names
        the columns ``num_prefill_tokens`` and ``num_decode_tokens``; read by
        :func:`.traces.load_trace`, which says which row and column of the file is wrong.
    num_requests : int
        Requests to draw (>= 1).
    seed : int
        Seed of ``numpy.random.default_rng``.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    rows = load_trace(trace)
    rng = np.random.default_rng(seed)
    with_replacement = num_requests > len(rows)
    if with_replacement:
        logger.warning(
            "trace %s has %d rows < %d requests: sampling with replacement",
            trace,
            len(rows),
            num_requests,
        )
    index = rng.choice(len(rows), size=num_requests, replace=with_replacement)
    chosen = rows[index]
    return Workload(
        name=os.path.basename(trace),
        prefill_tokens=chosen[:, 0].copy(),
        decode_tokens=chosen[:, 1].copy(),
        sampled_with_replacement=with_replacement,
        trace_rows=len(rows),
    )


def default_max_seq_len(workload: Workload, multiple: int = 1024) -> int:
    """Longest request of ``workload`` (prefill + decode) rounded up to ``multiple`` tokens.

    Examples
    --------
    >>> w = Workload("t", np.array([100, 3000]), np.array([5, 97]), False, 2)
    >>> default_max_seq_len(w)
    4096
    """
    longest = int(workload.total_tokens.max())
    return -(-longest // multiple) * multiple
