"""Rounding bounds for comparing two evaluations of softmax attention, derived from the formats'
unit roundoffs rather than fitted on one machine: torch picks its kernels, their summation orders
and their vector widths by CPU (AVX2, AVX-512, AMX) and library (oneDNN, MKL), so two correct
evaluations of the same attention agree only within their rounding, which these bound.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

U32 = 2.0**-24  # fp32 unit roundoff (round to nearest)
# Unit roundoffs of the 16-bit formats: bf16 keeps 8 significant bits, fp16 11.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _gamma(m: int) -> float:
    """Higham's gamma_m = m u / (1 - m u): the relative error of m fp32 roundings in a row."""
    return m * U32 / (1 - m * U32)


def fp32_attention_bound(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: int,
    scale: float,
    spread: Optional[torch.Tensor] = None,
) -> float:
    """How far apart two fp32 evaluations of ``softmax(scale q k^T) v`` can be, element-wise,
    whatever their summation orders, vector widths and softmax schemes (first order in
    u = 2^-24; each evaluation is within half of it of the exact output).

    Derivation, per query row over ``n = keys`` keys of ``d`` dims, ``x_j = m - s_j >= 0``:

    - a score ``s_j = scale q.k_j`` (d products, d-1 additions, the scale): error at most
      ``D = gamma_(d+2) scale |q| |k_j|`` (Cauchy-Schwarz bounds ``sum_i |q_i k_ji|``);
    - a weight ``p_j = exp(-x_j) / Z``: its argument is off by at most ``2 D + u x_j``, exp adds
      u, Z (n terms) gamma_n, the division u, and an online softmax's rescalings of its running
      sums (one per key at most) 2 n u: relative error at most ``2 D + (3n + 3) u + u x_j``;
    - the output ``sum_j p_j v_j`` adds gamma_n relative to ``S = sum_j p_j |v_j|``.

    So ``|out - exact| <= S (2 D + (4n + 4) u) + u max|v| sum_j p_j x_j``, and
    ``sum_j p_j x_j <= ln n`` (it is at most the entropy of p: ``x_j <= -ln p_j``). Two
    evaluations are within twice that of each other. ``D`` takes the largest row norms of q and
    k, ``S`` its largest value (``spread``; ``max|v|`` when not given, which bounds it).

    Parameters
    ----------
    q, k, v
        Queries, keys and values, head dimension last (any leading shape).
    keys
        The most keys one query attends to.
    scale
        The softmax scale.
    spread
        ``S`` per output row if known (:func:`sdpa_spread`), else ``max|v|`` is used.
    """
    d = q.shape[-1]
    q_norm = q.double().norm(dim=-1).max().item()
    k_norm = k.double().norm(dim=-1).max().item()
    v_max = v.double().abs().max().item()
    s = v_max if spread is None else spread.double().max().item()
    score_error = _gamma(d + 2) * scale * q_norm * k_norm
    one = s * (2 * score_error + (4 * keys + 4) * U32) + U32 * v_max * math.log(max(keys, 1))
    return 2 * one


def sdpa_spread(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``S = sum_j p_j |v_j|`` of each query row of an unmasked SDPA (``[..., L, d]`` queries,
    ``[..., n, d]`` keys and values), in float64: the weight of |v| in
    :func:`fp32_attention_bound`, about E|v| rather than max|v| for spread-out weights."""
    p = torch.softmax(scale * q.double() @ k.double().transpose(-1, -2), dim=-1)
    return p @ v.double().abs()


def rounded_output_excess(
    got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, fp32_bound: float
) -> float:
    """By how much ``got`` (an fp32 attention output rounded once to the 16-bit ``dtype``) is
    further from ``want`` (an fp32 reference of the same inputs) than its rounding allows; at
    most 0 when within the bound.

    ``got = round(x)`` with ``x`` the fp32 output before rounding: ``|round(x) - x| <= u |x|``
    (u the format's unit roundoff, 2^-8 for bf16) and ``|x - want| <= fp32_bound`` (two fp32
    evaluations, :func:`fp32_attention_bound`), so ``|got - want| <= u |want| + (1 + u)
    fp32_bound``.
    """
    u = UNIT_ROUNDOFF[dtype]
    allowed = u * want.double().abs() + (1 + u) * fp32_bound
    return ((got.double() - want.double()).abs() - allowed).max().item()
