"""The vLLM plugin on a real GPU (GPU only): greedy tokens equal stock vLLM's, at vLLM's defaults.

Needs a GPU, vLLM 0.32.x or 0.33.x (GPU build) and flash-attn in the running Python; skips
otherwise. Each engine runs in a process of its own (the plugin is switched on per process), as in
tests/test_integrations_vllm.py, here on CUDA with vLLM's GPU defaults: prefix caching on, the
compiled model with CUDA graphs (the plugin downgrades FULL graphs to PIECEWISE), the V2 runner
default (the plugin selects V1), and the block size the plugin aligns to 2 MB pages. Only sizes are
given. Written against vLLM's sources; never run here (no GPU): see docs/vllm.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _run(spec_file, out_file, plugin: bool, stats_file) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VATTENTION_VLLM") and k != "VLLM_USE_V2_MODEL_RUNNER"
    }
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if plugin:
        env.update(VATTENTION_VLLM="1", VATTENTION_VLLM_STATS=str(stats_file))
    proc = subprocess.run(
        [sys.executable, "-m", "vattention.bench.vllm_run", str(spec_file), str(out_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out_file.read_text())


def _prompt(n: int, seed: int) -> list:
    return [3 + (seed * 7919 + 31 * i) % 500 for i in range(n)]


def _requests(case: str) -> list:
    if case == "shared-prefix":  # 24 requests behind one 1500-token system prompt
        system = _prompt(1500, 99)
        return [
            {
                "prompt_token_ids": system + _prompt(20 + 9 * i, i),
                "sampling": dict(GREEDY, max_tokens=24),
            }
            for i in range(24)
        ]
    return [
        {"prompt_token_ids": _prompt(n, i), "sampling": dict(GREEDY, max_tokens=m)}
        for i, (n, m) in enumerate([(5, 40), (1023, 10), (1024, 3), (2100, 30), (17, 300)])
    ]


CASES = [
    ("llama", "bfloat16", {}),
    ("llama", "float16", {}),
    ("llama", "bfloat16", {"kv_cache_dtype": "fp8"}),
    ("mistral-window", "bfloat16", {}),
    ("gemma3", "bfloat16", {}),
]


@pytest.mark.parametrize(
    "family,dtype,extra",
    CASES,
    ids=["llama-bf16", "llama-fp16", "llama-fp8", "mistral-window", "gemma3"],
)
@pytest.mark.parametrize("case", ["mixed", "shared-prefix"])
def test_plugin_tokens_equal_stock_vllm_on_gpu(gpu, tmp_path, family, dtype, extra, case):
    pytest.importorskip("vllm")
    pytest.importorskip("flash_attn")
    from vattention.bench.tiny_models import build_tiny_model

    model = build_tiny_model(
        str(tmp_path / family),
        family,
        num_layers=4,
        hidden_size=1024,
        num_heads=8,
        num_kv_heads=8,
        head_dim=128,
        window=256,
    )
    spec = {
        "model": model,
        "requests": _requests(case),
        "engine": {
            "dtype": dtype,
            "max_model_len": 4096,
            "max_num_seqs": 8,
            "gpu_memory_utilization": 0.3,
            **extra,
        },
    }
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    stock = _run(spec_file, tmp_path / "stock.json", False, None)
    plugin = _run(spec_file, tmp_path / "plugin.json", True, tmp_path / "stats.json")
    assert plugin["tokens"] == stock["tokens"]
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["active_slots"] == 0 and stats["vllm_kv_buffer_bytes"] == 0
    assert stats["page_bytes"] % (2 << 20) == 0  # CUDA granularity: the block was raised
    assert stats["oom_events"] == 0
    if case == "shared-prefix":
        assert stats["block_hits"] > 0
