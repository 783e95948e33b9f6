"""Shared pieces of the emulation-only CUDA backend tests (test_cuda_backend.py,
test_cuda_faults.py, test_prefetch_races.py): the `emu` fixture (registered for every test module
by conftest.py's ``pytest_plugins``), a small cache factory, state snapshots.

Passing these tests is evidence, not proof, that the backend is right on a GPU (docs/cuda.md).
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

import vattention

from .cuda_setup import CUDA_MODE, CUDA_REASON, cuda_emu as E
from .helpers import page_state

needs_emulation = pytest.mark.skipif(
    CUDA_MODE != "emulated", reason=f"needs the CUDA emulation ({CUDA_REASON or 'real GPU in use'})"
)

PAGE = 64 * 1024


def pages_state(cache):
    """page_state() without the pool's size and cumulative counters: what slots map and hold.

    A driver failure part-way through step() leaves every slot exactly as before, but the pool
    may keep (or, on driver OOM, destroy again) the pages it created for the failed call; that
    is not visible to any request, so it is checked separately (pool invariants), not here.
    map_calls/unmap_calls count the calls made, including those of the rollback.
    """
    state = page_state(cache)
    for key in (
        "pages_created",
        "pages_destroyed",
        "pages_total",
        "pages_free",
        "map_calls",
        "unmap_calls",
    ):
        del state[key]
    return state


def assert_clean(em):
    """No rule violated, nothing left alive in the emulated driver."""
    if any(em.live().values()):
        gc.collect()  # only when needed: a full collection costs ~0.3 s with torch loaded
    live = em.live()
    assert em.violations == 0, f"CUDA rule violated: {em.last_violation()}"
    assert live == {k: 0 for k in live}, "leaked driver objects"


@pytest.fixture
def emu(request):
    em = E.Emulator.load()
    if any(em.live().values()):
        gc.collect()  # objects of an earlier failed test must die before the reset, not during us
    # Resetting under a live cache would make its later destruction break rules in our test.
    assert not any(em.live().values()), f"an earlier test left driver objects alive: {em.live()}"
    em.reset_for_suite()
    yield em
    try:
        if request.node.get_closest_marker("checks_own_cleanup") is None:
            assert_clean(em)
    finally:
        em.reset_for_suite()


def make(layout="layer", **kw):
    args = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        max_batch_size=4,
        max_seq_len=4096,
        dtype=torch.float16,
        device="cuda:0",
        page_size=PAGE,
        layout=layout,
    )
    budget = kw.pop("memory_budget", None)
    args.update(kw)
    return vattention.KVCache(vattention.KVCacheConfig(**args), memory_budget=budget)


@contextlib.contextmanager
def engine_thread(em):
    """This thread as an engine's: CUDA initialised and device 0's primary context current, as
    torch leaves it before any stream exists (a cache puts back whatever a thread had, so the
    thread needs its own context for the streams and captures a test makes)."""
    assert em.lib.cuInit(0) == E.CUDA_SUCCESS
    ctx = em.retain_primary(0)
    em.set_current_context(ctx)
    try:
        yield ctx
    finally:
        em.set_current_context(0)
        em.release_primary(0)


@pytest.fixture
def engine(emu):
    """engine_thread() for one test (before the emu fixture's leak check)."""
    with engine_thread(emu) as ctx:
        yield ctx
