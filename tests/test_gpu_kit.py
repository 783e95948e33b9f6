"""`make gpu-check` (benchmarks/gpu/check.py): its whole run on the CUDA driver EMULATION.

`GPU_CHECK_EMULATED=1 make gpu-check` runs every part that can run without a GPU (the CUDA-backend
suite at a GPU's 2 MB granularity, driver calls, CPU attention over emulated memory, prefetch
under A100 latencies, the in-flight and capture analogues) and reports every part, each line
saying "emulated", within its budget. A tiny budget cuts parts instead of overrunning; without a
GPU the real mode says why; the build step never calls pip, offline.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.cuda_testing import needs_emulation

ROOT = Path(__file__).resolve().parents[1]
PARTS = [
    "suite",
    "vmm",
    "attention",
    "flash-attn-4",
    "prefetch",
    "memory",
    "graphs",
    "streams",
    "generate",
    "gpu-tests",
    "cpu-attention",
]


def _build_module():
    spec = importlib.util.spec_from_file_location(
        "gpu_check_build", ROOT / "benchmarks/gpu/build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _build_module()


def gpu_check(tmp_path: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GPU_CHECK_", "VAEMU_")) and k not in ("VATTENTION_LIBCUDA", "OUT")
    }
    base.update(PYTHON=sys.executable, GPU_CHECK_OUT=str(tmp_path / "out"), OMP_NUM_THREADS="1")
    base.update(env)
    return subprocess.run(
        ["make", "-s", "gpu-check"],
        cwd=ROOT,
        env=base,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def built():
    """The run must not rebuild the extension this test session has loaded (make build stamps
    what it built; a stale stamp means sources changed since: rebuild first)."""
    if not build.up_to_date(build.cuda_home()):
        pytest.skip("vattention._C is not stamped as built from these sources: run `make build`")


# check.py gives a part stopped at its limit this long to exit after SIGTERM before SIGKILL.
KILL_GRACE_S = 5


def seconds_before_the_first_part(tmp_path: Path) -> float:
    """A reference measured in the caller's run: check.py's clock from its start to its first
    part (the build check and the probe, an interpreter importing torch and vattention), taken
    from a run of the one part the emulation skips at once."""
    proc = gpu_check(tmp_path / "reference", GPU_CHECK_EMULATED="1", GPU_CHECK_PARTS="gpu-tests")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((tmp_path / "reference" / "out" / "gpu-check.json").read_text())["duration_s"]


@needs_emulation
def test_emulated_check_reports_every_part_within_its_budget(tmp_path, built):
    # Every part must pass: the budget only guards against a hang (the next test checks that a
    # budget cuts parts). A budget near one machine's run time would make this a speed check,
    # failing where parts run slower (150 s were: a run took 132 s on a 2-core VM at a load of
    # 9); 480 s (check.py's default) is 3.6 times that, within gpu_check()'s 600 s timeout.
    budget = 480
    proc = gpu_check(
        tmp_path,
        GPU_CHECK_EMULATED="1",
        GPU_CHECK_BUDGET=str(budget),
        OUT=str(tmp_path / "device-out"),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    md = (tmp_path / "out" / "gpu-check.md").read_text()
    assert report["mode"] == "emulated" and report["duration_s"] <= budget
    parts = {p["name"]: p for p in report["parts"]}
    assert list(parts) == PARTS
    status = {name: p["status"] for name, p in parts.items()}
    # The capture beside the prefetch thread is an expected failure until the thread is
    # capture-safe; then it passes and the report asks for its xfail mark to go.
    assert status == {
        "suite": "passed",
        "vmm": "passed",
        "attention": "passed",
        "flash-attn-4": "skipped",
        "prefetch": "passed",
        "memory": "passed",
        "graphs": status["graphs"] if status["graphs"] == "passed" else "expected failure",
        "streams": "passed",
        "generate": "passed",
        "gpu-tests": "skipped",
        "cpu-attention": "passed",
    }, {n: (p["status"], p["why"]) for n, p in parts.items()}
    suite = parts["suite"]
    assert suite["tests"]["passed"] > 100 and "failed" not in suite["tests"]
    # The cases a GPU cannot run are skipped with their reason, as on a GPU.
    assert any("real GPUs need pages of at least 2 MB" in x for x in suite["listed"])
    assert any("not on a GPU: 64 KB pages" in x for x in suite["listed"])
    assert parts["streams"]["tests"] == {"passed": 2}
    assert parts["gpu-tests"]["why"] == "needs a GPU"
    assert parts["flash-attn-4"]["why"] == "needs a GPU"
    vmm = parts["vmm"]["rows"]
    assert vmm[0]["page_MB"] == 2 and vmm[0]["A100_2MB_us"] == "193 / 1.45 / 36 / 25.6 / n/a"
    assert all(r["equal"] is True for r in parts["attention"]["rows"])
    assert {r["layout"] for r in parts["prefetch"]["rows"]} == {"layer", "mega"}
    # The emulated driver's free memory follows the cache through its life, stage by stage.
    memory = parts["memory"]["rows"]
    assert [r["stage"] for r in memory] == [
        "create",
        "step",
        "free",
        "reclaim",
        "budget refusal",
        "close",
    ]
    assert all(r["agree"] is True for r in memory), memory
    assert memory[0]["virtual_GiB"] > memory[0]["device_GiB"] and memory[0]["driver_used_MiB"] == 0
    assert memory[1]["driver_used_MiB"] == memory[1]["bytes_mapped_MiB"] > 0
    assert memory[3]["bytes_mapped_MiB"] == 0 and memory[3]["driver_used_MiB"] > 0  # the pool's
    assert memory[4]["refused"] == "OutOfPagesError" and memory[5]["driver_used_MiB"] == 0
    # transformers generate(): every cache ran, the same tokens as DynamicCache's (fp32 on one
    # CPU), the compiled VAttentionCache held its bucket's pages; update() host times follow.
    gen = parts["generate"]["rows"]
    caches = [r["cache"] for r in gen if "cache" in r]
    assert caches == [
        "DynamicCache",
        "VAttentionCache (eager)",
        "VAttentionCache (compiled)",
        "StaticCache (compiled)",
        "VAttentionCache (compiled, mega)",
    ], gen
    assert all(r["equal"] is True and r["first_divergence"] == "- -" for r in gen[1:5]), gen
    # 32 + 16 tokens: one bucket (256 tokens, capped at max_seq_len 48), one graph for both runs
    assert gen[2]["view_len"] == 48 and gen[2]["graphs_compiled"] == 1, gen
    hosts = [r["update() host time"] for r in gen if "update() host time" in r]
    assert hosts[:2] == ["DynamicCache", "VAttentionCache"], gen
    # The CPU kernel on this machine's CPU, checked against SDPA: both cases, named by ISA.
    cpu = parts["cpu-attention"]
    assert cpu["notes"][0].startswith("CPU: ") and "cores usable" in cpu["notes"][0]
    assert any(x.startswith("kernel variants this build runs") for x in cpu["notes"])
    decode = [r for r in cpu["rows"] if "prefill" not in r]
    assert [(r["dtype"], r["gqa"]) for r in decode] == [("bfloat16", 4), ("float32", 1)]
    assert all(r["threads"] == 2 and r["kv_over_copy"] > 0 and "error" not in r for r in decode)
    # and a bf16 prefill chunk on the same variant, checked against torch SDPA and timed beside it
    (prefill,) = [r for r in cpu["rows"] if "prefill" in r]
    assert prefill["isa"] == decode[0]["isa"] and "error" not in prefill, prefill
    assert prefill["prefill"] == "32 / 8 x 64, 128 after 128" and prefill["sdpa_ms"] > 0, prefill
    # Never presented as a GPU's: every line of the report says it is the emulation's.
    lines = [x for x in md.splitlines() if x.strip()]
    assert lines and all("emulated" in x for x in lines), [x for x in lines if "emulated" not in x]
    assert md in proc.stdout
    for name in ("gpu-check.json", "gpu-check.md", "gpu-check-logs.txt"):
        assert (tmp_path / "device-out" / name).exists()


@needs_emulation
def test_a_tiny_budget_cuts_parts_and_still_reports_every_one(tmp_path, built):
    # The suite must start, then be cut. The budget less its 10% reserve for the report leaves
    # the suite about t + 5 s after the time t before the first part, measured here; it starts
    # if it gets check.py's 3 s minimum, so even if that time doubles meanwhile; and it is cut,
    # as it runs far longer (58 s uncut on a loaded 2-core VM, where t was 10-19 s).
    t = seconds_before_the_first_part(tmp_path)
    budget = max(10, math.ceil((2 * t + 5) / 0.9))
    t0 = time.monotonic()
    proc = gpu_check(tmp_path, GPU_CHECK_EMULATED="1", GPU_CHECK_BUDGET=str(budget))
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    # check.py's own clock: the part in flight stopped at the budget less the reserve, then up
    # to KILL_GRACE_S to exit; the report written within the reserve
    assert report["duration_s"] <= budget + KILL_GRACE_S, (report["duration_s"], budget)
    # make and the interpreter's start outside that clock (a second or two); the bound only
    # guards against a hang
    assert wall - report["duration_s"] < 60, (wall, report["duration_s"])
    status = {p["name"]: p["status"] for p in report["parts"]}
    assert list(status) == PARTS
    assert status.pop("gpu-tests") == "skipped"
    assert status.pop("flash-attn-4") == "skipped"
    assert set(status.values()) == {"cut"}, status
    assert "cut by the budget: suite, vmm" in report["overall"]
    whys = {p["name"]: p["why"] for p in report["parts"]}
    assert whys["suite"].startswith("stopped at the budget's limit after"), whys
    assert whys["vmm"] == "no time left in the budget"


def test_without_a_gpu_the_real_check_says_why_and_exits_2(tmp_path, built):
    proc = gpu_check(tmp_path, VATTENTION_LIBCUDA="/nonexistent/libcuda.so.1")
    assert proc.returncode != 0, proc.stdout + proc.stderr  # make's own status: 2 for any failure
    # make's own line is "make: ***" alone, "make[1]: ***" when `make test` runs the suite
    err = [x for x in proc.stderr.strip().splitlines() if not re.match(r"make(\[\d+\])?: ", x)]
    assert len(err) == 1 and err[0].startswith("gpu-check: no GPU to run on ("), proc.stderr
    assert "/nonexistent/libcuda.so.1" in err[0] and "GPU_CHECK_EMULATED=1" in err[0]


def test_unknown_part_is_refused_by_name(tmp_path):
    proc = gpu_check(tmp_path, GPU_CHECK_PARTS="suite,warp")
    assert proc.returncode != 0 and "unknown part(s) ['warp']" in proc.stderr


def test_the_build_step_runs_offline_without_pip(tmp_path, built):
    """With pip unreachable (no index, a `pip` that records being called, no network where
    `unshare -n` works), the build step finds the extension up to date and never calls pip.
    The compile itself was checked the same way (docs/cuda.md, "The GPU check")."""
    assert "pip" not in " ".join(build.build_command())
    trap = tmp_path / "trap"
    (trap / "bin").mkdir(parents=True)
    (trap / "pip").mkdir()
    called = tmp_path / "pip-called"
    shim = f"import sys; open({str(called)!r}, 'a').write(' '.join(sys.argv)); sys.exit(1)\n"
    (trap / "pip" / "__init__.py").write_text(shim)
    (trap / "pip" / "__main__.py").write_text(shim)
    for name in ("pip", "pip3"):
        exe = trap / "bin" / name
        exe.write_text(f'#!/bin/sh\necho "$0 $*" >> {called}\nexit 1\n')
        exe.chmod(0o755)
    env = dict(
        os.environ,
        PIP_NO_INDEX="1",
        PIP_INDEX_URL="file:///nonexistent",
        PATH=f"{trap / 'bin'}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=str(trap),
    )
    cmd = [sys.executable, "benchmarks/gpu/build.py"]
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0:
        cmd = [unshare, "-rn", *cmd]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("build: up to date: _C"), proc.stdout
    assert not called.exists(), called.read_text()


def test_the_check_builds_the_cpu_kernels_isa_variants_only_on_8_or_more_cores(monkeypatch):
    monkeypatch.delenv("VATTENTION_CPU_KERNELS", raising=False)
    monkeypatch.setattr(build.os, "cpu_count", lambda: 16)  # the GPU machine's
    assert build.build_env(None)["VATTENTION_CPU_KERNELS"] == "all"
    monkeypatch.setattr(build.os, "cpu_count", lambda: 2)  # CI's
    assert build.build_env(None)["VATTENTION_CPU_KERNELS"] == "generic"
    monkeypatch.setenv("VATTENTION_CPU_KERNELS", "all")  # the caller's choice wins
    assert build.build_env(None)["VATTENTION_CPU_KERNELS"] == "all"


def test_a_failed_build_of_the_isa_variants_falls_back_to_generic(tmp_path, monkeypatch):
    """A compiler that cannot build the AVX-512 variants must not cost the GPU parts their
    extension: the automatic "all" is retried as generic; a caller's explicit choice is not."""
    ext, log = tmp_path / "_C.so", tmp_path / "build.txt"
    monkeypatch.delenv("VATTENTION_CPU_KERNELS", raising=False)
    monkeypatch.setattr(build.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(build, "up_to_date", lambda cuda: False)
    monkeypatch.setattr(build, "record", lambda cuda: None)
    monkeypatch.setattr(build, "extension_path", lambda: ext)
    calls = []

    def compile_(cuda, kernels, log_, mode):
        calls.append((kernels, mode))
        with open(log_, mode) as f:
            f.write(f"compiling {kernels}\n")
        if kernels == "all":
            return 1
        ext.write_text("built")
        return 0

    monkeypatch.setattr(build, "_compile", compile_)
    ok, line = build.build(log)
    assert ok and calls == [("all", "w"), ("generic", "a")], (calls, line)
    assert "CPU kernels: generic; the build with all CPU kernels failed (exit 1)" in line
    assert log.read_text() == "compiling all\ncompiling generic\n"
    calls.clear()
    ext.unlink()
    monkeypatch.setenv("VATTENTION_CPU_KERNELS", "all")
    ok, line = build.build(log)
    assert not ok and calls == [("all", "w")] and line.startswith("build failed (exit 1;"), line


def test_the_build_stamp_follows_every_source_the_build_reads(tmp_path, monkeypatch):
    for rel in ("setup.py", "pyproject.toml", "csrc/core/kv_cache.h", "csrc/cuda/cuda_backend.cpp"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    monkeypatch.setattr(build, "ROOT", tmp_path)
    before = build.fingerprint("/usr/local/cuda")
    assert build.fingerprint(None) != before  # with or without the CUDA backend
    header = tmp_path / "csrc/core/kv_cache.h"
    header.write_text(header.read_text() + "\n")
    assert build.fingerprint("/usr/local/cuda") != before


@needs_emulation
def test_the_memory_part_fails_at_the_stage_where_the_driver_disagrees(emu, monkeypatch):
    """The check can fail: a driver whose free memory reads one page lower from the step stage
    on (memory the cache does not account for) fails that stage and the ones after, by name."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "gpu"))
    import cudrv
    import memory_part

    real = cudrv.Driver.mem_info
    readings = []

    def a_page_unaccounted(self):
        free, total = real(self)
        readings.append(free)
        return (free - 2 * memory_part.TOLERANCE if len(readings) >= 3 else free), total

    monkeypatch.setattr(cudrv.Driver, "mem_info", a_page_unaccounted)
    rows = []
    try:
        with pytest.raises(SystemExit, match="disagree at: step, free, reclaim, budget refusal"):
            memory_part.memory(lambda **line: rows.append(line), emulated=True)
    finally:
        emu.set_current_context(0)
        emu.release_primary(0)  # the part's Driver retains it for its process's life
    stages = {r["stage"]: r["agree"] for r in rows if r["kind"] == "row"}
    assert stages == {
        "create": True,
        "step": False,
        "free": False,
        "reclaim": False,
        "budget refusal": False,
        "close": False,
    }


def _parts_module(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "gpu"))
    import parts

    return parts


def test_the_flash_attn_4_part_says_needs_a_gpu_on_the_emulation(monkeypatch):
    parts = _parts_module(monkeypatch)
    lines = []
    parts.flash_attn_4(lambda **line: lines.append(line), emulated=True)
    assert lines == [{"kind": "skip", "why": "needs a GPU"}]


def test_the_flash_attn_4_part_says_not_installed_without_fa4(monkeypatch, tmp_path):
    """Real mode without FA4 (this machine has none): skipped, saying why, measuring nothing."""
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is importable here")
    parts = _parts_module(monkeypatch)
    monkeypatch.setenv("GPU_CHECK_OUT", str(tmp_path))
    monkeypatch.delenv("GPU_CHECK_FA4_SITE", raising=False)
    lines = []
    parts.flash_attn_4(lambda **line: lines.append(line), emulated=False)
    assert len(lines) == 1 and lines[0]["kind"] == "skip", lines
    assert lines[0]["why"].startswith("flash-attn-4 not installed (ModuleNotFoundError: No module")


def test_a_part_that_skips_is_reported_skipped_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "gpu"))
    import check

    log = tmp_path / "flash-attn-4.jsonl"
    log.write_text(json.dumps({"kind": "skip", "why": "flash-attn-4 not installed (x)"}) + "\n")
    runner = check.Runner.__new__(check.Runner)
    runner.emulated, runner.logs = False, tmp_path
    res = check.Result("flash-attn-4", "t")
    runner._measured(res, 0)
    assert res.status == "passed"  # what _measured says; run() then reads the skip line:
    skips = [x["why"] for x in check.read_lines(log) if x["kind"] == "skip"]
    assert skips == ["flash-attn-4 not installed (x)"]


def _wheel(folder: Path, name: str, version: str, files: dict) -> Path:
    """A minimal wheel: the files plus its dist-info (METADATA, WHEEL, RECORD)."""
    import zipfile

    dist = f"{name}-{version}.dist-info"
    files = dict(files)
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    files[f"{dist}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    files[f"{dist}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def test_a_wheel_folder_is_installed_offline_into_a_private_target_whose_pth_files_count(
    tmp_path, monkeypatch
):
    """fa4_wheels.install: pip --no-deps --no-index --target, then site.addsitedir in the part's
    process reads the .pth file that puts a package's folder on the path (the cutlass-dsl meta
    wheel's way); the interpreter's own site-packages stay untouched; a second run keeps it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "gpu"))
    import fa4_wheels

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "inner_pkg", "1.0", {"inner_pkg/dsl/hidden_mod.py": "VALUE = 7\n"})
    _wheel(wheels, "meta_pkg", "1.0", {
        "meta_pkg_paths.pth": "import sys, os, inner_pkg; sys.path.insert(0, "
        "os.path.join(inner_pkg.__path__[0], 'dsl'))\n",
        "inner_pkg/__init__.py": "",
    })  # fmt: skip
    target = tmp_path / "site"
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_INDEX_URL="file:///nonexistent")
    monkeypatch.setattr(os, "environ", env)
    ok, line = fa4_wheels.install(wheels, target)
    assert ok and line.startswith("2 wheels from") and "installed into" in line, line
    assert line.endswith(f" (not the WHEEL_SET's {', '.join(fa4_wheels.WHEEL_SET)})"), line
    probe = (
        "import site, sys; site.addsitedir(sys.argv[1]); import hidden_mod; print(hidden_mod.VALUE)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(target)], capture_output=True, text=True
    )
    assert proc.stdout.strip() == "7", proc.stderr
    plain = subprocess.run([sys.executable, "-c", "import hidden_mod"], capture_output=True)
    assert plain.returncode != 0  # nothing went into the interpreter's own site-packages
    ok, line = fa4_wheels.install(wheels, target)
    assert ok and "already in" in line
    assert fa4_wheels.install(tmp_path / "none", target) == (
        False,
        f"GPU_CHECK_WHEELS={tmp_path / 'none'}: not a folder",
    )
    assert "flash_attn_4-4.0.0b36-py3-none-any.whl" in fa4_wheels.missing(wheels)


