"""Argument conversions the kernel and the reference share, so both read and refuse them alike."""

from __future__ import annotations

import math
from typing import Sequence, Tuple, Union

import torch

from .fp8 import FP8_MAX

__all__ = ["IntArg", "Scale", "descale_factor", "window_bounds"]

# cache_seqlens: one length for every request, or one per request.
IntArg = Union[int, torch.Tensor, Sequence[int], None]
# k_descale / v_descale: a number or a one-element tensor (FA3's per-tensor form).
Scale = Union[float, torch.Tensor, None]


def window_bounds(window_size) -> Tuple[int, int]:
    """``(left, right)`` of a sliding window, checked: integers, ``-1`` meaning unlimited.

    Examples
    --------
    >>> window_bounds((127, 0)), window_bounds([-1, -1])
    ((127, 0), (-1, -1))
    """
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    for x in (left, right):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"window_size entries must be integers, got {window_size!r}")
        if x < -1:
            raise ValueError(
                f"window_size entries must be >= -1 (-1: unlimited), got {window_size!r}"
            )
    return left, right


def descale_factor(value: Scale, name: str, cache_dtype: torch.dtype) -> float:
    """The descale of an fp8 cache as a float (default 1.0), checked finite and positive.

    A descale given for a cache that is not fp8 is refused: it would be silently ignored.

    Examples
    --------
    >>> descale_factor(None, "k_descale", torch.float8_e4m3fn)
    1.0
    >>> descale_factor(torch.tensor([0.5]), "v_descale", torch.float8_e5m2)
    0.5
    """
    if value is None:
        return 1.0
    if cache_dtype not in FP8_MAX:
        raise ValueError(f"{name} applies to fp8 caches only (float8_e4m3fn, float8_e5m2)")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be one value per tensor, got shape {tuple(value.shape)}")
        value = float(value.reshape(()).item())
    x = float(value)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be finite and > 0, got {x}")
    return x
