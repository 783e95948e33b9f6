"""How close each CPU attention kernel's output is to the exact result, in the output's own
units: the native kernel, vLLM's CPU attention op (the ISA its backend picks) and torch SDPA on
the same calls: ``bench_attention.py``'s prefill rows (its inputs, from its seed) and decode
shapes (its rows x tokens and heads, with no K/V appended).

    .venv-vllm/bin/python benchmarks/bench_attention_accuracy.py [--threads 2]
        [--prefill HEADS,KV_HEADS,D,CHUNK,PAST ...] [--decode HEADS,KV_HEADS,D,ROWS,TOKENS ...]
        [--dtype bfloat16 --dtype float32]

The exact result is the kernel tests' oracle (``reference_attention``) in float64 on the very q,
K and V the kernels read (already in their storage dtype). An output element's error is counted in
units in the last place (ulp) of the exact value in the output's dtype (bf16: 8 significant bits,
fp32: 24): an error of at most 0.5 ulp means the element is the exact result correctly rounded,
the best any kernel can return. The tables give, per kernel, the share of elements correctly
rounded, their mean error in ulps, and the largest error in ulps of the element's scale,
sum_j w_j |V_j| (the weights applied to |V|: an output near 0 by cancellation carries errors of
that size, which in its own ulps would be huge). Nothing is timed; the figures are a property of
the arithmetic (the same inputs give the same tables on any machine that runs the same code
paths).

Why it is measured: the native kernel's ``amx`` variant multiplies V by each probability in two
bf16 terms, where vLLM's op and oneDNN's SDPA round each probability to bf16 once; this table is
what the second term buys, in the units a user sees.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import (  # noqa: E402
    HKV,
    PREFILL_CHUNKS,
    PREFILL_SHAPES,
    D,
    N,
    S,
    vllm_decode,
    vllm_ops,
    vllm_prefill,
)

from vattention.attention import cpu_attention, kernel_isa, reference_attention  # noqa: E402
from vattention.bench.machine import cpu_name  # noqa: E402

# significant bits of each output dtype, and its smallest normal exponent
_PRECISION = {torch.bfloat16: (8, -126), torch.float32: (24, -126)}


def ulp_errors(out: torch.Tensor, exact: torch.Tensor, scale=None) -> torch.Tensor:
    """|out - exact| in ulps of ``scale`` (default: exact itself) in out's dtype, as float64. In
    ulps of exact, 0.5 or less means correctly rounded.

    >>> exact = torch.tensor([1.0, 1.0 + 2**-9, 3.0], dtype=torch.float64)
    >>> out = torch.tensor([1.0, 1.0, 3.0 + 2**-6], dtype=torch.bfloat16)
    >>> ulp_errors(out, exact).tolist()  # bf16's ulp is 2^-7 in [1, 2), 2^-6 in [2, 4)
    [0.0, 0.25, 1.0]
    >>> ulp_errors(out, exact, scale=torch.full((3,), 4.0, dtype=torch.float64)).tolist()
    [0.0, 0.0625, 0.5]
    """
    bits, min_exp = _PRECISION[out.dtype]
    mag = (exact if scale is None else scale).abs().clamp_min(2.0**min_exp)
    e = torch.floor(torch.log2(mag)).clamp_min(min_exp)
    return (out.to(torch.float64) - exact).abs() / torch.exp2(e - (bits - 1))


def summary(errors: torch.Tensor, scaled: torch.Tensor) -> Tuple[float, float, float]:
    """(share of elements correctly rounded, mean ulps, largest error in ulps of its scale) from
    errors in ulps of the exact values and in ulps of their scale.

    >>> e = torch.tensor([0.0, 0.5, 0.75, 2.0], dtype=torch.float64)
    >>> summary(e, e / 4)
    (0.5, 0.8125, 0.5)
    """
    return float((errors <= 0.5).double().mean()), float(errors.mean()), float(scaled.max())


def exact(q: torch.Tensor, k_cache, v_cache, **call) -> Tuple[torch.Tensor, torch.Tensor]:
    """The call's exact result, from the kernel tests' oracle
    (:func:`vattention.attention.reference_attention`) in float64 on the same values, and its
    scale: the same weights applied to |V|, sum_j w_j |V_j| (an output near 0 by cancellation
    still carries rounding errors of that size)."""
    q64 = q.to(torch.float64)
    return (
        reference_attention(q64, k_cache, v_cache, **call),
        reference_attention(q64, k_cache, v_cache.abs(), **call),
    )


def prefill_outputs(dtype, heads, hkv, d, chunk, past, ops) -> Dict[str, torch.Tensor]:
    """Each kernel's output [chunk, heads, d] for bench_attention's prefill call of this shape
    (the same inputs, from the same seed), the exact one as "exact" and its scale (sum_j w_j |V_j|)
    as "scale"."""
    from torch.nn.attention.bias import causal_lower_right

    total = past + chunk
    gen = torch.Generator().manual_seed(1)
    kc = torch.randn(1, total + 16, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(1, total + 16, hkv, d, generator=gen).to(dtype)
    q = torch.randn(1, chunk, heads, d, generator=gen).to(dtype)
    call = dict(cache_seqlens=total, causal=True)
    outs = {"kernel": cpu_attention(q, kc, vc, **call)[0]}
    if ops:
        outs["vllm"] = vllm_prefill(ops, q[0], kc[0, :total], vc[0, :total])().clone()
    mask = None if past == 0 else causal_lower_right(chunk, total)
    outs["sdpa"] = F.scaled_dot_product_attention(
        q[0].transpose(0, 1)[None],
        kc[0, :total].transpose(0, 1)[None],
        vc[0, :total].transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=past == 0,
        enable_gqa=True,
    )[0].transpose(0, 1)
    outs["exact"], outs["scale"] = (x[0] for x in exact(q, kc, vc, **call))
    return outs


def decode_outputs(dtype, heads, hkv, d, rows, tokens, ops) -> Dict[str, torch.Tensor]:
    """Each kernel's output [rows, heads, d] for ``rows`` decode queries, each over ``tokens``
    keys of its own row, the exact one as "exact" and its scale as "scale" (prefill_outputs)."""
    gen = torch.Generator().manual_seed(0)
    kc = torch.randn(rows, tokens, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(rows, tokens, hkv, d, generator=gen).to(dtype)
    q = torch.randn(rows, 1, heads, d, generator=gen).to(dtype)
    call = dict(cache_seqlens=tokens, causal=True)
    outs = {"kernel": cpu_attention(q, kc, vc, **call)[:, 0]}
    if ops:
        outs["vllm"] = vllm_decode(ops, kc, vc, q[:, 0].contiguous())().clone()
    outs["sdpa"] = F.scaled_dot_product_attention(
        q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), enable_gqa=True
    ).transpose(1, 2)[:, 0]
    outs["exact"], outs["scale"] = (x[:, 0] for x in exact(q, kc, vc, **call))
    return outs


def shape_arg(option: str, fields: str, lowest: Tuple[int, ...]):
    """An argparse type for ``option``'s comma-separated integers ``fields``, each at least its
    ``lowest``, the first a multiple of the second (heads of KV heads), and the keys of a row a
    multiple of 128 (vLLM's blocks: prefill's CHUNK + PAST, decode's TOKENS)."""

    def parse(text: str) -> Tuple[int, ...]:
        names = fields.split(",")
        try:
            values = tuple(int(x) for x in text.split(","))
        except ValueError:
            values = ()
        if len(values) != len(names):
            raise argparse.ArgumentTypeError(
                f"{option} wants {fields} ({len(names)} integers), got {text!r}"
            )
        for name, value, low in zip(names, values, lowest):
            if value < low:
                raise argparse.ArgumentTypeError(f"{option} {text!r}: {name} must be >= {low}")
        if values[0] % values[1]:
            raise argparse.ArgumentTypeError(
                f"{option} {text!r}: {names[0]} must be a multiple of {names[1]}"
            )
        blocks = values[3] + values[4] if option == "--prefill" else values[4]
        if blocks % 128:
            what = "CHUNK + PAST" if option == "--prefill" else "TOKENS"
            raise argparse.ArgumentTypeError(
                f"{option} {text!r}: {what} must be a multiple of 128 (vLLM's blocks), got {blocks}"
            )
        return values

    return parse


def thread_count(text: str) -> int:
    """--threads: a whole number >= 1 (torch refuses others only once the run has begun)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--threads {text!r}: must be a whole number >= 1")
    return value


def table(title: str, columns: List[str], names: List[str], cases) -> None:
    """One markdown table: a row per (labels, outputs) of ``cases``, a cell per kernel."""
    labels = {"kernel": "kernel", "vllm": "vLLM op", "sdpa": "torch SDPA"}
    print(f"### {title}\n")
    head = [f"{labels[n]}: correctly rounded, mean ulp, largest" for n in names]
    print("| " + " | ".join(columns + head) + " |")
    print("|---|---|" + "---:|" * (len(columns) - 2 + len(names)))
    for row_labels, outs in cases:
        cells = []
        for n in names:
            share, mean, largest = summary(
                ulp_errors(outs[n], outs["exact"]),
                ulp_errors(outs[n], outs["exact"], outs["scale"]),
            )
            cells.append(f"{100 * share:.1f}%, {mean:.2f}, {largest:.2f}")
        print("| " + " | ".join(list(row_labels) + cells) + " |")
    print()


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=thread_count, default=2)
    parser.add_argument(
        "--prefill",
        action="append",
        type=shape_arg("--prefill", "HEADS,KV_HEADS,D,CHUNK,PAST", (1, 1, 1, 1, 0)),
        help="a prefill call: a causal chunk of CHUNK queries after PAST cached tokens "
        "(default: bench_attention.py's prefill rows)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        type=shape_arg("--decode", "HEADS,KV_HEADS,D,ROWS,TOKENS", (1, 1, 1, 1, 1)),
        help=f"a decode call: ROWS queries over TOKENS keys each (default: bench_attention.py's "
        f"decode rows, {N} x {S} tokens, GQA 1 and 4 over {HKV} x {D})",
    )
    parser.add_argument(
        "--dtype",
        action="append",
        choices=["bfloat16", "float32"],
        help="output and cache dtype (default: both)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.prefill is None and args.decode is None:
        args.prefill = [s + c for s in PREFILL_SHAPES for c in PREFILL_CHUNKS]
        args.decode = [(g * HKV, HKV, D, N, S) for g in (1, 4)]
    dtypes = [getattr(torch, name) for name in args.dtype or ["float32", "bfloat16"]]
    ops, why = vllm_ops()
    names = ["kernel", "vllm", "sdpa"] if ops else ["kernel", "sdpa"]
    print(
        f"{cpu_name()}; torch {torch.__version__}; kernel ISA {kernel_isa()}"
        + ("" if ops else f"; vLLM op not run ({why}): run with the vLLM venv")
        + "\n"
    )
    if args.prefill:
        table(
            "Prefill: one request, causal",
            ["dtype", "heads / KV x d", "chunk", "cached before"],
            names,
            (
                (
                    (str(dt)[6:], f"{h} / {kv} x {d}", str(c), str(p)),
                    prefill_outputs(dt, h, kv, d, c, p, ops),
                )
                for dt in dtypes
                for h, kv, d, c, p in args.prefill
            ),
        )
    if args.decode:
        table(
            "Decode: one query a row",
            ["dtype", "heads / KV x d", "rows x tokens"],
            names,
            (
                (
                    (str(dt)[6:], f"{h} / {kv} x {d}", f"{r} x {t}"),
                    decode_outputs(dt, h, kv, d, r, t, ops),
                )
                for dt in dtypes
                for h, kv, d, r, t in args.decode
            ),
        )


if __name__ == "__main__":
    main()
