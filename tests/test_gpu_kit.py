"""benchmarks/gpu/run_all.py, the GPU kit: its logic dry-run through the CUDA driver EMULATION.

On a machine without a GPU the kit prints one line saying why and exits 2; with --dry-run it runs
the GPU tests (which skip under the emulation), the prefetch, driver-call and mapping benchmarks,
and writes one report (markdown + PNG). The numbers of a dry run mean nothing about a GPU.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from support.cuda_testing import needs_emulation

ROOT = pathlib.Path(__file__).resolve().parents[1]
KIT = ROOT / "benchmarks" / "gpu" / "run_all.py"


def run_kit(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("VATTENTION_LIBCUDA", None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, str(KIT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_without_a_gpu_one_line_and_exit_2():
    proc = run_kit("--quick", env_extra={"VATTENTION_LIBCUDA": "/nonexistent/libcuda.so.1"})
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert lines[0].startswith("run_all.py: no GPU to run on (")
    assert "/nonexistent/libcuda.so.1" in lines[0]
    assert "--dry-run" in lines[0]


def test_unknown_part_is_refused_by_name():
    proc = run_kit("--only", "tests,warp", env_extra={"VATTENTION_LIBCUDA": "/nonexistent/x.so"})
    assert proc.returncode == 2 and "unknown part(s) ['warp']" in proc.stderr


@needs_emulation
def test_dry_run_writes_one_report(tmp_path):
    proc = run_kit(
        "--dry-run",
        "--quick",
        "--only",
        "tests,prefetch,vmm,attention,mapping",
        "--out-dir",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = (tmp_path / "results.md").read_text()
    assert "DRY RUN through the CUDA driver EMULATION" in md
    for section in (
        "## GPU tests (pytest -m gpu tests/gpu)",
        "## step() blocking with prefetch",
        "## Per-call driver latency",
        "## FlashAttention latency",
        "## Mapping throughput of cache.step()",
    ):
        assert section in md
    # Every GPU test is listed (and skipped, by design, under the emulation).
    for test in (
        "test_captured_decode_replays_over_pages_mapped_after_capture",
        "test_compiled_decode_with_cuda_graphs_equals_eager",
        "test_unmapped_read_is_illegal_address",
        "test_sdpa_over_virtual_slice_equals_contiguous",
    ):
        assert f"{test} | skipped |" in md
    assert "| layer | 2MB | 1024 |" in md and "| mega | 2MB | 32 |" in md
    assert "**Overall: all parts ran, no test failed.**" in md
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
