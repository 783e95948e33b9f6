"""bench_prefetch.py on the CUDA backend through the driver EMULATION with A100-like latencies.

The emulation (tests/cuda_emulator) sleeps inside each driver entry point for the configured time,
so step() pays what a GPU driver would charge for mapping: ~190 us per cuMemCreate of a 2 MB page
and ~40 us to map and grant access to one (A100 figures, DESIGN.md section 3; split here as 20 us in
cuMemMap and 20 us in cuMemSetAccess, scaled by page size). Memory is host memory; only the time
spent in the (emulated) driver is modelled. This measures how much of that cost background prefetch
hides from step(); it says nothing else about a GPU.

    python benchmarks/bench_prefetch_cuda_emulated.py
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

LATENCY_US_PER_2MB = {"cuMemCreate": 190, "cuMemMap": 20, "cuMemSetAccess": 20, "cuMemUnmap": 20}
SHAPES = [("layer", "2MB"), ("mega", "2MB")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=2.0, help="simulated compute per iteration")
    parser.add_argument("--slots", type=int, default=16)
    args = parser.parse_args()
    reason = emu.unavailable_reason()
    if reason:
        sys.exit(reason)
    os.environ["VATTENTION_LIBCUDA"] = str(emu.LIB_PATH)  # before vattention loads a driver
    import bench_prefetch  # noqa: E402  (imports vattention)

    em = emu.Emulator.load()
    for entry, us in LATENCY_US_PER_2MB.items():
        em.set_latency_us(entry, us)  # all shapes below use 2 MB pages
    print(f"CUDA backend through the driver EMULATION with per-call latencies "
          f"{LATENCY_US_PER_2MB} us, {args.slots} slots, {args.iterations} iterations, "
          f"{args.gap_ms} ms simulated compute per iteration\n")
    print("| layout | page | tokens/page | step() blocks, no prefetch: mean / p99 us | "
          "with prefetch: mean / p99 us | ratio (mean, target <= 0.1) | maps in step (no pf / pf) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for layout, page in SHAPES:
        kw = dict(iterations=args.iterations, gap_s=args.gap_ms / 1e3, slots=args.slots,
                  device="cuda:0")
        base = bench_prefetch.run(layout, page, False, **kw)
        pf = bench_prefetch.run(layout, page, True, **kw)
        print(f"| {layout} | {page} | {base['tokens_per_page']} | "
              f"{base['mean'] * 1e6:.1f} / {base['p99'] * 1e6:.1f} | "
              f"{pf['mean'] * 1e6:.1f} / {pf['p99'] * 1e6:.1f} | {pf['mean'] / base['mean']:.3f} | "
              f"{base['step_maps']} / {pf['step_maps']} |")
    print(f"\nemulation rule violations during the run: {em.violations}")


if __name__ == "__main__":
    main()
