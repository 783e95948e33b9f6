"""A kernel call that would read a cache row past its mapped pages raises UnmappedReadError before
it runs, on the host backend and on the CUDA backend (through the driver emulation, whose device
memory the tests read through host_alias), instead of killing the process (SIGSEGV on the host, an
illegal address that poisons the CUDA context on a GPU)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import vattention
from vattention.cache_reads import cache_rows
from vattention.integrations import flash_attn as fa

from support.helpers import kv_views

ROOT = Path(__file__).resolve().parent.parent
_SMALL = vattention.KVCacheConfig(
    num_layers=1, num_kv_heads=1, head_dim=64, max_batch_size=2, max_seq_len=512,
    dtype=torch.float32, page_size="4KB",
)  # fmt: skip


@pytest.fixture
def page_size():
    return "64KB"  # 256 tokens a page at 2 KV heads x 64 in fp16


@pytest.fixture
def layout():
    return "layer"


def _stepped(make_cache, tokens=256, **kw):
    """A cache whose slot 1 is stepped to `tokens` (slot 0 allocated, empty); layer 0's views."""
    cache = make_cache(max_batch_size=4, max_seq_len=4096, **kw)
    cache.alloc()
    slot = cache.alloc()
    cache.step({slot: tokens})
    k_cache, v_cache = kv_views(cache, 0)
    return cache, slot, k_cache, v_cache


def _decode_args(n=1, heads=4, device="cpu"):
    """Queries and new keys/values on the cache's ``device`` (a GPU kernel takes no CPU input)."""
    q = torch.randn(n, 1, heads, 64, dtype=torch.float16)
    k = torch.randn(n, 1, 2, 64, dtype=torch.float16)
    v = torch.randn(n, 1, 2, 64, dtype=torch.float16)
    return q.to(device), k.to(device), v.to(device)


