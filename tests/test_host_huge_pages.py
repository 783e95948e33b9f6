"""Host backend: a page whose size is a whole number of 2 MB lives in 2 MB huge pages of the OS
where the kernel allows it, and every mapping of it at its aligned address is then one page-table
entry per 2 MB (host/host_backend.h).

Whether this kernel allows it is probed here independently of the library (a memfd, a
fallocate, MADV_COLLAPSE on an aligned mapping), so each test checks the behaviour this machine
should show, huge or not, and none is skipped.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

import vattention

C = vattention._C
MB2 = 2 << 20
MADV_COLLAPSE = 25
PROT_NONE, PROT_RW = 0, 3
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 1, 2, 0x10, 0x20, 0x4000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def kernel_collapses_shmem() -> bool:
    """Can this kernel gather a memfd's fallocated pages into a 2 MB folio?"""
    fd = os.memfd_create("vattention-probe")
    raw = _libc.mmap(None, 2 * MB2, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
    try:
        os.ftruncate(fd, MB2)
        os.posix_fallocate(fd, 0, MB2)
        va = (raw + MB2 - 1) // MB2 * MB2
        assert _libc.mmap(va, MB2, PROT_RW, MAP_SHARED | MAP_FIXED, fd, 0) == va
        return _libc.madvise(va, MB2, MADV_COLLAPSE) == 0
    finally:
        _libc.munmap(raw, 2 * MB2)
        os.close(fd)


BASE_4K = os.sysconf("SC_PAGESIZE") == 4096
HUGE = BASE_4K and kernel_collapses_shmem()
# shmem_enabled=always/force: fallocate itself gives 2 MB folios, with or without the collapse.
try:
    with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as _f:
        _shmem = _f.read()
except OSError:  # a kernel without transparent huge pages
    _shmem = ""
SHMEM_HUGE_ANYWAY = "[always]" in _shmem or "[force]" in _shmem


def pmd_mapped_bytes(begin: int, length: int) -> int:
    """Bytes of [begin, begin + length) this process maps with 2 MB entries (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < begin + length and hi > begin
            elif inside and head == "ShmemPmdMapped:":
                total += int(line.split()[1]) * 1024
    return total


def touch(va: int, nbytes: int, value: int) -> None:
    ctypes.memset(va, value, nbytes)


@pytest.fixture(autouse=True)
def _huge_pages_on(monkeypatch):
    monkeypatch.delenv("VATTENTION_HOST_HUGE_PAGES", raising=False)


@pytest.mark.parametrize("page_bytes", [MB2, 2 * MB2])
def test_pages_of_whole_2mb_map_with_2mb_entries_where_the_kernel_allows(page_bytes):
    backend = C.Backend("cpu", page_bytes)
    pages = [backend.create_page() for _ in range(2)]
    if not BASE_4K:
        assert backend.huge_page_bytes() == -1
    elif HUGE:
        # Each collapse may still fail on its own (no free 2 MB block at that moment).
        assert backend.huge_page_bytes() in (page_bytes, 2 * page_bytes)
    else:
        assert backend.huge_page_bytes() == 0
    both_huge = backend.huge_page_bytes() == 2 * page_bytes
    assert backend.committed_bytes() == 2 * page_bytes  # the same memory, in bigger pieces
    va = backend.reserve(3 * page_bytes)
    assert va % MB2 == 0
    backend.map(va, pages[0])
    backend.map(va + page_bytes, pages[1])
    backend.map(va + 2 * page_bytes, pages[0])  # page 0 again: the two alias
    backend.set_access(va, 3 * page_bytes)
    touch(va, page_bytes, 0x5A)
    touch(va + page_bytes, page_bytes, 0x11)
    alias = (ctypes.c_ubyte * page_bytes).from_address(va + 2 * page_bytes)
    assert bytes(alias[:16]) == b"\x5a" * 16 and alias[page_bytes - 1] == 0x5A
    pmd = pmd_mapped_bytes(va, 3 * page_bytes)
    if both_huge:
        assert pmd == 3 * page_bytes  # page 0 twice, page 1 once
    elif HUGE:
        assert pmd in (page_bytes, 2 * page_bytes)  # page 1 alone, or page 0 twice
    elif not SHMEM_HUGE_ANYWAY:
        assert pmd == 0
    backend.unmap(va, 3 * page_bytes)
    backend.release_va(va, 3 * page_bytes)
    # A destroyed page gives its memory back; its extent, reused, is huge again.
    before = backend.huge_page_bytes()
    backend.destroy_page(pages[0])
    assert before - backend.huge_page_bytes() in ((page_bytes,) if both_huge else (0, page_bytes))
    assert backend.committed_bytes() == page_bytes
    again = backend.create_page()
    assert again == pages[0]
    # The reused extent is new memory: zeros, not the 0x5A written before.
    va = backend.reserve(page_bytes)
    backend.map(va, again)
    backend.set_access(va, page_bytes)
    view = (ctypes.c_ubyte * page_bytes).from_address(va)
    assert bytes(view[:64]) == bytes(64) and view[page_bytes // 2] == 0 and view[-1] == 0
    backend.unmap(va, page_bytes)
    backend.release_va(va, page_bytes)
    for page in (again, pages[1]):
        backend.destroy_page(page)
    assert backend.huge_page_bytes() == (0 if BASE_4K else -1)
    assert backend.committed_bytes() == 0


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("VATTENTION_HOST_HUGE_PAGES", "0")
    backend = C.Backend("cpu", MB2)
    page = backend.create_page()
    va = backend.reserve(MB2)
    backend.map(va, page)
    backend.set_access(va, MB2)
    touch(va, MB2, 1)
    assert backend.huge_page_bytes() == (0 if BASE_4K else -1)
    if not SHMEM_HUGE_ANYWAY:
        assert pmd_mapped_bytes(va, MB2) == 0
    backend.unmap(va, MB2)
    backend.release_va(va, MB2)
    backend.destroy_page(page)


@pytest.mark.parametrize("page_bytes", [64 << 10, 1 << 20, 3 << 20])
def test_not_applicable_to_pages_that_are_not_whole_2mb(page_bytes):
    backend = C.Backend("cpu", page_bytes)
    page = backend.create_page()
    assert backend.huge_page_bytes() == -1
    backend.destroy_page(page)


def test_a_cache_reports_its_huge_pages_and_keeps_its_data():
    cfg = vattention.KVCacheConfig(
        num_layers=2,
        num_kv_heads=4,
        head_dim=64,
        max_batch_size=2,
        max_seq_len=4096,
        dtype=torch.float32,
        page_size="2MB",
        device="cpu",
    )
    with vattention.KVCache(cfg) as cache:
        a, b = cache.alloc(), cache.alloc()
        cache.step({a: 3000, b: 1000})
        stats = cache.stats()
        assert stats["committed_bytes"] > 0
        if HUGE:
            assert 0 < stats["huge_page_bytes"] <= stats["committed_bytes"]
        else:
            assert stats["huge_page_bytes"] == (0 if BASE_4K else -1)
        k, v = cache.layer(1)
        gen = torch.Generator().manual_seed(0)
        want = torch.randn(3000, 4, 64, generator=gen)
        k[a, :3000] = want
        v[b, :1000] = want[:1000] * 2
        cache.free(a)
        c = cache.alloc()
        cache.step({b: 1500, c: 2000})  # a's pages, reused by c's row
        k, v = cache.layer(1)
        assert torch.equal(v[b, :1000], want[:1000] * 2)
        k[c, :2000] = want[:2000] + 1
        assert torch.equal(k[c, :2000], want[:2000] + 1)
        stats = cache.stats()
        assert stats["huge_page_bytes"] <= stats["committed_bytes"]
        assert (stats["huge_page_bytes"] > 0) == HUGE


FALLBACK = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(41, 1, 0, 0, 0) == 0           # PR_SET_THP_DISABLE: MADV_COLLAPSE says EINVAL
import vattention
backend = vattention._C.Backend("cpu", 2 << 20)
pages = [backend.create_page() for _ in range(3)]
va = backend.reserve(3 << 21)
for i, page in enumerate(pages):
    backend.map(va + (i << 21), page)
backend.set_access(va, 3 << 21)
ctypes.memset(va, 7, 3 << 21)
view = (ctypes.c_ubyte * (3 << 21)).from_address(va)
assert view[0] == 7 and view[(3 << 21) - 1] == 7
print(backend.huge_page_bytes(), vattention._C.host_huge_unit())
"""


def test_a_kernel_that_refuses_leaves_4kb_pages_that_work():
    # THP disabled for the process: the collapse fails (EINVAL), the backend stops trying, and
    # its pages work as 4 KB pages.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", FALLBACK], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    # and an engine asking whether to size its pages for huge pages is told no
    assert out.stdout.split() == ["0" if BASE_4K else "-1", "0"]


def test_the_huge_unit_is_what_this_kernel_gives(monkeypatch):
    assert C.host_huge_unit() == (MB2 if HUGE else 0)
    monkeypatch.setenv("VATTENTION_HOST_HUGE_PAGES", "0")
    assert C.host_huge_unit() == 0
