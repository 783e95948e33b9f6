"""The virtual tensors are genuinely sparse: memory follows mapped pages, not max_seq_len."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import vattention


def rss_shmem_bytes() -> int:
    """Resident shared-memory bytes of this process (memfd pages count here once mapped)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssShmem in /proc/self/status")


@pytest.mark.parametrize("layout", ["layer", "mega"])
@pytest.mark.parametrize("page_size", ["64KB", "2MB"])
def test_rss_and_committed_memory_follow_tokens_not_max_seq_len(layout, page_size):
    cfg = vattention.KVCacheConfig(
        num_layers=4,
        num_kv_heads=8,
        head_dim=128,
        max_batch_size=8,
        max_seq_len=131072,
        dtype=torch.bfloat16,
        page_size=page_size,
        layout=layout,
    )
    with vattention.KVCache(cfg) as cache:
        assert cfg.virtual_bytes >= 8 << 30  # 8 GiB of address space reserved ...
        rss0 = rss_shmem_bytes()
        slot = cache.alloc()
        n = 5000
        cache.step({slot: n})
        k, v = cache.layer(cfg.num_layers - 1)
        k[slot, :n] = 1  # touching what is mapped adds nothing: it is resident already
        v[slot, :n] = 1
        expected = cfg.pages_for_tokens(n) * cfg.page_bytes
        stats = cache.stats()
        assert stats["bytes_mapped"] == expected
        assert stats["committed_bytes"] == expected  # memfd blocks really allocated
        grown = rss_shmem_bytes() - rss0
        assert expected * 0.95 <= grown <= expected * 1.05 + (1 << 20), (grown, expected)
        assert grown < cfg.static_bytes / 100  # ... but ~1% of it is resident
        cache.free(slot)
        cache.reclaim()
        assert cache.shrink() == cfg.pages_for_tokens(n)
        assert cache.stats()["committed_bytes"] == 0  # holes punched: memory given back
        assert rss_shmem_bytes() - rss0 < (1 << 20)


def resident_bytes() -> int:
    """This process's resident set (/proc/self/statm: file, anonymous and shared pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("page_size", ["64KB", "2MB"])
def test_released_blocks_go_back_to_the_os_when_the_budget_trims_them(page_size):
    # An engine's blocks (block_cache: kept past their rows for its prefix cache) hold 64 MB; the
    # scheduler releases all but one and lowers the budget to one block: the idle row's mapping
    # goes (the process's resident set falls) and the trim punches the pages out of the memfd
    # (what the OS holds for the cache falls), huge pages or not.
    cfg = vattention.KVCacheConfig(
        num_layers=2,
        num_kv_heads=8,
        head_dim=128,
        max_batch_size=2,
        max_seq_len=16384,
        dtype=torch.bfloat16,
        page_size=page_size,
        num_blocks=256,
        block_cache=True,
    )
    block = cfg.pages_per_index * cfg.page_bytes  # bytes of one engine block
    n = (64 << 20) // block
    with vattention.KVCache(cfg) as cache:
        slot, tokens = cache.alloc(), n * cfg.tokens_per_page
        cache.step({slot: tokens}, blocks={slot: (0, list(range(n)), 0)})
        for layer in range(cfg.num_layers):
            k, v = cache.layer(layer)
            k[slot, :tokens] = 1  # resident (created and mapped) already; written all the same
            v[slot, :tokens] = 1
        del k, v
        cache.free(slot)  # the row stays mapped: its blocks are kept for a hit in place
        assert cache.stats()["committed_bytes"] == n * block
        rss0, shmem0 = resident_bytes(), rss_shmem_bytes()
        assert cache.release_blocks(range(1, n)) == (n - 1) * cfg.pages_per_index
        unmapped = (n - 1) * block
        assert shmem0 - rss_shmem_bytes() >= unmapped * 0.95  # the row's mapping went
        assert rss0 - resident_bytes() >= unmapped * 0.95
        assert cache.stats()["committed_bytes"] == n * block  # free pages, not yet destroyed
        assert cache.set_memory_budget(block) == 0  # the worker's budget: the one block left
        stats = cache.stats()
        assert stats["pages_total"] == cfg.pages_per_index
        assert stats["committed_bytes"] == block  # holes punched: the OS has the rest back
        assert stats["pages_destroyed"] == (n - 1) * cfg.pages_per_index


FAULT_SCRIPT = textwrap.dedent("""
    import sys, torch, vattention
    layout, page_size, offset = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = vattention.KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, max_batch_size=2,
                                   max_seq_len=65536, dtype=torch.float16, page_size=page_size,
                                   layout=layout)
    cache = vattention.KVCache(cfg)
    slot = cache.alloc()
    cache.step({slot: 100})
    k, v = cache.layer(1)
    edge = cache.mapped_tokens(slot)
    k[slot, edge - 1] = 1.0            # the last backed token is fine
    print("backed ok", flush=True)
    float(v[slot, edge - 1 + offset].sum())   # offset >= 1: beyond the mapped region
    print("read beyond the mapped region did not fault", flush=True)
""")


@pytest.mark.parametrize("layout", ["layer", "mega"])
@pytest.mark.parametrize("page_size", ["64KB", "2MB"])
@pytest.mark.parametrize("offset", [1, 40000])
def test_touching_beyond_mapped_region_faults(tmp_path, layout, page_size, offset):
    script = tmp_path / "touch.py"
    script.write_text(FAULT_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), layout, page_size, str(offset)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONFAULTHANDLER": ""},
    )
    assert "backed ok" in proc.stdout
    assert "did not fault" not in proc.stdout
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr[-2000:])


def test_other_slot_rows_are_not_backed(tmp_path):
    script = tmp_path / "touch_other.py"
    script.write_text(
        textwrap.dedent("""
        import torch, vattention
        cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=2, head_dim=64,
                                       max_batch_size=2, max_seq_len=4096,
                                       dtype=torch.float16, page_size="64KB")
        cache = vattention.KVCache(cfg)
        a = cache.alloc(); cache.step({a: 4096})
        k, _ = cache.layer(0)
        k[a] = 1.0
        print("slot a fully backed", flush=True)
        k[1 - a, 0] = 1.0
    """)
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert "slot a fully backed" in proc.stdout
    assert proc.returncode == -signal.SIGSEGV


def test_host_mapping_limit_is_a_recoverable_out_of_pages(tmp_path):
    """Past vm.max_map_count even unmapping fails, so the host backend stops short of it."""
    script = tmp_path / "limit.py"
    script.write_text(
        textwrap.dedent("""
        import torch, vattention
        cfg = vattention.KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=64,
                                       max_batch_size=2, max_seq_len=8192,
                                       dtype=torch.float16, page_size="64KB")
        cache = vattention.KVCache(cfg)
        a, b = cache.alloc(), cache.alloc()
        cache.step({a: 2048})                      # 8 page indices x 4 tensors = 32 mappings
        try:
            cache.step({a: 2048, b: 1024})         # 16 more: beyond the limit of 40
        except vattention.OutOfPagesError as e:
            print("refused", "mapping_limit" in str(e) or "vm.max_map_count" in str(e))
        assert cache._core.check_invariants() == ""
        assert cache.mapped_tokens(b) == 0 and cache.mapped_tokens(a) == 2048
        cache.step({b: 256})                       # 4 more mappings fit
        cache.free(a); cache.reclaim()
        cache.step({b: 1024})                      # and after unmapping, the rest fits too
        cache.close()
        print("ok")
    """)
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "VATTENTION_HOST_MAX_MAPPINGS": "40"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["refused", "True", "ok"]
