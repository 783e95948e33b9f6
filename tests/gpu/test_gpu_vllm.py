"""The vLLM plugin on a real GPU (GPU kit): greedy tokens equal stock vLLM's, with FlashAttention.

Needs a GPU, vLLM 0.32.0 (GPU build) and flash-attn in the running Python; skips otherwise. Each
engine runs in a process of its own (the plugin is switched on per process), as in
tests/test_integrations_vllm.py, here with ``device=cuda`` and ``enforce_eager``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def _run(spec_file, out_file, plugin: bool, stats_file) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VATTENTION_VLLM")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if plugin:
        env.update(VATTENTION_VLLM="1", VATTENTION_VLLM_STATS=str(stats_file))
    proc = subprocess.run([sys.executable, "-m", "vattention.bench.vllm_run", str(spec_file),
                           str(out_file)], env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out_file.read_text())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_plugin_tokens_equal_stock_vllm_on_gpu(gpu, tmp_path, dtype):
    pytest.importorskip("vllm")
    pytest.importorskip("flash_attn")
    from vattention.bench.tiny_models import build_tiny_model

    model = build_tiny_model(str(tmp_path / "llama"), "llama", num_layers=4, hidden_size=1024,
                             num_heads=8, num_kv_heads=8, head_dim=128)
    requests = [{"prompt_token_ids": list(range(3, 3 + n)),
                 "sampling": {"temperature": 0.0, "max_tokens": m, "ignore_eos": True}}
                for n, m in [(5, 40), (1023, 10), (1024, 3), (2100, 30), (17, 64)]]
    spec = {"model": model, "requests": requests,
            "engine": {"dtype": dtype, "max_model_len": 4096, "max_num_seqs": 4,
                       "enable_prefix_caching": False, "enforce_eager": True,
                       "gpu_memory_utilization": 0.3}}
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    stock = _run(spec_file, tmp_path / "stock.json", False, None)
    plugin = _run(spec_file, tmp_path / "plugin.json", True, tmp_path / "stats.json")
    assert plugin["tokens"] == stock["tokens"]
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["active_slots"] == 0 and stats["vllm_kv_buffer_bytes"] == 0
    assert stats["page_bytes"] % (2 << 20) == 0      # CUDA granularity: the block was raised
