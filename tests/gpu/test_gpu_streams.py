"""A kernel in flight on a non-default stream while its slot is freed: the pages outlive it (GPU
only; the emulated analogue is tests/test_cuda_inflight.py).

A side stream (torch's streams are non-blocking: no implicit order with the legacy stream) runs a
long kernel, then a reduction reading the slot's rows; the slot is freed behind it, on that
stream, and its pages are taken at once (reclaim(), or a second slot's step() under a budget
with room for one slot). cuMemUnmap is not stream-ordered: taken too early, the reduction reads
unmapped memory (an illegal address, which poisons the context: each case runs in a process of
its own). The free names its stream either explicitly (``free(slot, stream=side)``) or as the
current torch stream (``with torch.cuda.stream(side): free(slot)``), which the cache must take as
its default stream.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch, vattention
    name, take = sys.argv[1], sys.argv[2]
    tokens = 8192  # 8 KV heads x 128 bf16: 2 KB a token, 1024 a 2 MB page: 8 pages a row
    cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=8, head_dim=128, max_batch_size=2,
                                   max_seq_len=tokens, dtype=torch.bfloat16, device="cuda:0",
                                   page_size="2MB")
    budget = cfg.pages_for_tokens(tokens) * cfg.page_bytes if take == "budget" else None
    # ~300 ms of GPU: torch.cuda._sleep spins for a number of clock cycles, calibrated here.
    probe = 50_000_000
    torch.cuda._sleep(probe)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(); torch.cuda._sleep(probe); end.record(); end.synchronize()
    cycles = int(probe / start.elapsed_time(end) * 300)
    with vattention.KVCache(cfg, memory_budget=budget) as cache:
        a, b = cache.alloc(), cache.alloc()  # b first: alloc() would hand over a's row
        cache.step({a: tokens})
        k, v = cache.layer(0)
        k[a].normal_(); v[a].normal_()
        want = k[a].float().sum() + v[a].float().sum()
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)                      # the GPU is busy, then ...
            got = k[a].float().sum() + v[a].float().sum()  # ... reads a's rows
            if name == "current":
                cache.free(a)
        if name == "explicit":
            cache.free(a, stream=side)
        t0 = time.perf_counter()
        if take == "reclaim":
            cache.reclaim()
        else:
            cache.step({b: tokens})  # under the budget: takes a's pages
        waited = time.perf_counter() - t0
        side.synchronize()  # an unmap under the reduction faults here
        torch.cuda.synchronize()
        print(json.dumps({"intact": bool(torch.equal(got, want)),
                          "waited_ms": round(waited * 1e3, 1),
                          "fence_waits": cache.stats()["fence_waits"]}))
""")


@pytest.mark.parametrize("take", ["reclaim", "budget"])
@pytest.mark.parametrize("name", ["explicit", "current"])
def test_a_kernel_on_a_side_stream_outlives_its_slots_free(gpu, name, take, record_property):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, name, take], capture_output=True, text=True, timeout=180
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key, value in result.items():
        record_property(key, value)
    assert result["intact"], result
    assert result["fence_waits"] == 1, result  # the take waited for the free's event
    assert result["waited_ms"] > 50, result  # ... for the kernel (~300 ms of it left)
