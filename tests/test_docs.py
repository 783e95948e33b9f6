"""Every Python block of README.md and docs/*.md runs verbatim.

Blocks are discovered, not listed: a new page or block is covered without touching this file. The
blocks of one page run in order, in one namespace (a page reads like one session), in a fresh
interpreter (a doc block that touches unmapped memory must not take the test run down with it).
A block with the line ``<!-- gpu -->`` right above its opening fence needs a real GPU and is run
only where there is one. A block with ``<!-- vllm -->`` above it needs vLLM and runs in the vLLM
venv instead (tests/test_integrations_vllm.py). Signatures and pseudocode are not Python blocks
(use ``text``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.cuda_setup import have_gpu

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
GPU_MARK = "<!-- gpu -->"
VLLM_MARK = "<!-- vllm -->"  # run by tests/test_integrations_vllm.py, in the vLLM venv
FENCE = re.compile(r"^```python\s*$")


def python_blocks(text: str):
    """[(first line number, code, needs_gpu)] of the ```python blocks of a Markdown page.

    Blocks marked ``<!-- vllm -->`` are left out: they need the vLLM venv.
    """
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            start = i + 1
            end = start
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            mark = lines[i - 1].strip() if i > 0 else ""
            if mark != VLLM_MARK:
                blocks.append((start + 1, "\n".join(lines[start:end]) + "\n", mark == GPU_MARK))
            i = end
        i += 1
    return blocks


def test_block_discovery_finds_blocks_and_gpu_marks():
    page = (
        "x\n```python\na = 1\n```\n<!-- gpu -->\n```python\nb = 2\n```\n```bash\nls\n```\n"
        "<!-- vllm -->\n```python\nc = 3\n```\n"
    )
    assert python_blocks(page) == [(3, "a = 1\n", False), (7, "b = 2\n", True)]


def _script(page: Path, blocks) -> str:
    """One script: each block compiled under its own name (page:line) so a traceback says which."""
    parts = ["import os, sys", "os.chdir(sys.argv[1])", "__ns = {'__name__': '__main__'}"]
    for line, code, _ in blocks:
        name = f"{page.relative_to(ROOT)}:{line}"
        parts.append(f"exec(compile({code!r}, {name!r}, 'exec'), __ns)")
    return "\n".join(parts) + "\n"


PAGE_IDS = [str(p.relative_to(ROOT)) for p in PAGES]


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_python_blocks_of_page_run(page, tmp_path):
    gpu = have_gpu()
    blocks = [b for b in python_blocks(page.read_text()) if gpu or not b[2]]
    if not blocks:
        pytest.skip(f"{page.name}: no Python block to run here")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", _script(page, blocks), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, (
        f"a Python block of {page.name} failed "
        f"(rc={proc.returncode}):\n{proc.stdout[-2000:]}\n"
        f"{proc.stderr[-4000:]}"
    )
