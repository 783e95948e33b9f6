"""vattention.backends: what tooling and integrations may ask about the backends, with the
answers the caches themselves go by."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import vattention
from vattention import backends


def test_the_host_backend_runs_here_and_maps_pages_of_its_granularity():
    assert backends.unavailable_reason("host") is None
    gran = backends.granularity("cpu")
    assert gran >= 4096 and gran & (gran - 1) == 0
    cfg = vattention.KVCacheConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=64,
        max_batch_size=1,
        max_seq_len=256,
        dtype=torch.float32,
        page_size=gran,
    )
    with vattention.KVCache(cfg) as cache:
        cache.step({cache.alloc(): 1})
        assert cache.stats()["bytes_mapped"] == 2 * gran  # one page of K, one of V


def test_an_unavailable_backend_says_why_and_refuses_its_granularity(tmp_path):
    # A fresh interpreter whose CUDA driver library is missing (this session's may be the
    # emulation, which runs).
    code = (
        "import vattention; from vattention import backends\n"
        "reason = backends.unavailable_reason('cuda')\n"
        "assert isinstance(reason, str) and 'libcuda' in reason, reason\n"
        "try:\n"
        "    backends.granularity('cuda:0')\n"
        "except vattention.BackendUnavailableError as e:\n"
        "    print('refused:', e)\n"
    )
    env = dict(os.environ, VATTENTION_LIBCUDA=str(tmp_path / "libcuda.so.1"))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0 and "refused: CUDA backend unavailable" in proc.stdout, (
        proc.stdout + proc.stderr
    )


def test_bad_kinds_and_devices_are_refused():
    with pytest.raises(ValueError, match="kind='gpu' must be one of"):
        backends.unavailable_reason("gpu")
    with pytest.raises(vattention.ConfigError, match="device=tpu"):
        backends.granularity("tpu")


def test_host_limits_are_sizes_a_block_size_can_use():
    assert backends.host_mapping_limit() > 0
    assert backends.host_huge_unit() in (0, 2 << 20)
