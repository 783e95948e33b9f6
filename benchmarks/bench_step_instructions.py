"""What one KVCache.step() with nothing to map costs, counted rather than timed: instructions
(valgrind's callgrind) split into Python, the bindings and the core, and the driver calls,
context switches and event calls the CUDA backend makes per step (the driver EMULATION's
per-entry-point counters).

Wall-clock figures of a call that takes microseconds move with the machine's load; instruction
and call counts do not, so they compare builds on a shared machine. They say nothing about a
GPU's own latency: a driver call on a GPU costs microseconds whatever it executes on the host.

    python benchmarks/bench_step_instructions.py            # every row, each under callgrind
    python benchmarks/bench_step_instructions.py --rows cuda/layer/64 --steps 2000

Each row (backend/layout/rows) runs in a process of its own under ``valgrind --tool=callgrind``
with instrumentation off until the counted loop (a ctypes helper compiled here from
valgrind/callgrind.h toggles it), so importing torch costs nothing. The loop: one cache of
Llama-3-8B's KV shape with 2 MB pages (the cuda rows through the emulation at a 2 MB
granularity), one request per row stepped once to map its pages, the prefetch thread started and
idle (one prefetch() call, joined), 50 warm-up calls, then ``--steps`` calls of ``step(lens)``
with the same dict, which map nothing. Columns: instructions per step, then where they ran, by
the object file callgrind names: python (the interpreter, including the dict iteration and int
conversions the bindings call), torch (libtorch, libc10), bindings (vattention._C outside the
core), core (vattention:: and std:: code in vattention._C), libc (libc, libstdc++, the loader:
locks, allocation), other; then the emulated driver's calls per step (all entry points; context
queries and switches; event calls). Needs valgrind and its headers (valgrind/callgrind.h).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "cuda_emulator"))

MB = 1 << 20
LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128)
ROWS = [
    (device, layout, slots)
    for device in ("cuda", "cpu")
    for layout in ("layer", "mega")
    for slots in (8, 64)
]
CONTEXT_CALLS = ("cuCtxGetCurrent", "cuCtxSetCurrent", "cuCtxPushCurrent", "cuCtxPopCurrent")
EVENT_CALLS = ("cuEventCreate", "cuEventRecord", "cuEventQuery", "cuEventSynchronize")

TOGGLE_C = r"""
#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT("step loop"); }
"""


def build_toggle(folder: Path) -> Path:
    """A shared object whose start()/stop() turn callgrind's instrumentation on and off."""
    src, lib = folder / "toggle.c", folder / "toggle.so"
    src.write_text(TOGGLE_C)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def driver_calls(em) -> dict[str, int]:
    """The emulated driver's calls so far: all entry points together, and the context and event
    calls one by one."""
    return {n: em.counter(n) for n in ("all_calls", *CONTEXT_CALLS, *EVENT_CALLS)}


def child(args: argparse.Namespace) -> None:
    """One row, inside callgrind: prints `calls <json>` and leaves the instruction counts in the
    callgrind output file."""
    import json

    device, layout, slots = args.child.split("/")
    slots = int(slots)
    em = None
    if device == "cuda":
        import emu

        os.environ["VATTENTION_LIBCUDA"] = str(emu.LIB_PATH)
        em = emu.Emulator.load()
        em.reset()
        em.set_granularity(2 * MB)
        em.set_device_memory_bytes(80 << 30)
    import torch

    import vattention

    toggle = ctypes.CDLL(args.toggle)
    cfg = vattention.KVCacheConfig(
        **LLAMA3_8B,
        max_batch_size=slots,
        max_seq_len=4096,
        dtype=torch.float16,
        page_size="2MB",
        layout=layout,
        device="cuda:0" if device == "cuda" else "cpu",
    )
    with vattention.KVCache(cfg) as cache:
        lens = {cache.alloc(): 100 + i for i in range(slots)}
        cache.step(lens)
        cache.prefetch(lens)  # starts the thread; nothing to map
        cache.wait()
        for _ in range(50):  # warm: first calls fill caches and pybind11's tables
            cache.step(lens)
        before = driver_calls(em) if em else {}
        maps = cache.stats()["map_calls"]
        toggle.start()
        for _ in range(args.steps):
            cache.step(lens)
        toggle.stop()
        after = driver_calls(em) if em else {}
        assert cache.stats()["map_calls"] == maps, "the counted steps mapped pages"
    delta = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    print("calls " + json.dumps(delta), flush=True)


