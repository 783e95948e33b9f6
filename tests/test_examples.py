"""Each example runs on CPU as a user would run it (a subprocess) and prints what it promises."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_quickstart():
    out = run_example("quickstart.py")
    # 1000 tokens at 32 tokens per 64 KB page: 32 page indices x 8 tensors x 64 KB = 16 MiB,
    # out of 8 slots x 8192 tokens x 2048 bytes x 8 tensors = 1 GiB of address space.
    assert "16777216 bytes mapped of 1073741824 reserved" in out


def test_hf_generate():
    pytest.importorskip("transformers")
    out = run_example(
        "hf_generate.py",
        "--new-tokens",
        "24",
        "--batch",
        "2",
        "--layers",
        "2",
        "--max-seq-len",
        "512",
    )
    rows = {
        line.split()[0]: [int(x.replace(",", "")) for x in line.split()[1:]]
        for line in out.splitlines()
        if line.split()[:1] in (["DynamicCache"], ["StaticCache"], ["VAttentionCache"])
    }
    # one token position = 2 layers x K,V x 2 rows x 2 heads x 16 dims x 4 bytes = 1024 bytes;
    # columns: bytes held, peak bytes, allocated+copied per step, written per step
    assert rows["StaticCache"] == [512 * 1024, 512 * 1024, 0, 1024]
    assert rows["VAttentionCache"] == [65536, 65536, 0, 1024]  # 55 tokens: 2 pages/tensor
    held, peak, copied, written = rows["DynamicCache"]
    assert held == 55 * 1024
    assert peak == held + 54 * 512  # + one layer's old K and V alive during cat
    assert copied == written == 45056  # the whole cache re-copied: 44 tokens average
    assert "tokens identical across caches: True" in out


def test_serving_loop_preempts_and_completes_everything():
    out = run_example("serving_loop.py", "--requests", "24")
    assert "completed 24/24" in out
    assert "preemptions 0," not in out
    assert "all requests completed, K rows intact: True" in out
    # Every OutOfPagesError preempted a request; deferred admissions raise none.
    preemptions = int(re.search(r"preemptions (\d+),", out).group(1))
    errors = re.search(r"OutOfPagesError (\d+) times \(each one preempted a request\)", out)
    assert errors is not None and int(errors.group(1)) == preemptions, out
    deferred = re.search(r"admissions deferred by capacity\(\) (\d+) times", out)
    assert deferred is not None and int(deferred.group(1)) > 0, out


def test_kernel_dev_reading_past_seqlens_faults():
    out = run_example("kernel_dev.py")
    assert "max abs error" in out
    assert "child process ended by SIG" in out and "faulted" in out


def test_readme_quickstart_is_the_example():
    """README's quickstart and examples/quickstart.py must not drift apart."""
    import re

    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"## Quickstart\n\n```python\n(.*?)```", readme, re.S).group(1)
    assert snippet in (ROOT / "examples" / "quickstart.py").read_text()
