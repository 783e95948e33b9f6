"""The plugin's elastic block pool (vattention/integrations/vllm/elastic.py) on vLLM's real
``BlockPool``, in the vLLM venv: tests/support/vllm_elastic_check.py runs every case once and
reports each; a test per case here.

(The pool in an engine, end to end, is in tests/test_integrations_vllm.py: the elastic workload
and ``bench elastic``.)
"""

from __future__ import annotations

import ast
import json
import subprocess

import pytest

from support.vllm_harness import MISSING, ROOT, VLLM_PYTHON

CHECK = ROOT / "tests" / "support" / "vllm_elastic_check.py"
CASES = sorted(
    node.name[len("case_") :]
    for node in ast.parse(CHECK.read_text()).body
    if isinstance(node, ast.FunctionDef) and node.name.startswith("case_")
)


@pytest.fixture(scope="module")
def results():
    assert VLLM_PYTHON.exists(), MISSING
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(CHECK)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_case_ran(results):
    assert sorted(results) == CASES and len(CASES) >= 8


@pytest.mark.parametrize("case", CASES)
def test_elastic_block_pool(results, case):
    assert results[case] == "ok", results[case]
