"""Paged against contiguous in one kernel family: FlashAttention-4 with a ``page_table`` over a
paged pool (16, 64 and 256 tokens a page) against FlashAttention-4 over vattention's virtual cache
(``seqused_k``, no page table), decode and prefill, batch 1-64, contexts 1k-32k, Llama-3-8B and
Llama-3-70B (tensor parallel 8) KV shapes per GPU. Both read the same tokens; the time ratio is
paged / virtual (min and median of alternated rounds), with the largest output difference.

    python benchmarks/gpu/bench_fa4_paged.py                      # the whole table (a GPU, FA4)
    python benchmarks/gpu/bench_fa4_paged.py --quick              # the GPU check's points
    python benchmarks/gpu/bench_fa4_paged.py --json out.json --plot out.png

FA4 comes from the interpreter, or from a folder of wheels installed for the GPU check
(GPU_CHECK_FA4_SITE, see fa4_wheels.py). It prints a markdown table (docs/benchmarks.md's form)
naming the GPU, the FA4 version and the command. Needs a GPU: it says so and exits 2 without one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

import fa4_measure as m  # noqa: E402

BATCHES = (1, 8, 32, 64)
CONTEXTS = (1024, 4096, 16384, 32768)
QUICK = ((8, 4096), (32, 16384))


def points(quick: bool) -> List[tuple]:
    if quick:
        return list(QUICK)
    return [(b, c) for b in BATCHES for c in CONTEXTS if b * c <= 64 * 32768]


def table(rows: List[Dict[str, Any]]) -> str:
    """A markdown table of the rows (one line a point, phase and page size)."""
    head = "| shape | phase | batch | context | page | virtual ms | paged ms | paged / virtual " \
        "(min, median) | max abs diff |"  # fmt: skip
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r.get('shape')} | {r.get('phase', '')} | {r.get('batch')} | "
                f"{r.get('context')} | {r.get('page_size')} | error: {r['error'][:80]} | | | |"
            )
            continue
        lines.append(
            f"| {r['shape']} | {r['phase']} | {r['batch']} | {r['context']} | {r['page_size']} | "
            f"{r['virtual_ms']} | {r['paged_ms']} | {r['paged_over_virtual_min']}, "
            f"{r['paged_over_virtual_median']} | {r['max_abs_diff']} |"
        )
    return "\n".join(lines)


def plot(rows: List[Dict[str, Any]], path: Path) -> None:
    """paged / virtual (median) against context, one line per page size, a panel per shape and
    phase (batch 8 where measured, else the first batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    panels = sorted({(r["shape"], r["phase"]) for r in ok})
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.5 * max(1, len(panels)), 3.6))
    axes = axes if hasattr(axes, "__len__") else [axes]
    for ax, (shape, phase) in zip(axes, panels):
        mine = [r for r in ok if r["shape"] == shape and r["phase"] == phase]
        batches = sorted({r["batch"] for r in mine})
        batch = 8 if 8 in batches else batches[0]
        for page in sorted({r["page_size"] for r in mine}):
            pts = sorted(
                (r["context"], r["paged_over_virtual_median"])
                for r in mine
                if r["page_size"] == page and r["batch"] == batch
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{page} tokens")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{shape}, {phase}, batch {batch}")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("FA4 paged / FA4 over the virtual cache")
        ax.legend(title="page")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the GPU check's two points only")
    ap.add_argument("--shapes", default="llama3-8b,llama3-70b-tp8")
    ap.add_argument("--pages", default="16,64,256", help="tokens a page of the paged pool")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--plot", type=Path, help="write a plot (PNG) here")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_fa4_paged: needs a GPU (torch sees none)", file=sys.stderr)
        return 2
    fa4, version = m.load_fa4()
    if fa4 is None:
        print(f"bench_fa4_paged: flash-attn-4 not installed ({version})", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    header = (
        f"{props.name} (sm_{props.major}{props.minor}), flash-attn-4 {version}, torch "
        f"{torch.__version__}; `python benchmarks/gpu/bench_fa4_paged.py {' '.join(argv)}`"
    )
    print(header, flush=True)
    rows: List[Dict[str, Any]] = []
    for shape in args.shapes.split(","):
        for row in m.paged_vs_virtual(
            fa4,
            "cuda:0",
            points(args.quick),
            page_sizes=[int(x) for x in args.pages.split(",")],
            shape=shape,
            rounds=args.rounds,
        ):
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(header)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