# Where an instruction ran, from the object file callgrind names (`ob=`).
def bucket(obj: str, fn: str) -> str:
    base = os.path.basename(obj)
    if base.startswith("_C.") or base == "_C.so":
        return (
            "core" if re.match(r"(vattention::|std::)", fn) and "python" not in fn else "bindings"
        )
    if "python" in base or base.startswith("libpython"):
        return "python"
    if base.startswith(("libtorch", "libc10", "libshm")):
        return "torch"
    if base.startswith(("libc.", "libc-", "libstdc++", "libm.", "libpthread", "ld-linux")):
        return "libc"
    if "cuda_emu" in base:
        return "driver"
    return "other"


def parse_callgrind(path: Path) -> dict[str, int]:
    """Self instructions per bucket, from a callgrind output file's `ob=`/`fn=` cost lines."""
    names: dict[str, dict[str, str]] = {"ob": {}, "fn": {}}
    totals: dict[str, int] = {}
    ob = fn = ""
    in_call = False

    def name(kind: str, text: str) -> str:
        m = re.match(r"\((\d+)\)(?: (.*))?", text)
        if not m:
            return text
        if m.group(2) is not None:
            names[kind][m.group(1)] = m.group(2)
        return names[kind].get(m.group(1), "?")

    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("ob="):
            ob = name("ob", line[3:])
        elif line.startswith("fn="):
            fn = name("fn", line[3:])
        elif line.startswith(("cob=", "cfn=")):
            name(line[1:3], line[4:])  # define the compressed name; the caller stays current
        elif line.startswith("calls="):
            in_call = True  # the next cost line is the call's inclusive cost: not self cost
        elif line and (line[0].isdigit() or line[0] in "+-*"):
            if in_call:
                in_call = False
                continue
            parts = line.split()
            if len(parts) >= 2:
                key = bucket(ob, fn)
                totals[key] = totals.get(key, 0) + int(parts[1])
    return totals


def run_row(row: str, steps: int, toggle: Path, folder: Path) -> tuple[dict, dict]:
    out = folder / f"callgrind.{row.replace('/', '-')}.out"
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out}",
        sys.executable,
        __file__,
        "--child",
        row,
        "--toggle",
        str(toggle),
        "--steps",
        str(steps),
    ]
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{row}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    import json

    line = next(x for x in proc.stdout.splitlines() if x.startswith("calls "))
    dumps = sorted(folder.glob(out.name + "*"))
    totals: dict[str, int] = {}
    for dump in dumps:  # the loop's dump (the final dump holds what ran after stop(): nothing)
        for k, v in parse_callgrind(dump).items():
            totals[k] = totals.get(k, 0) + v
    return totals, json.loads(line[len("calls ") :])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rows", default="", help="comma list of device/layout/slots")
    parser.add_argument("--keep", help="a folder to keep callgrind's output files in")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--toggle", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    import emu

    if not shutil.which("valgrind") or not Path("/usr/include/valgrind/callgrind.h").exists():
        sys.exit("needs valgrind and valgrind/callgrind.h (Debian: apt-get install valgrind)")
    wanted = [r for r in args.rows.split(",") if r]
    rows = [f"{d}/{lay}/{s}" for d, lay, s in ROWS]
    for r in wanted:
        if r not in rows:
            sys.exit(f"--rows {r!r}: one of {', '.join(rows)}")
    reason = emu.unavailable_reason()
    print(
        f"step() with nothing to map, {args.steps} calls per row under callgrind; Llama-3-8B KV "
        "shape, 2 MB pages; cuda = the driver EMULATION at a 2 MB granularity"
        + (f" (unavailable: {reason})" if reason else "")
        + "\n"
    )
    print(
        "| backend | layout | slots | instructions / step | python | torch | bindings | core | "
        "libc | other | driver calls / step | context calls / step | event calls / step |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        toggle = build_toggle(folder)
        for row in wanted or rows:
            if row.startswith("cuda") and reason:
                continue
            totals, calls = run_row(row, args.steps, toggle, folder)
            n = args.steps
            per = {k: v / n for k, v in totals.items()}
            total = sum(per.values())
            ctx = sum(v for k, v in calls.items() if k in CONTEXT_CALLS) / n
            ev = sum(v for k, v in calls.items() if k in EVENT_CALLS) / n
            device, layout, slots = row.split("/")
            drv = f"{calls.get('all_calls', 0) / n:.2f}" if device == "cuda" else "n/a"
            print(
                f"| {device} | {layout} | {slots} | {total:,.0f} | "
                + " | ".join(
                    f"{per.get(k, 0):,.0f}"
                    for k in ("python", "torch", "bindings", "core", "libc", "other")
                )
                + f" | {drv} | {ctx if device == 'cuda' else 'n/a'} | "
                f"{ev if device == 'cuda' else 'n/a'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
