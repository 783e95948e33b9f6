"""Every GPU test and benchmark in one command; writes one report (results.md + results.png).

    python benchmarks/gpu/run_all.py             # on a machine with an NVIDIA GPU (+ flash_attn)
    python benchmarks/gpu/run_all.py --quick     # smaller grids (minutes -> about a minute)
    python benchmarks/gpu/run_all.py --dry-run   # no GPU: the same logic through the CUDA
                                                 # driver EMULATION (tests/cuda_emulator);
                                                 # numbers mean nothing

Parts (--only, comma list; default all):
  tests      pytest -m gpu tests/gpu: FlashAttention on the virtual cache vs contiguous, an unmapped
             read is an illegal address, CUDA-graph capture/replay over pages mapped after capture,
             torch.compile(mode="reduce-overhead") equal to eager
  suite      the backend-parametrized test suite's "cuda" cases (tests/, -k cuda) on this device
  prefetch   benchmarks/bench_prefetch.py's decode loop on the CUDA backend: step() blocking with
             background prefetch vs without (target <= 0.1), p99, driver calls per step
  vmm        per-call latency of cuMemCreate/Map/SetAccess/Unmap/Release by page size
  attention  FlashAttention decode/prefill: virtual vs contiguous vs FA's paged KV (ratios)
  mapping    mapping throughput of cache.step() in GB/s

Paste results.md into an issue. Exit status: 0 when every part ran and no test failed, 1 when
something failed (the report says what), 2 when there is no GPU to run on (one line says why).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import report  # noqa: E402

PARTS = ("tests", "suite", "prefetch", "vmm", "attention", "mapping")


def use_emulation() -> str:
    """Points the CUDA backend at the driver emulation (building it); returns why not, or ""."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "cuda_emulator"))
    import emu

    reason = emu.unavailable_reason()
    if not reason:
        os.environ["VATTENTION_LIBCUDA"] = str(emu.LIB_PATH)
    return reason


def no_gpu_reason() -> str:
    """ "" when vattention's CUDA backend can run here (a driver and a device), else why not."""
    try:
        from vattention import backends
    except Exception as e:  # an unbuilt checkout, a broken install
        return f"vattention does not import ({type(e).__name__}: {e})"
    return backends.unavailable_reason("cuda") or ""


