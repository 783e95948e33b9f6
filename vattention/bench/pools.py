"""Command line: ``python -m vattention pool [NAME] [--budget SIZE] [--json]``.

Lists the KV memory pools vLLM engines share on this machine (``VATTENTION_VLLM_POOL``): each
pool's device, budget and held bytes, and per live engine its held bytes and how they are used
(live requests, cached blocks, headroom). ``NAME --budget SIZE`` changes a pool's budget while
its engines run and prints the pool afterwards. Listing also removes what dead engines left.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import List, Optional

from ..config import parse_size
from ..errors import VAttentionError
from ..pool_ledger import ENV_POOL_DIR, PoolInfo, list_pools, pool_directory, set_budget
from .report import format_bytes

__all__ = ["main", "build_parser", "format_pools"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vattention pool",
        description="The KV memory pools of this machine's vLLM engines (VATTENTION_VLLM_POOL), "
        "or change one pool's budget.",
    )
    parser.add_argument("name", nargs="?", help="show this pool only (unknown: exit status 2)")
    parser.add_argument(
        "--budget",
        metavar="SIZE",
        help="set pool NAME's budget: bytes or a size such as 4GiB (running engines give "
        "back cached memory when it falls below what they hold)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--dir",
        default=None,
        help=f"directory of the pool files (default: ${ENV_POOL_DIR}, else "
        "/dev/shm/vattention-pools)",
    )
    return parser


def _pool_json(pool: PoolInfo) -> dict:
    return dict(dataclasses.asdict(pool), held=pool.held, over_budget=pool.over_budget)


def format_pools(pools: List[PoolInfo], directory: str, now: Optional[float] = None) -> str:
    """The pools as text: one header line per pool, one table row per engine.

    >>> from vattention.pool_ledger import EngineInfo, PoolInfo
    >>> e = EngineInfo(41, "llama", "cuda:0", 3 << 30, 2 << 30, 1 << 30, 0, 6 << 30, 95.0)
    >>> print(format_pools([PoolInfo("a", "cuda:0", 8 << 30, [e])], "/d", now=100.0))
    pool a on cuda:0: budget 8GB, held 3GB by 1 engine
      pid  model  held  live  cached  headroom  max  updated
       41  llama   3GB   2GB     1GB        0B  6GB  5s ago
    """
    if not pools:
        return f"no pools in {directory}"
    now = time.time() if now is None else now
    lines = []
    for pool in pools:
        count = len(pool.engines)
        head = f"pool {pool.name} on {pool.device}: budget {format_bytes(pool.budget_bytes)}"
        if not count:
            lines.append(f"{head}, no live engine (its files were removed)")
            continue
        noun = "engine" if count == 1 else "engines"
        lines.append(f"{head}, held {format_bytes(pool.held)} by {count} {noun}")
        if pool.over_budget:
            lines.append(f"  over budget by {format_bytes(pool.over_budget)}")
        rows = [["pid", "model", "held", "live", "cached", "headroom", "max", "updated"]]
        for e in pool.engines:
            sizes = (e.held, e.live, e.cached, e.headroom, e.max_bytes)
            age = f"{max(now - e.updated, 0):.0f}s ago"
            rows.append([str(e.pid), e.model, *map(format_bytes, sizes), age])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            cells = [
                cell.ljust(w) if i in (1, 7) else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            ]
            lines.append("  " + "  ".join(cells).rstrip())
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``pool`` with ``argv`` (without the leading ``pool``); return the exit status: 0, or
    2 on a usage error, an unknown pool or a refused budget."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.budget is not None and args.name is None:
        parser.error("--budget needs the pool's NAME")
    directory = pool_directory(args.dir)
    try:
        if args.budget is not None:
            budget = parse_size(args.budget, name="--budget")
            pools = [set_budget(args.name, budget, directory)]
        else:
            pools = list_pools(directory)
            if args.name is not None:
                pools = [p for p in pools if p.name == args.name]
                if not pools:
                    print(f"error: no pool named {args.name!r} in {directory}", file=sys.stderr)
                    return 2
    except VAttentionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"directory": directory, "pools": [_pool_json(p) for p in pools]}))
    else:
        print(format_pools(pools, directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
