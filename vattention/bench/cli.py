"""Command line: ``python -m vattention bench memory [options]``.

Also runs on its own (a small KV shape, 4 layers x 2 KV heads x 64, so 40 requests fit the
budget; a few seconds):
``python -m vattention.bench.cli memory --dims 4,2,64 --budget 64MB --num-requests 40``.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from typing import List, Optional

from .allocators import ALL_ALLOCATORS, VATTENTION_VARIANTS
from .memory import run_memory_benchmark
from .report import format_bytes, markdown_table, write_json, write_report
from .workload import MODELS, default_max_seq_len, load_workload, parse_model

__all__ = ["main", "build_parser", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40}


def parse_bytes(text: str) -> int:
    """Bytes from ``"8GB"``, ``"256MB"``, ``"1.5GB"`` or a plain integer (binary units).

    >>> parse_bytes("8GB"), parse_bytes("64KB"), parse_bytes("4096")
    (8589934592, 65536, 4096)
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower().replace("ib", "b") if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 8GB or 256MB")
    return int(float(m.group(1)) * _UNITS[unit])


def _allocator_list(text: str) -> List[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("--allocators needs at least one name")
    return names


def build_parser() -> argparse.ArgumentParser:
    """Parser of ``bench`` with its ``memory`` subcommand."""
    parser = argparse.ArgumentParser(
        prog="python -m vattention bench", description="vattention benchmarks"
    )
    sub = parser.add_subparsers(dest="benchmark", required=True)
    mem = sub.add_parser(
        "memory",
        help="KV memory efficiency on a request trace (continuous batching)",
        description="Simulate continuous batching of a request trace and compare static, "
        "paged (block arithmetic), ideal and the real vattention allocator "
        "(host backend) under one KV memory budget.",
    )
    mem.add_argument(
        "--trace",
        default="sharegpt",
        help="sharegpt | arxiv_summarization | arxiv_long | path to a CSV (default: sharegpt)",
    )
    mem.add_argument(
        "--num-requests",
        type=int,
        default=1000,
        help="requests drawn from the trace (default: 1000)",
    )
    mem.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    mem.add_argument(
        "--model",
        default="llama3-8b",
        choices=sorted(MODELS),
        help="model KV shape (default: llama3-8b)",
    )
    mem.add_argument(
        "--dims", default=None, help="explicit shape L,H,D[,dtype] (overrides --model)"
    )
    mem.add_argument(
        "--budget",
        type=parse_bytes,
        default=parse_bytes("8GB"),
        help="KV memory budget; the real allocator commits up to this much host "
        "memory (default: 8GB)",
    )
    mem.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="tokens per request slot (default: longest request, rounded up to a multiple of 1024)",
    )
    mem.add_argument(
        "--max-batch-size",
        type=int,
        default=256,
        help="most concurrent requests, for every allocator (default: 256)",
    )
    mem.add_argument(
        "--allocators",
        type=_allocator_list,
        default=list(ALL_ALLOCATORS),
        help="comma-separated subset of: " + ", ".join(ALL_ALLOCATORS),
    )
    mem.add_argument(
        "--reclaim",
        choices=("deferred", "eager"),
        default="deferred",
        help="what the vattention caches do with a freed slot's pages: keep them "
        "until needed elsewhere (deferred, the default) or unmap at once",
    )
    mem.add_argument(
        "--out",
        default="bench_results",
        help="directory for the markdown, JSON and PNG files (default: bench_results/)",
    )
    mem.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the metrics keyed by allocator name to PATH",
    )
    mem.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    mem.add_argument(
        "--check", action="store_true", help="check allocator invariants at every step (slower)"
    )
    mem.add_argument("--quiet", action="store_true", help="no progress bar")
    from .elastic_bench import add_parser as add_elastic_parser
    from .vllm_bench import add_parser as add_vllm_parser

    add_vllm_parser(sub)
    add_elastic_parser(sub)
    return parser


def _run_memory(args: argparse.Namespace) -> int:
    model = parse_model(args.model, args.dims)
    workload = load_workload(args.trace, args.num_requests, args.seed)
    max_seq_len = args.max_seq_len or default_max_seq_len(workload)
    if workload.sampled_with_replacement:
        print(
            f"note: trace {args.trace} has {workload.trace_rows} rows; "
            f"{args.num_requests} requests were sampled with replacement",
            file=sys.stderr,
        )
    if not args.quiet:
        print(
            f"memory benchmark: {workload.num_requests} requests of {workload.name}, "
            f"{model.name}, budget {format_bytes(args.budget)}, max_seq_len {max_seq_len}",
            file=sys.stderr,
        )
    report = run_memory_benchmark(
        workload,
        model,
        budget_bytes=args.budget,
        max_seq_len=max_seq_len,
        max_batch_size=args.max_batch_size,
        allocators=args.allocators,
        check=args.check,
        progress=not args.quiet,
        reclaim=args.reclaim,
    )
    print(markdown_table(report))
    paths = write_report(report, args.out, plots=not args.no_plots)
    if args.json:
        write_json(report, args.json)
        paths.append(args.json)
    if not args.no_plots and not any(p.endswith(".png") for p in paths):
        print(
            "no plots: matplotlib is not installed (pip install 'vattention[bench]')",
            file=sys.stderr,
        )
    print("wrote " + ", ".join(paths), file=sys.stderr)
    failed = [name for name, m in report.metrics.items() if "error" in m]
    if failed:
        print(
            f"{len(failed)} of {len(report.metrics)} allocators failed: {', '.join(failed)}",
            file=sys.stderr,
        )
    return 1 if len(failed) == len(report.metrics) else 0


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``bench`` with ``argv`` (without the leading ``bench``); return the exit status.

    0 when at least one allocator ran (rows that failed say why in the table and JSON), 1 when
    none did, 2 on a usage or setup error.

    Examples
    --------
    >>> main(["memory", "--help"])  # doctest: +SKIP
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.benchmark == "memory":
            return _run_memory(args)
        if args.benchmark == "vllm":
            from .vllm_bench import run as run_vllm

            return run_vllm(args)
        if args.benchmark == "elastic":
            from .elastic_bench import run as run_elastic

            return run_elastic(args)
    except (ValueError, RuntimeError, ImportError) as exc:
        wants_real = any(n.startswith("vattention-") for n in getattr(args, "allocators", []))
        hint = ""
        if isinstance(exc, ImportError) and wants_real:
            hint = (
                " (the vattention rows need the built core: `make build`; or pass "
                f"--allocators without {', '.join(VATTENTION_VARIANTS)})"
            )
        print(f"error: {exc}{hint}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
