"""PagePool's own contract (csrc/core/page_pool.h), on every backend.

The pool owns every physical page a cache created: a free list, a byte budget, one reference per
mapping (so a page mapped twice returns only with its last reference), creation outside the
owner's lock (begin/end_create), and destruction. The cache tests exercise it through KVCache;
these tests pin the pool's promises one by one, with exact counts, on the host backend and on the
CUDA backend (through the driver emulation here; the device fixture checks that the emulation saw
no rule violation and that nothing is left alive).
"""

from __future__ import annotations

import pytest

import vattention

C = vattention._C
PAGE = 64 << 10


class _Holder:
    """Lets the fixture drop the backend (and the pools keeping it alive) at teardown: pytest keeps
    fixture values until after the device fixture's leak check."""

    def __init__(self, backend):
        self.backend, self.pools = backend, []

    def __getattr__(self, name):
        return getattr(self.__dict__["backend"], name)


@pytest.fixture
def backend(device):
    holder = _Holder(C.Backend(device, 2 << 20 if device.startswith("cuda") else PAGE))
    yield holder
    holder.__dict__.clear()


def make_pool(backend, pages=None):
    pool = C.PagePool(backend.backend, -1 if pages is None else pages * backend.page_bytes)
    backend.pools.append(pool)
    return pool


def test_take_prefers_free_pages_and_creates_only_the_rest(backend):
    pool = make_pool(backend)
    pool.reserve(3)
    assert (pool.total, pool.free, pool.in_use, pool.pages_created) == (3, 3, 0, 3)
    got = pool.take(5)
    assert len(got) == len(set(got)) == 5
    assert (pool.total, pool.free, pool.in_use, pool.pages_created) == (5, 0, 5, 5)
    assert all(pool.refs(p) == 1 for p in got)
    pool.destroy_all()


def test_reserve_is_all_or_nothing_under_the_budget(backend):
    pool = make_pool(backend, pages=4)
    pool.reserve(2)
    with pytest.raises(vattention.OutOfPagesError, match="exceeds the memory budget") as info:
        pool.reserve(5)
    assert (info.value.pages_needed, info.value.pages_available) == (3, 2)
    assert (pool.total, pool.pages_created, pool.headroom) == (2, 2, 2)  # nothing created
    pool.reserve(4)
    assert (pool.total, pool.headroom) == (4, 0)
    pool.destroy_all()


def test_take_stops_at_the_budget_and_untake_restores_the_pool(backend):
    pool = make_pool(backend, pages=3)
    pool.reserve(1)
    got = pool.take(5)
    assert len(got) == 3 and pool.headroom == 0  # 1 free + 2 created, then the budget
    pool.untake(got, 2)  # the two it created are destroyed again
    assert (pool.total, pool.free, pool.in_use) == (1, 1, 0)
    assert (pool.pages_created, pool.pages_destroyed) == (3, 2)
    pool.destroy_all()


def test_a_page_returns_with_its_last_reference(backend):
    pool = make_pool(backend)
    (page,) = pool.take(1)
    pool.share(page)
    pool.share(page)
    assert (pool.refs(page), pool.extra_refs) == (3, 2)
    pool.release(page)
    assert (pool.refs(page), pool.free, pool.extra_refs) == (2, 0, 1)
    pool.release(page)
    pool.release(page)
    assert (pool.refs(page), pool.free, pool.in_use, pool.extra_refs) == (0, 1, 0, 0)
    pool.release(page)  # a free page: nothing happens
    assert (pool.free, pool.extra_refs) == (1, 0)
    with pytest.raises(IndexError):  # sharing needs a page in use
        pool.share(page)
    pool.destroy_all()


def test_extra_refs_counts_every_reference_beyond_the_first(backend):
    pool = make_pool(backend)
    a, b, c = pool.take(3)
    for page, extra in ((a, 2), (b, 1)):
        for _ in range(extra):
            pool.share(page)
    assert pool.extra_refs == 3
    pool.untake([a], 0)  # untake drops every reference of a page
    assert (pool.extra_refs, pool.refs(a)) == (1, 0)
    pool.release(b)
    pool.release(b)
    pool.release(c)
    assert (pool.extra_refs, pool.in_use) == (0, 0)
    pool.destroy_all()


def test_shrink_destroys_free_pages_only(backend):
    pool = make_pool(backend)
    pool.reserve(4)
    held = pool.take(1)
    assert pool.shrink(0) == 3  # the page in use stays
    assert (pool.total, pool.free, pool.pages_destroyed) == (1, 0, 3)
    pool.release(held[0])
    assert pool.shrink(backend.page_bytes) == 0  # keep_bytes already holds it
    assert pool.shrink(0) == 1 and pool.total == 0
    pool.destroy_all()


def test_creation_outside_the_lock_counts_against_the_budget_first(backend):
    pool = make_pool(backend, pages=3)
    assert pool.begin_create(5) == 3
    assert (pool.creating, pool.headroom) == (3, 0)  # nobody else can overshoot meanwhile
    made = [backend.create_page(), backend.create_page()]  # one fewer than allowed
    pool.end_create(3, made)
    assert (pool.creating, pool.total, pool.free, pool.headroom) == (0, 2, 2, 1)
    assert pool.begin_create(4) == 1
    pool.set_budget(2 * backend.page_bytes)  # lowered while the page is being made
    pool.end_create(1, [backend.create_page()])
    assert (pool.total, pool.pages_destroyed) == (2, 1)  # the page over the new budget went
    pool.destroy_all()


def test_destroy_all_empties_the_pool_even_with_pages_in_use(backend):
    pool = make_pool(backend)
    pool.reserve(2)
    page = pool.take(3)[0]
    pool.share(page)
    pool.destroy_all()
    assert (pool.total, pool.free, pool.in_use, pool.extra_refs) == (0, 0, 0, 0)
    assert pool.pages_destroyed == pool.pages_created == 3
    assert pool.headroom is None  # no budget
