"""Reading an unmapped region of the virtual cache on the GPU is an illegal address (GPU only).

This is the guarantee kernel developers rely on: a kernel that reads beyond a slot's mapped tokens
faults instead of reading another request's data. The fault poisons the CUDA context, so it runs in
a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent("""
    import torch, vattention
    cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=8, head_dim=128, max_batch_size=2,
                                   max_seq_len=8192, dtype=torch.float16, device="cuda:0")
    cache = vattention.KVCache(cfg)
    slot = cache.alloc()
    cache.step({slot: 1})
    k, _ = cache.layer(0)
    k[slot, 0].fill_(1.0)
    torch.cuda.synchronize()
    print("MAPPED_OK", float(k[slot, 0].sum()), flush=True)
    print(float(k[slot, 8191].sum()), flush=True)   # never mapped
    torch.cuda.synchronize()
    print("NO_FAULT", flush=True)
""")


def test_unmapped_read_is_illegal_address(gpu):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert "MAPPED_OK 1024.0" in out, out
    assert "NO_FAULT" not in out, out
    assert proc.returncode != 0
    assert "illegal memory access" in out or "illegal address" in out.lower(), out
