"""The vLLM plugin's parts that need no vLLM: geometry, version check, switch, stats file.

(The plugin itself runs end to end in tests/test_integrations_vllm.py, in the vLLM venv.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from hypothesis import given, strategies as st

import vattention
from vattention.integrations.vllm import geometry, plugin
from vattention.integrations.vllm.stats_writer import StatsWriter, stats_path


@given(block=st.integers(1, 1024), heads=st.integers(1, 16), dim=st.sampled_from([16, 32, 64, 80,
       96, 128, 256]), elem=st.sampled_from([1, 2, 4]), layers=st.integers(1, 64),
       layout=st.sampled_from(geometry.LAYOUTS), gran=st.sampled_from([4096, 65536, 2 << 20]))
def test_aligned_block_is_the_smallest_page_aligned_multiple(block, heads, dim, elem, layers,
                                                             layout, gran):
    token = geometry.tensor_token_bytes(layout, layers, heads, dim, elem)
    aligned = geometry.aligned_block_size(block, token, gran)
    assert aligned % block == 0 and (aligned * token) % gran == 0
    assert all((m * token) % gran for m in range(block, aligned, block))


@pytest.mark.parametrize("layout, tensors", [("mega", 2), ("layer", 6)])
def test_pages_a_request_holds_are_the_blocks_vllm_charged(layout, tensors):
    """One page per tensor per block, so a cache with vLLM's budget fits what vLLM admits."""
    g = geometry.KVGeometry(num_layers=3, num_kv_heads=2, head_dim=32, element_bytes=4,
                            block_size=128, num_blocks=10, layout=layout)
    assert g.pages_per_block == tensors
    vllm_block_bytes = 2 * 3 * 128 * 2 * 32 * 4            # K,V x layers x tokens x H x D x fp32
    assert g.memory_budget == 10 * vllm_block_bytes
    cfg = vattention.KVCacheConfig(num_layers=3, num_kv_heads=2, head_dim=32, max_batch_size=4,
                                   max_seq_len=1000, dtype="float32", page_size=g.page_bytes,
                                   layout=layout)
    assert cfg.tokens_per_page == g.block_size
    with vattention.KVCache(cfg, memory_budget=g.memory_budget) as cache:
        slots = [cache.alloc() for _ in range(3)]
        cache.step({slots[0]: 129, slots[1]: 256, slots[2]: 640})   # 2 + 2 + 5 = 9 blocks
        assert cache.stats()["pages_mapped"] == 9 * g.pages_per_block
        cache.step({slots[0]: 257})                                  # the 10th block
        with pytest.raises(vattention.OutOfPagesError):              # an 11th: vLLM never asks
            cache.step({slots[1]: 257})


def test_untested_version_is_refused_unless_overridden(monkeypatch):
    monkeypatch.delenv(vattention.integrations.vllm.ENV_ALLOW_UNTESTED, raising=False)
    plugin.check_version("0.32.0+cpu")
    with pytest.raises(vattention.ConfigError, match=r"tested with vLLM 0\.32\.0, not 0\.31\.2"):
        plugin.check_version("0.31.2")
    monkeypatch.setenv("VATTENTION_VLLM_ALLOW_UNTESTED", "1")
    plugin.check_version("0.31.2")


def test_layout_env_is_checked(monkeypatch):
    monkeypatch.setenv("VATTENTION_VLLM_LAYOUT", "paged")
    with pytest.raises(vattention.ConfigError, match="VATTENTION_VLLM_LAYOUT='paged'"):
        plugin.layout_from_env()
    monkeypatch.delenv("VATTENTION_VLLM_LAYOUT")
    assert plugin.layout_from_env() == "mega"


def test_register_is_a_no_op_without_the_switch():
    """Installing vattention changes nothing: without VATTENTION_VLLM=1, vLLM is not imported."""
    code = ("import sys, vattention.integrations.vllm as p; p.register(); "
            "print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))")
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert out.stdout.strip() == "False"


def test_stats_writer_writes_periodically_and_a_final_document(tmp_path):
    path = tmp_path / "kv.json"
    ticks = []

    def snapshot():
        ticks.append(1)
        return {"ticks": len(ticks)}

    writer = StatsWriter(str(path), snapshot, interval_s=0.05)
    assert json.loads(path.read_text())["ticks"] == 1        # written at start
    deadline = time.monotonic() + 10
    while json.loads(path.read_text())["ticks"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    writer.close({"final": True})
    assert json.loads(path.read_text()) == {"final": True}
    assert [p.name for p in tmp_path.iterdir()] == ["kv.json"]   # no temporary left behind
    assert stats_path(str(path), 3, 4).endswith("kv.json.rank3")
