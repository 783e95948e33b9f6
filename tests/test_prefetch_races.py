"""The prefetch thread maps outside the cache lock: races held open in the driver.

The strict CUDA driver EMULATION stops the prefetch thread's first cuMemMap (a gate: the call is
held open, no cache lock held) while the test steps, frees, forks or swaps the same slot. Then:
no rule violated (a range mapped twice would be one), every page in the pool or owned, the
invariants hold. The same races on the host backend run under ThreadSanitizer
(csrc/tests/prefetch_race_test.cpp). Passing the emulation is evidence, not proof, for a GPU.
"""

from __future__ import annotations

import contextlib
import threading

import pytest

from support.cuda_testing import make, needs_emulation

pytestmark = needs_emulation


def run_in_thread(fn):
    """Starts fn in a thread; returns (thread, result dict with "value" or "error")."""
    result = {}

    def run():
        try:
            result["value"] = fn()
        except Exception as e:  # surfaced by the callers' assertions
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


@contextlib.contextmanager
def gated(emu, cache):
    """The cache; on the way out (a failed assertion too) the gate opens before the cache closes,
    so a failure is reported instead of hanging in close() behind a held driver call."""
    try:
        yield cache
    finally:
        emu.gate_open()
        cache.close()


def hold_prefetch(emu, cache, slot, tokens):
    emu.gate("cuMemMap", 1)
    cache.prefetch({slot: tokens}, lookahead_tokens=0)
    emu.wait_gate_held()


def settle(emu, cache):
    emu.gate_open()
    cache.wait()
    assert cache._core.check_invariants() == ""


def all_pages_return(cache):
    for s in cache.active_slots():
        cache.free(s)
    cache.reclaim()
    stats = cache.stats()
    assert stats["pages_free"] == stats["pages_total"] and stats["mappings"] == 0


@pytest.mark.parametrize("layout", ["layer", "mega"])
def test_step_of_other_slots_proceeds_while_a_map_is_held(emu, layout):
    with gated(emu, make(layout)) as cache:
        tpp = cache.config.tokens_per_page
        a, b = cache.alloc(), cache.alloc()
        cache.step({a: 1, b: 1})
        hold_prefetch(emu, cache, a, 5 * tpp)
        t, result = run_in_thread(lambda: cache.step({a: 1, b: 3 * tpp}))
        t.join(5)
        assert not t.is_alive() and "error" not in result, "step() waited for a map it did not need"
        assert emu.gate_held()  # the prefetch map is still open
        assert cache.mapped_tokens(b) >= 3 * tpp
        settle(emu, cache)
        assert cache.mapped_tokens(a) >= 5 * tpp
        all_pages_return(cache)


def test_step_of_the_slot_in_flight_waits_and_maps_nothing_itself(emu):
    with gated(emu, make()) as cache:
        tpp = cache.config.tokens_per_page
        a = cache.alloc()
        cache.step({a: 1})
        hold_prefetch(emu, cache, a, 4 * tpp)
        maps = cache.stats()["step_map_calls"]
        t, result = run_in_thread(lambda: cache.step({a: 4 * tpp}))
        t.join(0.2)
        assert t.is_alive(), "step() went on while the pages it needs were being mapped"
        emu.gate_open()
        t.join(5)
        assert not t.is_alive() and "error" not in result
        assert cache.stats()["step_map_calls"] == maps
        settle(emu, cache)
        all_pages_return(cache)


@pytest.mark.parametrize("had_pages", [True, False])
@pytest.mark.parametrize("policy", ["deferred", "eager"])
def test_free_while_the_slot_is_being_mapped(emu, had_pages, policy):
    with gated(emu, make(reclaim=policy)) as cache:
        tpp = cache.config.tokens_per_page
        a = cache.alloc()
        if had_pages:
            cache.step({a: 1})
        hold_prefetch(emu, cache, a, 3 * tpp)
        cache.free(a)
        assert cache._core.check_invariants() == ""
        settle(emu, cache)
        cache.reclaim()
        stats = cache.stats()
        assert stats["pages_free"] == stats["pages_total"] and emu.counter("live_mappings") == 0
        b = cache.alloc()
        cache.step({b: 2 * tpp})
        all_pages_return(cache)


def test_fork_and_swap_of_the_slot_in_flight(emu):
    with gated(emu, make()) as cache:
        cache.set_swap_budget("8MB")
        tpp = cache.config.tokens_per_page
        a = cache.alloc()
        cache.step({a: 2 * tpp + 3})
        hold_prefetch(emu, cache, a, 6 * tpp)
        t, result = run_in_thread(lambda: cache.fork(a))
        t.join(0.2)
        assert t.is_alive(), "fork() did not wait for the mapping in flight"
        emu.gate_open()
        t.join(5)
        c = result["value"]
        assert cache.seq_len(c) == 2 * tpp + 3
        settle(emu, cache)
        hold_prefetch(emu, cache, c, 6 * tpp)
        t, result = run_in_thread(lambda: cache.swap_out(c))
        t.join(0.2)
        assert t.is_alive(), "swap_out() did not wait for the mapping in flight"
        emu.gate_open()
        t.join(5)
        handle = result["value"]
        settle(emu, cache)
        d = cache.swap_in(handle)
        assert cache.seq_len(d) == 2 * tpp + 3
        all_pages_return(cache)


def test_driver_error_outside_the_lock_returns_the_pages(emu):
    with gated(emu, make()) as cache:
        tpp = cache.config.tokens_per_page
        a = cache.alloc()
        cache.step({a: 1})
        emu.inject_fault("cuMemMap", 3, 999)  # CUDA_ERROR_UNKNOWN on the third map
        cache.prefetch({a: 4 * tpp}, lookahead_tokens=0)
        with pytest.raises(Exception, match="cuMemMap"):
            cache.wait()
        assert cache._core.check_invariants() == ""
        assert cache.mapped_tokens(a) == tpp
        cache.step({a: 4 * tpp})  # the range maps again: nothing was left behind
        all_pages_return(cache)


def test_driver_calls_per_step_are_counted(emu):
    with gated(emu, make(lookahead_tokens=0)) as cache:
        cfg = cache.config
        a = cache.alloc()
        before = cache.stats()
        cache.step({a: 2 * cfg.tokens_per_page})  # 2 pages x T tensors: create, map; T grants
        after = cache.stats()
        T = cfg.num_tensors
        assert after["step_driver_calls"] - before["step_driver_calls"] == 2 * T + 2 * T + T
        cache.prefetch({a: 3 * cfg.tokens_per_page})
        cache.wait()
        again = cache.stats()
        assert again["prefetch_driver_calls"] == T + T + T
        assert again["step_driver_calls"] == after["step_driver_calls"]
        cache.step({a: 3 * cfg.tokens_per_page})  # found mapped: no driver call
        assert cache.stats()["step_driver_calls"] == after["step_driver_calls"]


@pytest.mark.parametrize("layout", ["layer", "mega"])
def test_one_unmap_per_contiguous_run(emu, layout):
    with gated(emu, make(layout)) as cache:
        cfg = cache.config
        a, b = cache.alloc(), cache.alloc()
        cache.step({a: 5 * cfg.tokens_per_page, b: 3 * cfg.tokens_per_page})
        cache.free(a)
        cache.free(b)
        calls, stat = emu.counter("cuMemUnmap"), cache.stats()["unmap_calls"]
        cache.reclaim()  # 5 and 3 pages per tensor: one call per slot and tensor
        assert emu.counter("cuMemUnmap") - calls == 2 * cfg.num_tensors
        assert cache.stats()["unmap_calls"] - stat == 2 * cfg.num_tensors
