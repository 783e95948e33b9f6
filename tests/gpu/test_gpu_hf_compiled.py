"""transformers' compiled generate() over VAttentionCache(compileable=True) on a GPU (GPU only).

The CPU suite checks the compiled path with inductor and dynamo on the CPU
(tests/test_integrations_transformers.py); here the same check runs where transformers compiles
by default: the model and the cache on CUDA, 2 MB pages, transformers' default CompileConfig
(inductor, ``mode="reduce-overhead"``: CUDA graphs). A tiny Llama in fp32, three buckets: tokens
equal to DynamicCache's on the same GPU, no graph break, no cudagraph skip, two compiles, views
within the mapped pages. In a subprocess: a read past the mapped pages poisons the CUDA context.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_compiled_generate_with_cuda_graphs_matches_dynamic_cache(gpu):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    script = ROOT / "tests" / "support" / "hf_compiled_generate_check.py"
    proc = subprocess.run(
        [sys.executable, str(script), "gpu", "llama"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["tokens_equal"] and r["graph_breaks"] == 0 and r["cudagraph_skips"] == 0, r
    assert r["buckets"] == [16, 32, 48] and r["graphs"] == 2, r
    assert r["views_within_mapped"] and r["bytes_mapped"] == r["bytes_of_bucket_pages"], r
