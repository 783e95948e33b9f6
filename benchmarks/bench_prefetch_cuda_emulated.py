"""bench_prefetch.py on the CUDA backend through the driver EMULATION with A100 driver latencies.

The emulation (tests/cuda_emulator) holds each driver entry point open for a configured time
before it acts (short holds spin, as a driver call keeps its thread busy; long ones sleep), so
step() pays what a GPU driver would charge. Default per-call costs are those measured on an A100
for 2 MB pages: cuMemCreate 193 us, cuMemMap 1.45 us, cuMemSetAccess 36 us, cuMemUnmap 25.6 us,
scaled linearly by page size for the 64 KB rows (which run the emulation at a 64 KB granularity;
real GPUs have 2 MB). Change them with --latency-us ENTRY=US (per 2 MB). Memory is host memory;
only the time spent in the (emulated) driver is modelled. This measures how much of that cost
background prefetch hides from step(); it says nothing else about a GPU.

The decode loop is bench_prefetch.py's: 64 slots (--slots) whose lengths grow by one token per
iteration, staggered so that crossings are spread out, and a compute gap per iteration; prefetch
asks for the next iteration's lengths plus --lookahead-tokens (default 16, so a crossing is known
16 iterations ahead: a layer-layout crossing of Llama-3-8B costs 64 x (cuMemMap + cuMemSetAccess)
= 2.4 ms, more than one 2 ms gap).

Columns: time step() blocks per iteration (mean / p99 over the iterations) without and with
prefetch, and their ratio (target <= 0.1 on every row); the same loop with lengths held fixed
(step() maps nothing: its bare cost, "floor", which on a loaded 2-core machine is mostly cold
caches after the gap) and the ratio of the time above that floor; maps made inside step(); VMM
driver calls per iteration made inside step() / by the prefetch thread in the prefetch run.

    python benchmarks/bench_prefetch_cuda_emulated.py [--latency-us cuMemSetAccess=20]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "cuda_emulator"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import emu  # noqa: E402

MB = 1 << 20
# A100, 2 MB pages (microseconds per call); scaled by page_bytes / 2 MB.
A100_LATENCY_US_PER_2MB = {
    "cuMemCreate": 193.0,
    "cuMemMap": 1.45,
    "cuMemSetAccess": 36.0,
    "cuMemUnmap": 25.6,
}
# Llama-3-8B's KV shape (32 layers, 8 KV heads of 128, fp16): 1024 tokens per 2 MB page per
# layer (layer layout), 32 per 2 MB page (mega) or per 64 KB page (layer). The 64 KB rows use 8
# layers (the emulation spends one file descriptor per page and one host mapping per mapped page:
# 32 layers would need ~40,000 of each); mega/64KB would hold one Llama-3-8B token per page, so it
# uses a small model's shape, Qwen2.5-0.5B (24 layers, 2 KV heads of 64): 10 tokens per page.
_LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128)
ROWS = [
    ("layer", "2MB", 2 * MB, _LLAMA3_8B),
    ("mega", "2MB", 2 * MB, _LLAMA3_8B),
    ("layer", "64KB", 64 << 10, dict(num_layers=8, num_kv_heads=8, head_dim=128)),
    ("mega", "64KB", 64 << 10, dict(num_layers=24, num_kv_heads=2, head_dim=64)),
]


def parse_latency(items: list[str]) -> dict[str, float]:
    lat = dict(A100_LATENCY_US_PER_2MB)
    for item in items:
        entry, _, us = item.partition("=")
        if entry not in lat:
            sys.exit(f"--latency-us {item!r}: entry must be one of {sorted(lat)}")
        lat[entry] = float(us)
    return lat


def fmt_calls(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=2.0, help="simulated compute per iteration")
    parser.add_argument("--slots", type=int, default=64, help="decode batch size")
    parser.add_argument(
        "--latency-us",
        action="append",
        default=[],
        metavar="ENTRY=US",
        help="per-call latency for 2 MB pages (repeatable); default: A100 figures",
    )
    parser.add_argument(
        "--lookahead-tokens",
        type=int,
        default=16,
        help="prefetch look-ahead beyond the next iteration's lengths",
    )
    parser.add_argument(
        "--rows", default="", help="comma list of layout/page to run, e.g. layer/2MB"
    )
    args = parser.parse_args()
    latency = parse_latency(args.latency_us)
    reason = emu.unavailable_reason()
    if reason:
        sys.exit(reason)
    os.environ["VATTENTION_LIBCUDA"] = str(emu.LIB_PATH)  # before vattention loads a driver
    import bench_prefetch  # noqa: E402  (imports vattention)

    em = emu.Emulator.load()
    wanted = {r.strip() for r in args.rows.split(",") if r.strip()}
    print(
        "CUDA backend through the driver EMULATION; per-call latency (us per 2 MB page, scaled "
        "by page size): " + ", ".join(f"{k} {v:g}" for k, v in latency.items())
    )
    print(
        f"{args.slots} slots, {args.iterations} iterations, {args.gap_ms} ms simulated compute "
        f"per iteration, prefetch look-ahead {args.lookahead_tokens} tokens\n"
    )
    print(
        "| layout | page | tokens/page | step() blocks, no prefetch: mean / p99 us | "
        "with prefetch: mean / p99 us | ratio (mean, target <= 0.1) | floor: mean / p99 us | "
        "ratio above floor | maps in step (no pf / pf) "
        "| driver calls per step: in step / prefetch thread (pf run) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    violations = 0
    for layout, page, page_bytes, dims in ROWS:
        if wanted and f"{layout}/{page}" not in wanted:
            continue
        em.reset()  # only with no cache alive; the granularity is read when a backend is built
        em.set_granularity(min(page_bytes, 2 * MB))
        em.set_device_memory_bytes(80 << 30)  # an 80 GB GPU; untouched pages commit no host memory
        for entry, us in latency.items():
            em.set_latency_ns(entry, round(us * 1000 * page_bytes / (2 * MB)))
        kw = dict(
            iterations=args.iterations,
            gap_s=args.gap_ms / 1e3,
            slots=args.slots,
            device="cuda:0",
            dims=dims,
            lookahead_tokens=args.lookahead_tokens,
        )
        base = bench_prefetch.run(layout, page, False, **kw)
        pf = bench_prefetch.run(layout, page, True, **kw)
        floor = bench_prefetch.run(layout, page, False, floor=True, **kw)
        violations += em.violations
        above = (pf["mean"] - floor["mean"]) / (base["mean"] - floor["mean"])
        print(
            f"| {layout} | {page} | {base['tokens_per_page']} | "
            f"{base['mean'] * 1e6:.1f} / {base['p99'] * 1e6:.1f} | "
            f"{pf['mean'] * 1e6:.1f} / {pf['p99'] * 1e6:.1f} | {pf['mean'] / base['mean']:.3f} | "
            f"{floor['mean'] * 1e6:.1f} / {floor['p99'] * 1e6:.1f} | {above:.3f} | "
            f"{base['step_maps']} / {pf['step_maps']} | "
            f"{fmt_calls(pf['step_calls'])} / {fmt_calls(pf['prefetch_calls'])} |"
        )
    print(f"\nemulation rule violations during the run: {violations}")


if __name__ == "__main__":
    main()
