"""fp8 KV caches: the two formats, and how a new key is stored in them.

Both the kernel and the reference store new keys the way vLLM 0.32's CPU backend does, so that a
cache written by either holds the same bytes as one vLLM wrote: divided by the descale, clamped to
the format's largest finite value, mantissa truncated toward zero (torch's ``.to(float8)`` rounds
to nearest instead).
"""

from __future__ import annotations

import torch

__all__ = ["FP8_MAX", "fp8_store_like_vllm"]

# The fp8 cache dtypes and the largest finite value of each (stores saturate to it).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def fp8_store_like_vllm(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values (already divided by the descale) as vLLM 0.32's CPU backend stores them in fp8.

    Clamped to ``[-max, max]`` (NaN to ``+max``), +-0 stored as 0, mantissa truncated toward zero.
    The kernel's stores follow the same rule (``csrc/attention``); the reference and the tests
    use this function.

    Parameters
    ----------
    v : Tensor
        Values to store, any shape (converted to float32).
    dtype : torch.dtype
        ``torch.float8_e4m3fn`` (largest finite 448) or ``torch.float8_e5m2`` (57344).

    Returns
    -------
    Tensor of ``dtype``, shaped like ``v``.

    Examples
    --------
    >>> import torch
    >>> x = torch.tensor([1.1, -1e9, 0.003, -0.0])
    >>> fp8_store_like_vllm(x, torch.float8_e4m3fn).float().tolist()   # truncated, saturated
    [1.0, -448.0, 0.001953125, 0.0]
    """
    if dtype not in FP8_MAX:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    fmax = FP8_MAX[dtype]
    v = v.float()
    v = torch.where(v < fmax, v, torch.full_like(v, fmax))  # NaN -> +max, as vLLM
    v = torch.where(-fmax < v, v, torch.full_like(v, -fmax))
    u = v.view(torch.int32)
    sign = (u >> 24) & 0x80
    if dtype == torch.float8_e4m3fn:
        a = v.abs()
        normal = ((u & 0x7FFFFFFF) - (120 << 23)) >> 20
        sub = torch.round(a * 2.0**29).to(torch.int32) >> 20  # RNE, as the fp32 denormal
        payload = torch.where(a >= 2.0**-6, normal, sub) & 0x7F
        q = torch.where(payload == 0, sign, sign | payload.clamp(max=0x7E))
    else:  # e5m2
        exp = ((u >> 23) & 0xFF) - 127
        man2 = (u >> 21) & 3
        shift = (-14 - exp).clamp(min=0)
        m = ((0x800000 | (u & 0x7FFFFF)) >> (shift + 21).clamp(max=31)).clamp(max=3)
        m = torch.where(shift + 21 >= 32, torch.zeros_like(m), m)
        q = torch.where(exp < -14, sign | m, sign | ((exp + 15) << 2) | man2)
    q = torch.where(v == 0, torch.zeros_like(q), q)
    return q.to(torch.uint8).view(dtype)
