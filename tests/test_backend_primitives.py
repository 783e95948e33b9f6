"""The Backend primitives (csrc/core/backend.h) behave the same on every backend.

Runs on "cpu" (host backend) and "cuda" (the CUDA backend: through the strict driver emulation here,
on the real driver where there is a GPU); the cuda parameter's fixture also asserts that the
emulation saw no rule violation and that nothing is left alive afterwards.
"""

from __future__ import annotations

import ctypes

import pytest

import vattention

from support.cuda_setup import CUDA_MODE, skip_below_gpu_pages

C = vattention._C


def host_visible(device) -> bool:
    """Can this process touch the backend's memory through raw pointers?"""
    return device == "cpu" or CUDA_MODE == "emulated"


class _Holder:
    """Lets the fixture drop the backend at teardown (pytest keeps fixture values until the end
    of the test's teardown, after the device fixture's leak check has run)."""

    def __init__(self, backend):
        self.backend = backend

    def __getattr__(self, name):
        return getattr(self.__dict__["backend"], name)


@pytest.fixture
def backend(device, page_size):
    skip_below_gpu_pages(device, page_size)
    holder = _Holder(C.Backend(device, vattention.config.parse_size(page_size)))
    yield holder
    holder.__dict__.pop("backend")


def test_page_size_is_a_multiple_of_granularity(backend):
    assert backend.page_bytes % backend.granularity == 0
    assert backend.name in ("host", "cuda")


def test_lifecycle_with_one_access_grant_per_run(backend, device):
    P = backend.page_bytes
    va = backend.reserve(4 * P)
    assert va % backend.granularity == 0
    pages = [backend.create_page() for _ in range(3)]
    assert len(set(pages)) == 3
    for i, page in enumerate(pages):
        backend.map(va + i * P, page)
    backend.set_access(va, 3 * P)  # one grant over three adjacent mappings
    if host_visible(device):
        ctypes.memset(va, 0x11, 3 * P)
        assert ctypes.string_at(va + 3 * P - 4, 4) == b"\x11" * 4
    backend.unmap(va, 2 * P)  # a run of two mappings
    backend.unmap(va + 2 * P, P)
    backend.map(va + 3 * P, pages[0])  # remap elsewhere in the reservation
    backend.set_access(va + 3 * P, P)
    if host_visible(device):
        assert ctypes.string_at(va + 3 * P, 4) == b"\x11" * 4  # the page kept its bytes
    backend.unmap(va + 3 * P, P)
    for page in pages:
        backend.destroy_page(page)
    backend.release_va(va, 4 * P)


def test_one_page_mapped_at_two_addresses_aliases(backend, device):
    P = backend.page_bytes
    a, b = backend.reserve(P), backend.reserve(P)
    page = backend.create_page()
    for va in (a, b):
        backend.map(va, page)
        backend.set_access(va, P)
    if host_visible(device):
        ctypes.memset(a + 123, 0x5A, 3)
        assert ctypes.string_at(b + 123, 3) == b"\x5a" * 3
    for va in (a, b):
        backend.unmap(va, P)
        backend.release_va(va, P)
    backend.destroy_page(page)


def test_page_size_not_a_multiple_of_granularity_is_config_error(device):
    granularity = C.backend_granularity(device if device == "cpu" else "cuda:0")
    with pytest.raises(vattention.ConfigError, match=str(granularity)):
        C.Backend(device, granularity + granularity // 2)
