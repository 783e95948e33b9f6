"""`make gpu-check`: vattention on a real GPU in one offline command, under a time budget.

    make gpu-check                         # PYTHON=python3: builds in place, then the parts below
    GPU_CHECK_EMULATED=1 make gpu-check    # the same on the CUDA driver EMULATION (CI)

Environment: GPU_CHECK_BUDGET (seconds for everything, build included; default 480),
GPU_CHECK_OUT (default gpu-check/), GPU_CHECK_EMULATED=1, GPU_CHECK_PARTS (a comma list: only
those parts), OUT (a second folder for the report: the GPU machine's), GPU_CHECK_WHEELS (a folder
of wheels, FlashAttention-4's set: installed offline into GPU_CHECK_OUT/wheels-site for the
parts, fa4_wheels.py).

It builds vattention._C for the running interpreter (build.py: no pip, no network), then runs
the parts in order of value, each in a process of its own with what is left of the budget (less
a reserve for the report). A part that runs out of time is "cut" (what it finished is kept), a
failing part does not stop the others. It writes gpu-check.json, gpu-check.md and
gpu-check-logs.txt and prints the markdown, also when the build failed or there is no GPU.
Exit status: 0 when no part failed, 1 when one did, 2 when there is no GPU to run on (real mode;
one line on stderr says why) or the build failed.

On the emulation every line of the report says "emulated": its figures describe host memory and
the emulation, never a GPU.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import fa4_wheels  # noqa: E402

import build  # noqa: E402

DEFAULT_BUDGET_S = 480.0
MIN_PART_S = 3.0  # a part that would get less is cut without starting
# The flash-attn-4 part's share: FA4 compiles each kernel at its first call (about a dozen here),
# kept on disk (GPU_CHECK_OUT/fa4-kernels) for the next run; what it measured by then is kept.
FA4_LIMIT_S = 150.0
# Test modules that import a package the GPU machine may lack are left out of the suite (and
# listed), rather than stopping pytest's collection.
OPTIONAL_TEST_DEPS = ("hypothesis", "numpy")
EMULATED_SUITE_GRANULARITY = 2 << 20  # a GPU's: the emulation skips what a GPU skips

INFLIGHT = "tests/test_cuda_inflight.py::"
CAPTURE_TEST = INFLIGHT + "test_a_global_capture_beside_the_prefetch_thread_is_not_invalidated"
STREAM_TEST = INFLIGHT + "test_a_kernel_in_flight_on_a_nonblocking_stream_outlives_its_slots_free"


@dataclass
class Part:
    name: str
    title: str  # what it checks on a GPU
    emulated_title: str  # what it checks on the emulation
    # pytest arguments, or None for a measuring part of parts.py
    gpu_pytest: list[str] | None = None
    emulated_pytest: list[str] | None = None
    # why the part does not run on the emulation ("" when it has an emulated analogue)
    emulated_skip: str = ""
    # at most this many seconds of the budget (0: what is left), so that a part whose first run
    # is slow (kernels compiled at first use) cannot take the time of the parts after it
    limit_s: float = 0.0


PARTS = [
    Part(
        "suite",
        "The CUDA-backend tests on the real driver: the emulated suite's cuda cases, 2 MB pages",
        "The cuda cases a GPU runs, on the emulation at a GPU's 2 MB granularity",
        gpu_pytest=["--cuda-cases", "tests"],
        emulated_pytest=["--cuda-cases", "tests"],
    ),
    Part(
        "vmm",
        "Driver calls: microseconds per call beside the A100 figures; step() mapping",
        "The emulation's calls (host mmap/mprotect), beside the A100 figures; step() mapping",
    ),
    Part(
        "attention",
        "Attention over the virtual cache vs a contiguous copy (bf16)",
        "CPU SDPA over host_alias views of the emulated memory vs a contiguous copy (bf16)",
    ),
    Part(
        "flash-attn-4",
        "FlashAttention-4 over the cache: vs fp32 SDPA (layouts, dtypes, GQA), NaN planted past "
        "a row's length, a mega row ending before a page boundary, time vs a contiguous copy, "
        "page_table (16/64/256 tokens a page) vs the virtual cache",
        "FlashAttention-4 over the cache",
        emulated_skip="needs a GPU",
        limit_s=FA4_LIMIT_S,
    ),
    Part(
        "prefetch",
        "Prefetch behind a GPU kernel: step() blocking, prefetch / none",
        "Prefetch behind a host sleep, A100 latencies held by the emulation: step() blocking",
    ),
    Part(
        "memory",
        "The driver's free memory (cuMemGetInfo) against the cache's committed_bytes and "
        "bytes_mapped: create (virtual tensors larger than the GPU), step, free, reclaim, a budget "
        "refusal, close",
        "The same on the emulation's 4 GiB device budget (its cuMemGetInfo: the budget less live "
        "handles)",
    ),
    Part(
        "graphs",
        "CUDA graphs over the cache, prefetch thread active in the capture; reduce-overhead",
        "A GLOBAL-mode capture (emu.begin_capture) while the prefetch thread maps; no graph runs",
        gpu_pytest=["-m", "gpu", "tests/gpu/test_gpu_cuda_graph.py"],
        emulated_pytest=[CAPTURE_TEST],
    ),
    Part(
        "streams",
        "A kernel in flight on a side stream outlives its slot's free",
        "A held unit (emu.launch) on a non-blocking stream outlives its slot's free",
        gpu_pytest=["-m", "gpu", "tests/gpu/test_gpu_streams.py"],
        emulated_pytest=[STREAM_TEST],
    ),
    Part(
        "generate",
        "transformers generate(), Llama-3.2-1B shape, bf16, batch 8, 1024 + 256: DynamicCache, "
        "StaticCache compiled, VAttentionCache eager and compiled: tokens/s, first divergence "
        "per row from DynamicCache, KV bytes held; update() host time",
        "transformers generate() on the CPU (host backend, a tiny Llama in fp32, compiled rows "
        "by dynamo alone): the plumbing, tokens equal to DynamicCache's",
    ),
    Part(
        "gpu-tests",
        "The other GPU tests (tests/gpu: illegal address, fp8, FlashAttention if installed)",
        "The other GPU tests (tests/gpu)",
        gpu_pytest=[
            "-m",
            "gpu",
            "tests/gpu",
            "--ignore=tests/gpu/test_gpu_vllm.py",
            "--ignore=tests/gpu/test_gpu_cuda_graph.py",
            "--ignore=tests/gpu/test_gpu_streams.py",
            # FA4's whole matrix (36 kernels to compile): by hand; the flash-attn-4 part runs
            # its short version
            "--ignore=tests/gpu/test_gpu_fa4.py",
        ],
        emulated_skip="needs a GPU",
    ),
    Part(
        "cpu-attention",
        "The CPU kernel on this machine's CPU (no GPU): decode K/V read rate / a streaming copy, "
        "GQA 4 bf16 and GQA 1 fp32, 16 x 4096 tokens; all cores, 2 threads, AVX2",
        "The CPU kernel on this machine's CPU (no GPU): a small decode, checked against SDPA",
    ),
]
PART_NAMES = [p.name for p in PARTS]


@dataclass
class Result:
    name: str
    title: str
    status: str = "skipped"  # passed | failed | cut | skipped | expected failure
    why: str = ""
    seconds: float = 0.0
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tests: dict[str, int] = field(default_factory=dict)
    listed: list[str] = field(default_factory=list)  # failures, skip reasons, figures


class Runner:
    def __init__(self, emulated: bool, budget: float, out: Path):
        self.emulated = emulated
        self.start = time.monotonic()
        self.deadline = self.start + budget
        self.budget = budget
        self.reserve = min(15.0, 0.1 * budget)  # for the report
        self.out = out
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        for old in self.logs.iterdir():  # an earlier run's, which the report would quote
            old.unlink()
        self.env = self._env()

    def _env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), str(HERE)] + [p for p in [env.get("PYTHONPATH")] if p]
        )
        if self.emulated:
            sys.path.insert(0, str(ROOT / "tests" / "cuda_emulator"))
            import emu

            reason = emu.unavailable_reason()
            if reason:
                raise SystemExit(f"gpu-check (emulated): the CUDA driver emulation: {reason}")
            env["VATTENTION_LIBCUDA"] = str(emu.LIB_PATH)
            env["VAEMU_SUITE_GRANULARITY"] = str(EMULATED_SUITE_GRANULARITY)
        elif "cuda_emu" in env.get("VATTENTION_LIBCUDA", ""):
            del env["VATTENTION_LIBCUDA"]  # the real driver, whatever the shell had
        return env

    def left(self) -> float:
        return self.deadline - self.reserve - time.monotonic()

    def say(self, text: str) -> None:
        label = "gpu-check (emulated)" if self.emulated else "gpu-check"
        print(f"{label}: {text}", flush=True)

    # ---- one part ------------------------------------------------------------------------------
    def run(self, part: Part) -> Result:
        res = Result(part.name, part.emulated_title if self.emulated else part.title)
        if self.emulated and part.emulated_skip:
            res.why = part.emulated_skip
            return res
        left = self.left()
        if part.limit_s:
            left = min(left, part.limit_s)
        if left < MIN_PART_S:
            res.status, res.why = "cut", "no time left in the budget"
            return res
        log = self.logs / f"{part.name}.jsonl"
        log.unlink(missing_ok=True)
        pytest_args = part.emulated_pytest if self.emulated else part.gpu_pytest
        if pytest_args is not None:
            cmd = [sys.executable, "-m", "pytest", "-p", "pytest_log", "-p", "no:cacheprovider"]
            cmd += ["-q", *pytest_args]
            if part.name == "suite":
                cmd += self._ignored_modules(res)
        else:
            cmd = [sys.executable, str(HERE / "parts.py"), part.name, str(log)]
            cmd += ["--emulated"] if self.emulated else []
        t0 = time.monotonic()
        rc, cut = self._spawn(cmd, dict(self.env, GPU_CHECK_LOG=str(log)), left, part.name)
        res.seconds = round(time.monotonic() - t0, 1)
        lines = read_lines(log)
        if pytest_args is not None:
            starts = [x["test"] for x in lines if x["kind"] == "start"]
            self._tests(res, [x for x in lines if x["kind"] == "test"], starts, rc)
        else:
            rows = [x for x in lines if x["kind"] == "row"]
            res.rows = [{k: v for k, v in x.items() if k != "kind"} for x in rows]
            res.notes += [x["text"] for x in lines if x["kind"] == "note"]
            self._measured(res, rc)
            skips = [x["why"] for x in lines if x["kind"] == "skip"]
            if skips and res.status == "passed":  # a part that found nothing to run on
                res.status, res.why = "skipped", skips[0]
        if cut:
            limit = "its own limit" if left == part.limit_s else "the budget's limit"
            res.status, res.why = "cut", f"stopped at {limit} after {res.seconds:.0f} s"
        return res

    def _spawn(self, cmd: list[str], env: dict, limit: float, name: str) -> tuple[int, bool]:
        """(exit code, cut). The part's output goes to logs/<name>.txt; its process group is
        stopped at ``limit`` seconds."""
        with (self.logs / f"{name}.txt").open("w") as out:
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                return proc.wait(timeout=limit), False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                return proc.returncode, True

    def _ignored_modules(self, res: Result) -> list[str]:
        """--ignore for test modules importing an optional package this interpreter lacks."""
        import importlib.util

        args = []
        for dep in OPTIONAL_TEST_DEPS:
            if importlib.util.find_spec(dep) is not None:
                continue
            pattern = re.compile(rf"^(import|from) {dep}\b", re.M)
            for f in sorted((ROOT / "tests").glob("test_*.py")):
                if pattern.search(f.read_text()):
                    args.append(f"--ignore=tests/{f.name}")
                    res.notes.append(f"not run: tests/{f.name} (needs {dep}, not installed)")
        return args

    def _tests(self, res: Result, tests: list[dict], starts: list[str], rc: int) -> None:
        counts = Counter(t["outcome"] for t in tests)
        res.tests = dict(sorted(counts.items()))
        bad = [t for t in tests if t["outcome"] in ("failed", "error")]
        for t in bad[:15]:
            res.listed.append(f"{t['outcome'].upper()} {t['test']}: {t['why'][:200]}")
        if len(bad) > 15:
            res.listed.append(f"... and {len(bad) - 15} more (logs/{res.name}.txt)")
        for t in tests:
            if t["outcome"] in ("xfailed", "xpassed"):
                res.listed.append(f"{t['outcome']} {t['test']}: {t['why'][:200]}")
            if t["figures"]:
                figs = ", ".join(f"{k} {v}" for k, v in t["figures"].items())
                res.listed.append(f"{t['test'].rsplit('::', 1)[-1]}: {figs}")
        skips = Counter(t["why"] for t in tests if t["outcome"] == "skipped")
        for why, n in skips.most_common(8):
            res.listed.append(f"skipped {n}: {why}")
        if bad or rc not in (0, 5):
            res.status = "failed"
            if not bad:  # a crash, or a collection error: no test's failure says why
                hung = [t for t in starts if t not in {x["test"] for x in tests}]
                res.why = f"pytest exited {rc}" + (f" during {hung[-1]}" if hung else "")
        elif counts["passed"] + counts["xpassed"]:
            res.status = "passed"
        elif counts["xfailed"]:
            xfailed = next(t for t in tests if t["outcome"] == "xfailed")
            res.status, res.why = "expected failure", xfailed["xfail_reason"]
        else:
            res.status = "skipped"
            res.why = next((t["why"] for t in tests), "no test selected")
        if counts["xfailed"] and res.status == "passed":
            res.why = "with an expected failure (listed)"
        if counts["xpassed"]:
            res.why = "an expected failure passed: the fix landed, drop its xfail mark"

    def _measured(self, res: Result, rc: int) -> None:
        errors = [r for r in res.rows if "error" in r]
        unequal = [r for r in res.rows if r.get("equal") is False]
        if rc != 0:
            tail = (self.logs / f"{res.name}.txt").read_text().strip().splitlines()[-1:]
            res.status, res.why = "failed", f"exit {rc}: {tail[0][:200] if tail else ''}"
        elif unequal:
            res.status, res.why = "failed", f"{len(unequal)} case(s) differ from contiguous"
        elif errors:
            res.status, res.why = "failed", f"{len(errors)} case(s) raised"
        else:
            res.status = "passed"


def read_lines(log: Path) -> list[dict]:
    """The JSON lines a part wrote; a line cut short by a stopped process is dropped."""
    lines = []
    for text in log.read_text().splitlines() if log.exists() else []:
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            pass
    return lines


# ---- environment and report ----------------------------------------------------------------------

PROBE = r"""
import ctypes, json, os, platform, subprocess
info = {"python": platform.python_version()}
try:
    import torch
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["device"] = f"{p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB)"
except Exception as e:
    info["torch"] = f"unavailable ({type(e).__name__}: {e})"