def pytest_rows(args: list[str], junit: str, timeout_s: int) -> tuple[list[dict], bool]:
    """Runs pytest in a subprocess; one row per test from its JUnit XML. Returns (rows, ok)."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    rows = []
    if os.path.exists(junit):
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome, detail = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[
                        child.tag
                    ]
                    detail = ((child.get("message") or "").splitlines() or [""])[0][:160]
            rows.append(
                {
                    "test": f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}",
                    "outcome": outcome,
                    "detail": detail,
                }
            )
    if not rows:
        last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
        rows = [{"test": " ".join(args), "outcome": "ERROR", "detail": last[0][:160]}]
    ok = proc.returncode in (0, 5)  # 5: nothing collected/selected
    return rows, ok


def summary_rows(rows: list[dict]) -> list[dict]:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return [{"outcome": k, "tests": v} for k, v in sorted(counts.items())]


def run_part(name: str, args, out_dir: str, emulated: bool) -> tuple[str, list[dict], dict, bool]:
    """(section title, rows, plot series, ok) of one part."""
    quick = args.quick
    if name == "tests":
        rows, ok = pytest_rows(
            ["-m", "gpu", "-rA", "tests/gpu"], os.path.join(out_dir, "gpu-tests.xml"), 1800
        )
        title = "GPU tests (pytest -m gpu tests/gpu)"
        if emulated:
            title += ": skip under the emulation by design; this checks the kit runs them"
        return title, rows, {}, ok and not any(r["outcome"] in ("FAILED", "ERROR") for r in rows)
    if name == "suite":
        rows, ok = pytest_rows(
            ["-k", "cuda", "--ignore=tests/gpu", "tests"], os.path.join(out_dir, "suite.xml"), 3600
        )
        failed = [r for r in rows if r["outcome"] in ("FAILED", "ERROR")]
        return (
            "Backend-parametrized suite, cuda cases (pytest -k cuda tests)",
            summary_rows(rows) + failed,
            {},
            ok and not failed,
        )
    if name == "prefetch":
        import bench_prefetch

        rows, series = [], []
        dims = dict(num_layers=32, num_kv_heads=8, head_dim=128)  # Llama-3-8B's KV shape
        for layout in ("layer", "mega"):
            kw = dict(
                iterations=100 if quick else 300,
                gap_s=0.002,
                slots=16 if quick else 64,
                device="cuda:0",
                dims=dims,
                lookahead_tokens=16,
            )
            base = bench_prefetch.run(layout, "2MB", False, **kw)
            pf = bench_prefetch.run(layout, "2MB", True, **kw)
            ratio = pf["mean"] / base["mean"]
            rows.append(
                {
                    "layout": layout,
                    "page": "2MB",
                    "tokens/page": base["tokens_per_page"],
                    "no prefetch mean/p99 us": (
                        f"{base['mean'] * 1e6:.1f} / {base['p99'] * 1e6:.1f}"
                    ),
                    "prefetch mean/p99 us": f"{pf['mean'] * 1e6:.1f} / {pf['p99'] * 1e6:.1f}",
                    "ratio (target <= 0.1)": round(ratio, 3),
                    "driver calls/step in step (pf run)": pf["step_calls"],
                    "driver calls/step by prefetch thread": pf["prefetch_calls"],
                }
            )
            series.append((layout, ratio))
        return (
            "step() blocking with prefetch vs without (bench_prefetch.py, 2 ms compute gap)",
            rows,
            {"prefetch/no-prefetch blocking": series},
            True,
        )
    if name == "vmm":
        import vmm_calls

        rows = vmm_calls.measure(
            page_sizes_mb=(2, 8) if quick else (2, 4, 8, 16, 32, 64), total_mb=64 if quick else 1024
        )
        series = {
            f"{call} us/call by page MB": [(str(r["page_MB"]), r[f"{call}_us"]) for r in rows]
            for call in ("create", "map", "set_access", "unmap")
        }
        return "Per-call driver latency (microseconds per call)", rows, series, True
    if name == "attention":
        title = (
            "FlashAttention latency: virtual vs contiguous vs paged (ratio to contiguous; "
            "1.00 = same)"
        )
        try:
            import torch

            if not torch.cuda.is_available():
                raise ImportError("torch sees no CUDA device")
            import attention
        except ImportError as e:
            return title, [{"skipped": f"needs torch with CUDA and flash_attn: {e}"}], {}, True
        rows = attention.measure(
            batches=(1, 16) if quick else (1, 4, 16, 64),
            contexts=(1024, 8192) if quick else (1024, 4096, 16384, 65536),
            iters=5 if quick else 20,
        )
        ok_rows = [r for r in rows if "virtual/contiguous" in r]
        series = {
            key: [(f"{r['phase'][0]}B{r['batch']}C{r['context']}", r[key]) for r in ok_rows]
            for key in ("virtual/contiguous", "paged/contiguous")
        }
        return title, rows, series, True
    if name == "mapping":
        import mapping

        rows = mapping.measure(batch=8 if quick else 64, max_seq=2048 if quick else 8192)
        series = {
            "mapping GB/s": [
                (f"{r['page']} pre={r['pages_pre_created']}", r["GB_per_s"]) for r in rows
            ]
        }
        return "Mapping throughput of cache.step()", rows, series, True
    raise ValueError(name)


def header(args, emulated: bool) -> list[str]:
    cmd = "python benchmarks/gpu/run_all.py" + "".join(f" {a}" for a in sys.argv[1:])
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    md = [
        f"# vattention GPU kit report\n\n`{cmd}` on {platform.node()} at "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        f"{f', commit {commit}' if commit else ''}.\n"
    ]
    if emulated:
        md.append(
            "**DRY RUN through the CUDA driver EMULATION (host memory): this checks that the "
            "kit runs; its numbers say nothing about a GPU.**\n"
        )
    try:
        import torch

        gpu = (
            torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible to torch"
        )
        md.append(
            f"GPU: {gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
            f"Python {platform.python_version()}.\n"
        )
    except ImportError:
        md.append("torch is not installed.\n")
    return md


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller grids")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="no GPU needed: run through the CUDA driver emulation (numbers meaningless)",
    )
    ap.add_argument(
        "--only", default=",".join(PARTS), help=f"comma list of parts: {','.join(PARTS)}"
    )
    ap.add_argument("--out-dir", default=HERE, help="where results.md and results.png go")
    args = ap.parse_args(argv)
    parts = [p for p in args.only.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    if args.dry_run:
        reason = use_emulation()
        if reason:
            print(
                f"run_all.py: --dry-run needs the CUDA driver emulation: {reason}", file=sys.stderr
            )
            return 2
    emulated = "cuda_emu" in os.environ.get("VATTENTION_LIBCUDA", "")
    reason = no_gpu_reason()
    if reason:
        print(
            f"run_all.py: no GPU to run on ({reason}); this kit needs an NVIDIA GPU and driver "
            f"(or --dry-run, which runs it through the CUDA driver emulation)",
            file=sys.stderr,
        )
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    md, series, all_ok = header(args, emulated), {}, True
    for name in parts:
        t0 = time.perf_counter()
        print(f"run_all.py: {name} ...", flush=True)
        try:
            title, rows, part_series, ok = run_part(name, args, args.out_dir, emulated)
        except Exception as e:  # one broken part must not lose the others' results
            title, part_series, ok = f"{name}: ERROR", {}, False
            rows = [
                {
                    "error": f"{type(e).__name__}: {e}",
                    "where": traceback.format_exc().strip().splitlines()[-3].strip(),
                }
            ]
        all_ok = all_ok and ok
        series.update({k: v for k, v in part_series.items() if v})
        md.append(
            f"\n## {title}\n\n_{name}: {'ok' if ok else 'FAILED'}, "
            f"{time.perf_counter() - t0:.0f} s_\n\n" + report.markdown_table(rows)
        )
    overall = "all parts ran, no test failed" if all_ok else "FAILURES above"
    md.append(f"\n**Overall: {overall}.**\n")
    md_path = os.path.join(args.out_dir, "results.md")
    png_path = os.path.join(args.out_dir, "results.png")
    with open(md_path, "w") as f:
        f.write("\n".join(md))
    how = report.write_png(png_path, series)
    print("\n".join(md))
    print(f"wrote {md_path} and {png_path} ({how})")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