CHILD = """
import sys, torch, vattention
sys.path.insert(0, {tests!r})
from support.cuda_setup import CUDA_MODE
from support.helpers import kv_views
from vattention.integrations.flash_attn import flash_attn_with_kvcache
if {device!r} != "cpu" and CUDA_MODE != "emulated":
    print("no emulation"); raise SystemExit(0)
cfg = vattention.KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, max_batch_size=4,
                               max_seq_len=4096, dtype=torch.float16, page_size="64KB",
                               device={device!r})
cache = vattention.KVCache(cfg)
cache.alloc()
slot = cache.alloc()
cache.step({{slot: 256}})
k_cache, v_cache = kv_views(cache, 1)
q = torch.randn(1, 1, 4, 64, dtype=torch.float16)
try:
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([900]),
                            cache_batch_idx=torch.tensor([slot]), causal=True)
except vattention.UnmappedReadError as e:
    print("raised", type(e).__name__, e.request, e.slot, e.length, e.mapped_tokens)
    print(e)
"""


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_the_issues_call_raises_and_the_process_lives(device):
    """cache_seqlens=900 over a row stepped to 256 tokens: this once died of SIGSEGV (after the
    fault report's diagnostic); run in a child so that it would fail here, not kill the suite."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYTHONFAULTHANDLER", None)
    code = textwrap.dedent(CHILD.format(tests=str(ROOT / "tests"), device=device))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    if proc.stdout.startswith("no emulation"):
        pytest.skip("the CUDA driver emulation is not available here")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "raised UnmappedReadError 0 1 900 256"
    assert lines[1] == (
        "request 0 reads 900 tokens of cache row 1, past the 256 tokens mapped for it "
        "(mapped_tokens(1) = 256): the kernel would touch unmapped memory; call "
        "KVCache.step({1: 900}) first, or pass the lengths step() was given"
    )


def test_decode_past_the_mapped_tokens_raises_and_writes_nothing(make_cache):
    cache, slot, k_cache, v_cache = _stepped(make_cache)
    before = k_cache[slot, :256].clone(), v_cache[slot, :256].clone()
    q, k, v = _decode_args(2, device=k_cache.device)
    # Row 0 holds no page at all; row `slot` holds 256 tokens, so appending at 256 reads 257.
    with pytest.raises(vattention.UnmappedReadError) as info:
        fa.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([10, 256]),
            cache_batch_idx=torch.tensor([slot, 0]), causal=True,
        )  # fmt: skip
    e = info.value
    assert (e.request, e.slot, e.length, e.mapped_tokens) == (1, 0, 257, 0)
    assert isinstance(e, ValueError)
    assert torch.equal(k_cache[slot, :256], before[0]) and torch.equal(
        v_cache[slot, :256], before[1]
    )
    # Within the mapped tokens the same call runs, and appends where it says.
    fa.flash_attn_with_kvcache(
        q[:1], k_cache, v_cache, k[:1], v[:1], cache_seqlens=torch.tensor([255]),
        cache_batch_idx=torch.tensor([slot]), causal=True,
    )  # fmt: skip
    assert torch.equal(k_cache[slot, 255].cpu(), k[0, 0].cpu())


@pytest.mark.parametrize("form", ["decode", "prefill", "reference", "varlen", "int-lengths"])
def test_every_flash_signature_entry_point_checks(make_cache, form):
    cache, slot, k_cache, v_cache = _stepped(make_cache, tokens=300)  # 512 tokens mapped
    q, k, v = _decode_args(device=k_cache.device)
    with pytest.raises(vattention.UnmappedReadError, match=r"past the 512 tokens mapped") as info:
        if form == "decode":
            fa.decode(q, k_cache, v_cache, k, v, torch.tensor([512]), torch.tensor([slot]))
        elif form == "prefill":
            fa.prefill(q[0], k[0], v[0], k_cache, v_cache, slot, start=512)
        elif form == "reference":
            fa.flash_attn_with_kvcache_reference(
                q, k_cache, v_cache, cache_seqlens=[513], cache_batch_idx=torch.tensor([slot])
            )
        elif form == "varlen":
            fa.flash_attn_with_kvcache(
                torch.randn(3, 4, 64, dtype=torch.float16), k_cache, v_cache,
                torch.randn(3, 2, 64, dtype=torch.float16),
                torch.randn(3, 2, 64, dtype=torch.float16),
                cache_seqlens=torch.tensor([510]), cache_batch_idx=torch.tensor([slot]),
                cu_seqlens_q=torch.tensor([0, 3]), causal=True,
            )  # fmt: skip
        else:
            # no cache_batch_idx: request i reads row i of the tensor, here a view from `slot`
            fa.flash_attn_with_kvcache(q, k_cache[slot:], v_cache[slot:], cache_seqlens=513)
    assert info.value.slot == slot and info.value.length in (513, 512)
    # The same calls within the mapped tokens run.
    fa.decode(q, k_cache, v_cache, k, v, torch.tensor([511]), torch.tensor([slot]))
    fa.prefill(q[0], k[0], v[0], k_cache, v_cache, slot, start=300)
    fa.flash_attn_with_kvcache_reference(
        q, k_cache, v_cache, cache_seqlens=[512], cache_batch_idx=torch.tensor([slot])
    )


def test_a_view_into_the_rows_counts_its_offsets(make_cache):
    cache, slot, k_cache, v_cache = _stepped(make_cache)  # 256 tokens mapped
    rows = cache_rows(k_cache[slot:, 100:])
    assert (rows.first_slot, rows.first_token) == (slot, 100)
    rows.check([0], ends=[156])  # tokens [100, 256) of the slot
    with pytest.raises(vattention.UnmappedReadError) as info:
        rows.check([0], ends=[157])
    assert (info.value.slot, info.value.length, info.value.mapped_tokens) == (slot, 257, 256)
    with pytest.raises(vattention.UnmappedReadError):
        fa.flash_attn_with_kvcache(
            torch.randn(1, 1, 4, 64, dtype=torch.float16), k_cache[slot:, 100:],
            v_cache[slot:, 100:], cache_seqlens=157,
        )  # fmt: skip
    # A view with other strides is not followed (None): it is not a cache's rows.
    assert cache_rows(k_cache.transpose(0, 1)) is None
    assert cache_rows(torch.zeros(4, 4096, 2, 64)) is None


def test_mega_layer_views_are_followed(make_cache):
    cache = make_cache(max_batch_size=4, max_seq_len=4096, layout="mega")
    slot = cache.alloc()
    cache.step({slot: 40})
    k_cache, v_cache = kv_views(cache, 1)
    mapped = cache.mapped_tokens(slot)
    rows = cache_rows(k_cache)
    assert (rows.first_slot, rows.first_token) == (0, 0)
    rows.check([slot], ends=[mapped])
    with pytest.raises(vattention.UnmappedReadError):
        fa.flash_attn_with_kvcache(
            torch.randn(1, 1, 4, 64, dtype=torch.float16), k_cache, v_cache,
            cache_seqlens=[mapped + 1], cache_batch_idx=torch.tensor([slot]),
        )  # fmt: skip


@pytest.mark.parametrize("layout_", ["layer", "mega"])
def test_a_released_window_start_is_checked_with_the_window(make_cache, layout_):
    # mega: one window for every layer, released in its one K and V tensor (once left unchecked)
    cache = make_cache(max_batch_size=2, max_seq_len=4096, sliding_window=300, layout=layout_)
    slot = cache.alloc()
    for n in range(1, 1001, 50):
        cache.step({slot: n})
    cache.step({slot: 1000})
    start = cache.window_start(slot, 0)
    assert start > 0
    k_cache, v_cache = kv_views(cache, 0)
    q = torch.randn(1, 1, 4, 64, dtype=torch.float16)
    lens, rows = torch.tensor([1000]), torch.tensor([slot])
    # The window's own keys: [700, 1000) at most, all backed.
    fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, cache_batch_idx=rows, window_size=(299, 0)
    )
    with pytest.raises(vattention.UnmappedReadError, match=r"released the tokens below") as info:
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, cache_batch_idx=rows)
    assert info.value.window_start == start and info.value.slot == slot


def test_a_closed_cache_refuses_the_read(make_cache):
    cache, slot, k_cache, v_cache = _stepped(make_cache)
    cache.close()
    with pytest.raises(vattention.CacheClosedError):
        fa.flash_attn_with_kvcache(
            torch.randn(1, 1, 4, 64, dtype=torch.float16), k_cache, v_cache,
            cache_seqlens=[10], cache_batch_idx=torch.tensor([slot]),
        )  # fmt: skip


def test_a_collected_cache_is_dropped_when_the_next_one_registers():
    """Weakly held: a collected core's ranges find nothing, and the next registration drops them."""
    from vattention import cache_reads

    cache = vattention.KVCache(_SMALL)
    assert cache_rows(cache.layer(0)[0]) is not None
    cache.close()
    del cache
    gc.collect()
    with vattention.KVCache(_SMALL):
        assert all(region.core() is not None for region in cache_reads._table[1])


def test_a_core_dying_during_a_registration_does_not_wait_on_it():
    """A core can die inside another cache's registration, with the registry's lock held (a
    garbage collection that runs there frees a cache caught in a reference cycle). The registry
    once dropped a dead core's ranges from a weakref callback that took that lock, and the test
    process hung. Here the lock is held and a core dies; in a child, so a hang fails by timeout."""
    code = textwrap.dedent(
        """
        import torch, vattention
        from vattention import cache_reads
        cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64,
                                       max_batch_size=2, max_seq_len=512, dtype=torch.float32,
                                       page_size="4KB")
        cache = vattention.KVCache(cfg)
        with cache_reads._lock:  # as inside a registration
            del cache  # the core dies here
        print("done")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr[-2000:]