try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.strip()
    info["driver"] = out.splitlines()[0] if out else None
except Exception:
    info["driver"] = None
try:
    lib = ctypes.CDLL(os.environ.get("VATTENTION_LIBCUDA") or "libcuda.so.1")
    v = ctypes.c_int()
    if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
        info["driver_cuda"] = f"{v.value // 1000}.{v.value % 1000 // 10}"
except Exception:
    pass
try:
    import vattention._C as C
    info["cuda_backend"] = C.backend_unavailable_reason("cuda") or "available"
except Exception as e:
    info["cuda_backend"] = f"vattention does not import ({type(e).__name__}: {e})"
print(json.dumps(info))
"""


def probe(env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"probe": f"failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"}


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return ""


def describe(info: dict[str, Any], emulated: bool) -> str:
    if emulated:
        device = "CUDA driver EMULATION (tests/cuda_emulator, host memory), no GPU"
        driver = "the emulation"
    else:
        device = info.get("device", "no CUDA device visible to torch")
        driver = info.get("driver") or "?"
    return (
        f"device: {device}; driver: {driver} (CUDA {info.get('driver_cuda', '?')}); "
        f"torch {info.get('torch', '?')} (CUDA {info.get('torch_cuda')}); "
        f"Python {info.get('python', platform.python_version())}; "
        f"CUDA backend: {info.get('cuda_backend', '?')}"
    )


def fmt_row(row: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in row.items())


def markdown(report: dict[str, Any]) -> str:
    """Line by line, no blank line; emulated: every line says so."""
    emulated = report["mode"] == "emulated"
    tag = "emulated: " if emulated else ""
    head = "GPU check, EMULATED driver (not a GPU)" if emulated else "GPU check"
    lines = [f"# vattention {head}" + (" [emulated]" if emulated else "")]
    when = f"{report['date']}, commit {report['commit'] or '?'}"
    lines.append(f"- {tag}{report['command']} on {when}")
    lines.append(f"- {tag}{report['environment_line']}")
    b = report["build"]
    lines.append(f"- {tag}build: {b['status']} in {b['seconds']} s: {b['line']}")
    if b.get("wheels"):
        lines.append(f"- {tag}wheels: {b['wheels']}")
    for i, p in enumerate(report["parts"], 1):
        why = f" ({p['why']})" if p["why"] else ""
        lines.append(
            f"## {i} {p['name']}: {p['status']}{why}, {p['seconds']} s"
            + (" [emulated]" if emulated else "")
        )
        lines.append(f"- {tag}{p['title']}")
        if p["tests"]:
            lines.append(f"- {tag}tests: " + ", ".join(f"{v} {k}" for k, v in p["tests"].items()))
        lines += [f"- {tag}{x}" for x in p["notes"] + p["listed"]]
        lines += [f"- {tag}{fmt_row(r)}" for r in p["rows"]]
    lines.append(
        f"**{tag}overall: {report['overall']}; {report['duration_s']} s of a "
        f"{report['budget_s']:g} s budget.**"
    )
    return "\n".join(lines) + "\n"


def write(out: Path, report: dict[str, Any], md: str) -> list[Path]:
    """gpu-check.json, gpu-check.md and gpu-check-logs.txt into out and, when set, $OUT."""
    logs = []
    for f in sorted((out / "logs").glob("*.txt")):
        text = f.read_text(errors="replace")
        logs.append(f"===== {f.name}\n{text[-400_000:]}")
    files = {
        "gpu-check.json": json.dumps(report, indent=1) + "\n",
        "gpu-check.md": md,
        "gpu-check-logs.txt": "\n".join(logs),
    }
    written = []
    for folder in [out] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text)
            written.append(folder / name)
    return written


def main() -> int:
    emulated = os.environ.get("GPU_CHECK_EMULATED", "") not in ("", "0")
    budget = float(os.environ.get("GPU_CHECK_BUDGET") or DEFAULT_BUDGET_S)
    out = Path(os.environ.get("GPU_CHECK_OUT") or ROOT / "gpu-check")
    only = [p for p in os.environ.get("GPU_CHECK_PARTS", "").split(",") if p]
    unknown = [p for p in only if p not in PART_NAMES]
    if unknown:
        known = ",".join(PART_NAMES)
        print(f"gpu-check: unknown part(s) {unknown}; parts: {known}", file=sys.stderr)
        return 2
    runner = Runner(emulated, budget, out)
    runner.say(f"building vattention._C for {sys.executable}")
    t0 = time.monotonic()
    ok, line = build.build(runner.logs / "build.txt")
    seconds = round(time.monotonic() - t0, 1)
    build_info = {"status": "ok" if ok else "failed", "line": line, "seconds": seconds}
    runner.say(f"build: {line}")
    wheels = os.environ.get("GPU_CHECK_WHEELS")
    if ok and wheels:
        target = out / "wheels-site"
        runner.say(f"installing the wheels of {wheels} into {target} (offline)")
        installed, wheel_line = fa4_wheels.install(Path(wheels), target)
        build_info["wheels"] = wheel_line
        runner.say(f"wheels: {wheel_line}")
        if installed:
            runner.env["GPU_CHECK_FA4_SITE"] = str(target)
    info = probe(runner.env) if ok else {}
    stop = "" if ok else f"the build failed: {line}"
    if ok and not emulated and (info.get("cuda_backend") != "available" or "device" not in info):
        backend = info.get("cuda_backend")
        why = backend if backend != "available" else "torch sees no GPU"
        stop = f"no GPU to run on ({why})"
        print(
            f"gpu-check: {stop}; GPU_CHECK_EMULATED=1 make gpu-check runs the check on the CUDA "
            "driver emulation",
            file=sys.stderr,
        )
    results = []
    for part in PARTS:
        if only and part.name not in only:
            continue
        if stop:  # reported all the same: the device tool brings the report and logs back
            res = Result(part.name, part.title, why=stop.split(":")[0].split(" (")[0])
        else:
            runner.say(f"{part.name} ...")
            res = runner.run(part)
            runner.say(f"{part.name}: {res.status} {res.why} ({res.seconds} s)".replace("  ", " "))
        results.append(res)
    failed = [r.name for r in results if r.status == "failed"]
    cut = [r.name for r in results if r.status == "cut"]
    overall = f"FAILED: {', '.join(failed)}" if failed else "no part failed"
    if stop:
        overall = f"NOT RUN: {stop}"
    if cut:
        overall += f"; cut by the budget: {', '.join(cut)}"
    env_words = " ".join(
        f"{k}={os.environ[k]}"
        for k in ("GPU_CHECK_EMULATED", "GPU_CHECK_BUDGET", "GPU_CHECK_PARTS", "GPU_CHECK_WHEELS")
        if os.environ.get(k)
    )
    report = {
        "mode": "emulated" if emulated else "gpu",
        "command": f"{env_words} make gpu-check (PYTHON={sys.executable})".lstrip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit(),
        "environment": info,
        "environment_line": describe(info, emulated),
        "budget_s": budget,
        "duration_s": round(time.monotonic() - runner.start, 1),
        "build": build_info,
        "parts": [r.__dict__ for r in results],
        "overall": overall,
    }
    md = markdown(report)
    written = write(out, report, md)
    print(md, end="")
    print(f"wrote {', '.join(str(p) for p in written)}")
    return 2 if stop else 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