def test_a_part_with_a_limit_of_its_own_gets_no_more_and_says_so_when_cut(tmp_path, monkeypatch):
    """flash-attn-4's first run compiles FA4's kernels: its limit keeps the budget of the parts
    after it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "gpu"))
    import check

    fa4 = next(p for p in check.PARTS if p.name == "flash-attn-4")
    assert fa4.limit_s == check.FA4_LIMIT_S == 150.0
    runner = check.Runner(False, 480.0, tmp_path)
    limits = []

    def spawn(cmd, env, limit, name):  # stopped at its limit, having measured nothing
        limits.append(limit)
        return 0, True

    monkeypatch.setattr(runner, "_spawn", spawn)
    res = runner.run(check.Part("slow", "t", "t", limit_s=5.0))
    assert limits == [5.0]
    assert (res.status, res.why) == ("cut", "stopped at its own limit after 0 s")
    res = runner.run(check.Part("other", "t", "t"))
    assert limits[1] > 400 and res.why == "stopped at the budget's limit after 0 s"


def test_a_folder_larger_than_one_device_call_is_carried_in_parts_and_unpacked_whole(
    tmp_path, monkeypatch, capsys
):
    """carry.py: pack cuts a folder into parts of at most --max-mib, one folder per device call
    (replacing its own earlier parts, never a folder with other files); stage copies each to
    /tmp-like staging, says which are missing while some are (exit 3: a machine that went back
    lost them), unpacks the whole once the SHA-256 matches (0, and 0 again after), and refuses a
    damaged set or a folder with no part (2)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "gpu"))
    import carry

    src = tmp_path / "fa4-wheels"
    src.mkdir()
    files = {f"w{i}.whl": os.urandom(700_000 + i) for i in range(4)}  # ~2.7 MiB, incompressible
    for name, data in files.items():
        (src / name).write_bytes(data)
    out = tmp_path / "gpu-check" / "carry"
    assert carry.main(["pack", str(src), str(out), "--max-mib", "1"]) == 0
    parts = sorted(out.iterdir(), key=lambda p: int(p.name))
    assert [p.name for p in parts] == ["1", "2", "3"]
    for p in parts:
        assert sum(f.stat().st_size for f in p.glob("part-*")) <= 1 << 20
    assert f"run(carry=['{parts[0]}']" in capsys.readouterr().out

    stage, into = tmp_path / "stage", tmp_path / "into"
    args = ["--stage", str(stage), "--into", str(into)]
    assert carry.main(["stage", str(parts[0]), *args]) == 3
    assert "1 of 3 parts staged" in capsys.readouterr().out
    assert carry.main(["stage", str(parts[2]), *args]) == 3
    assert "missing part-002" in capsys.readouterr().out
    assert not into.exists()
    assert carry.main(["stage", str(parts[1]), *args]) == 0
    for name, data in files.items():
        assert (into / "fa4-wheels" / name).read_bytes() == data
    assert carry.main(["stage", str(parts[1]), *args]) == 0  # a repeated call unpacks nothing
    assert "already unpacked" in capsys.readouterr().out

    bad_stage, bad_into = tmp_path / "bad-stage", tmp_path / "bad-into"
    bad = ["--stage", str(bad_stage), "--into", str(bad_into)]
    for p in parts[:2]:
        assert carry.main(["stage", str(p), *bad]) == 3
    (bad_stage / "part-001").write_bytes(b"\0" + (bad_stage / "part-001").read_bytes()[1:])
    assert carry.main(["stage", str(parts[2]), *bad]) == 2
    assert "do not make the packed tar" in capsys.readouterr().err
    assert not (bad_into / "fa4-wheels").exists()
    assert carry.main(["stage", str(tmp_path / "not-carried"), *bad]) == 2
    assert "holds no part" in capsys.readouterr().err
    assert carry.main(["pack", str(src), str(out), "--max-mib", "2"]) == 0  # replaces its parts
    assert sorted(p.name for p in out.iterdir()) == ["1", "2"]
    with pytest.raises(SystemExit, match="holds files of its own"):
        carry.main(["pack", str(src), str(tmp_path), "--max-mib", "2"])
    assert (src / "w0.whl").exists()
