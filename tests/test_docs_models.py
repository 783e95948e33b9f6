"""docs/models.md is code: every Python block runs verbatim on CPU and prints what it claims.

Blocks marked `<!-- gpu -->` are skipped here. The lines printed must be exactly the claims in the
block's comments (`print(...)  # claim`, or a `# prints: claim` line), in order.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"
BLOCK = re.compile(r"(<!-- gpu -->\n)?```python\n(.*?)```", re.S)


def blocks():
    return [code for gpu, code in BLOCK.findall(DOC.read_text()) if not gpu]


@pytest.mark.parametrize("index", range(len(blocks())))
def test_block_runs_and_prints_what_it_claims(index):
    code = blocks()[index]
    if "transformers" in code:
        pytest.importorskip("transformers")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{DOC.name}[{index}]", "exec"), {})
    claims = [
        c.strip() for c in re.findall(r"^[ \t]*(?:print\(.*\)[ \t]*#|# prints:)(.*)$", code, re.M)
    ]
    assert claims and out.getvalue().splitlines() == claims
