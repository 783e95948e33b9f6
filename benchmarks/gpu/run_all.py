"""All GPU benchmarks in one command; writes results.md and results.png next to this file.

    python benchmarks/gpu/run_all.py            # on a machine with an NVIDIA GPU (+ flash_attn)
    python benchmarks/gpu/run_all.py --quick    # smaller grid

Parts: (1) per-call latency of cuMemCreate/Map/SetAccess/Unmap/Release by page size; (2)
FlashAttention decode/prefill on the virtual cache vs contiguous tensors vs FA's paged KV
(block_table, 256-token blocks), as ratios; (3) mapping throughput of cache.step() in GB/s.
Against the test emulation (VATTENTION_LIBCUDA=.../libcuda_emu.so, --only vmm,mapping) it only
checks that the script runs: host-memory numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller grid (minutes -> seconds)")
    ap.add_argument("--only", default="vmm,attention,mapping", help="comma list of parts")
    ap.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    args = ap.parse_args(argv)
    parts = set(args.only.split(","))
    emulated = "cuda_emu" in os.environ.get("VATTENTION_LIBCUDA", "")
    sections, series = [], {}

    if "vmm" in parts:
        import vmm_calls

        rows = vmm_calls.measure(page_sizes_mb=(2, 8) if args.quick else (2, 4, 8, 16, 32, 64),
                                 total_mb=64 if args.quick else 1024)
        sections.append(("Per-call driver latency (microseconds per call)", rows))
        for call in ("create", "map", "set_access", "unmap"):
            series[f"{call} us/call by page MB"] = [(str(r["page_MB"]), r[f"{call}_us"]) for r in rows]

    if "attention" in parts:
        try:
            import attention

            rows = attention.measure(batches=(1, 16) if args.quick else (1, 4, 16, 64),
                                     contexts=(1024, 8192) if args.quick
                                     else (1024, 4096, 16384, 65536),
                                     iters=5 if args.quick else 20)
        except ImportError as e:
            rows = [{"skipped": f"needs torch with CUDA and flash_attn: {e}"}]
        sections.append(("FlashAttention latency: virtual vs contiguous vs paged (ratio to "
                         "contiguous; 1.00 = same)", rows))
        ok = [r for r in rows if "virtual/contiguous" in r]
        series["virtual/contiguous"] = [(f"{r['phase'][0]}B{r['batch']}C{r['context']}",
                                         r["virtual/contiguous"]) for r in ok]
        series["paged/contiguous"] = [(f"{r['phase'][0]}B{r['batch']}C{r['context']}",
                                       r["paged/contiguous"]) for r in ok]

    if "mapping" in parts:
        import mapping

        rows = mapping.measure(batch=8 if args.quick else 64, max_seq=2048 if args.quick else 8192)
        sections.append(("Mapping throughput of cache.step()", rows))
        series["mapping GB/s"] = [(f"{r['page']} pre={r['pages_pre_created']}", r["GB_per_s"])
                                  for r in rows]

    md = [f"# GPU benchmarks\n\n`python benchmarks/gpu/run_all.py{' --quick' if args.quick else ''}`"
          f" on {platform.node()} at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n"]
    if emulated:
        md.append("**EMULATION RUN: host memory behind the CUDA test emulation; these numbers say "
                  "nothing about a GPU.**\n")
    try:
        import torch

        if torch.cuda.is_available():
            md.append(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}.\n")
    except ImportError:
        pass
    for title, rows in sections:
        md.append(f"\n## {title}\n\n" + report.markdown_table(rows))
    md_path = os.path.join(args.out_dir, "results.md")
    png_path = os.path.join(args.out_dir, "results.png")
    with open(md_path, "w") as f:
        f.write("\n".join(md))
    how = report.write_png(png_path, {k: v for k, v in series.items() if v})
    print("\n".join(md))
    print(f"wrote {md_path} and {png_path} ({how})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
