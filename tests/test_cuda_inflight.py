"""Work in flight on the emulated GPU meets the cache: the emulated analogues of two GPU checks
(`make gpu-check`'s "streams" and "graphs" parts; tests/gpu/ has the GPU versions).

- A "kernel" still reading a slot's rows on a non-blocking stream when the slot is freed on that
  stream: the pages are unmapped only once it completed (zero rule violations), whether reclaim()
  or another slot's step() under a tight budget takes them, or release_blocks() gives back the
  engine blocks the idle row maps (and the budget's trim destroys their pages), while a kernel
  queued after the free() that reads other rows holds release_blocks() back not at all (the wait
  is for the blocks' last use, not for the stream). Also when alloc()
  hands the freed row to a new request: its first step's table that differs from what the row
  maps (from page index 0, or after hits), or a trim of the look-ahead it inherited, unmaps only
  once the kernel completed; a table that agrees costs no event query.
- A capture begun in the default GLOBAL mode on one thread while the prefetch thread maps pages:
  the capture must survive (the driver forbids VMM calls of other threads in GLOBAL mode unless
  they make them in a mode that allows them).

Pages are the emulation's suite granularity (64 KB, or a GPU's 2 MB in the GPU check's emulated
run), so these run in both.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import vattention

from support.cuda_testing import E, make, needs_emulation

pytestmark = needs_emulation

# 4 pages a row and tensor (make(): 2 KV heads x 64 fp16, 256 bytes a token), at either page size.
TOKENS = 4 * E.SUITE_GRANULARITY // 256


def _row_range(cache: vattention.KVCache, slot: int, tokens: int) -> tuple[int, int]:
    """(address, bytes) of the first ``tokens`` positions of ``slot`` in layer 0's K."""
    k, _ = cache.host_alias(0)
    return k.data_ptr() + slot * k.stride(0) * k.element_size(), tokens * k.stride(1) * 2


@pytest.mark.parametrize("take", ["reclaim", "budget"])
def test_a_kernel_in_flight_on_a_nonblocking_stream_outlives_its_slots_free(emu, engine, take):
    page = E.SUITE_GRANULARITY
    probe = make(page_size=page, max_batch_size=2, max_seq_len=TOKENS)
    pages = probe.config.pages_for_tokens(TOKENS)
    probe.close()
    # "budget": room for one slot's pages only, so the second slot's step() must take the first's.
    budget = pages * page if take == "budget" else None
    cache = make(page_size=page, max_batch_size=2, max_seq_len=TOKENS, memory_budget=budget)
    side = emu.stream_create(nonblocking=True)
    try:
        # b is taken first: alloc() would hand a's row, pages and all, to a new request.
        a, b = cache.alloc(), cache.alloc()
        cache.step({a: TOKENS})
        k, v = cache.host_alias(0)
        assert v is not None
        k[a].normal_()
        v[a].normal_()
        want = (k[a].clone(), v[a].clone())
        unit = emu.launch(side, *_row_range(cache, a, TOKENS), held=True)  # reads a's rows
        cache.free(a, stream=side)
        seen: dict[str, bool] = {}

        def kernel_ends() -> None:  # the rows must still hold the data while it runs
            time.sleep(0.2)
            seen["intact"] = torch.equal(k[a], want[0]) and torch.equal(v[a], want[1])
            emu.complete(unit)

        ender = threading.Thread(target=kernel_ends)
        ender.start()
        if take == "reclaim":
            assert cache.reclaim() == pages
        else:
            cache.step({b: TOKENS})  # takes a's pages, after the fence
        # Ordered by the emulation, not timed: the call returned only once the kernel completed
        # (the thread completes it after 0.2 s; a call that did not wait returns within it).
        in_flight_at_return = emu.inflight()
        ender.join()
        assert seen == {"intact": True}
        assert emu.violations == 0, emu.last_violation()
        assert in_flight_at_return == 0, "the pages went while the kernel still ran"
        assert cache.stats()["fence_waits"] == 1
    finally:
        cache.close()
        assert emu.stream_destroy(side) == E.CUDA_SUCCESS


def test_released_blocks_outlive_a_kernel_that_reads_them(emu, engine):
    # An engine block's pages, read by a kernel still in flight when its slot is freed on the
    # kernel's stream, given back by release_blocks() and destroyed by the budget's trim: the row
    # is unmapped, and the pages destroyed, only once the kernel completed (the wait is for the
    # slot's free() fence: the last use of the blocks the row maps).
    page = E.SUITE_GRANULARITY
    cache = make(
        page_size=page, max_batch_size=2, max_seq_len=TOKENS, num_blocks=8, block_cache=True
    )
    side = emu.stream_create(nonblocking=True)
    try:
        a = cache.alloc()
        cache.step({a: TOKENS}, blocks={a: (0, [1, 2, 3, 4], 0)})  # one block a page index
        pages = cache.stats()["pages_mapped"]
        unit = emu.launch(side, *_row_range(cache, a, TOKENS), held=True)  # reads a's rows
        cache.free(a, stream=side)  # idle: it still maps 1-4
        unmaps, releases = emu.counter("cuMemUnmap"), emu.counter("cuMemRelease")
        result: dict = {}

        def give_back() -> None:
            try:
                result["pages"] = cache.release_blocks([1, 2, 3, 4])
                result["over"] = cache.set_memory_budget(page)  # trims: destroys those pages
            except Exception as e:  # pragma: no cover - surfaced by the assertion below
                result["error"] = e

        t = threading.Thread(target=give_back)
        t.start()
        time.sleep(0.2)
        assert t.is_alive(), "the blocks' pages went while a kernel still read them"
        assert emu.counter("cuMemUnmap") == unmaps
        assert emu.counter("cuMemRelease") == releases
        emu.complete(unit)
        t.join(5)
        assert result == {"pages": pages, "over": 0}
        assert emu.counter("cuMemRelease") == releases + pages - 1  # one page stays: the budget
        assert cache.stats()["fence_waits"] == 1
        assert emu.violations == 0, emu.last_violation()
    finally:
        cache.close()
        assert emu.stream_destroy(side) == E.CUDA_SUCCESS


def test_released_blocks_do_not_wait_for_later_work_on_the_stream(emu, engine):
    # Asynchronous scheduling: the next step's kernels are in flight on the engine's stream when
    # the scheduler's released blocks reach release_blocks(). Their last use was the kernels
    # before their slot's free(), long done: the row is unmapped at once, with no wait for the
    # kernel in flight (it reads another row), and no rule broken.
    page = E.SUITE_GRANULARITY
    cache = make(
        page_size=page, max_batch_size=2, max_seq_len=TOKENS, num_blocks=16, block_cache=True
    )
    side = emu.stream_create(nonblocking=True)
    try:
        a, b = cache.alloc(), cache.alloc()
        cache.step(
            {a: TOKENS, b: TOKENS}, blocks={a: (0, [1, 2, 3, 4], 0), b: (0, [5, 6, 7, 8], 0)}
        )
        per_index = cache.config.pages_per_index
        cache.free(a, stream=side)  # a's last kernel is done: its fence completes at once
        unit = emu.launch(side, *_row_range(cache, b, TOKENS), held=True)  # the step in flight
        unmaps = emu.counter("cuMemUnmap")
        result: dict = {}

        def give_back() -> None:
            try:
                result["pages"] = cache.release_blocks([1, 2, 3, 4])
            except Exception as e:  # pragma: no cover - surfaced by the assertion below
                result["error"] = e

        t = threading.Thread(target=give_back)
        t.start()
        t.join(2)
        alive = t.is_alive()
        emu.complete(unit)
        t.join(5)
        assert not alive, "release_blocks waited for a kernel that reads none of its blocks"
        assert result == {"pages": 4 * per_index}
        assert emu.counter("cuMemUnmap") > unmaps
        assert cache.stats()["fence_waits"] == 0
        assert cache.block_table(b) == [[5, 6, 7, 8]]
        assert emu.violations == 0, emu.last_violation()
    finally:
        cache.close()
        assert emu.stream_destroy(side) == E.CUDA_SUCCESS


def _step_in_thread(cache: vattention.KVCache, *args, **kw) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        try:
            cache.step(*args, **kw)
            result["ok"] = True
        except Exception as e:  # pragma: no cover - surfaced by the caller's assertion
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, result


@pytest.mark.parametrize("hits", [0, 2])
def test_a_reused_rows_old_blocks_outlive_a_kernel_when_the_new_table_differs(emu, engine, hits):
    # free() fences on the kernel's stream and the row keeps its blocks mapped (idle, for a hit in
    # place); alloc() hands that row to a new request whose table agrees with it on `hits` page
    # indices and differs after them. Its first step unmaps the rest, on the legacy stream (which
    # does not wait for a non-blocking one): only once the old request's kernel completed.
    page = E.SUITE_GRANULARITY
    cache = make(
        page_size=page, max_batch_size=2, max_seq_len=TOKENS, num_blocks=16, block_cache=True
    )
    side = emu.stream_create(nonblocking=True)
    try:
        per_index = cache.config.pages_per_index
        a = cache.alloc()
        cache.step({a: TOKENS}, blocks={a: (0, [1, 2, 3, 4], 0)})  # one block a page index
        k, v = cache.host_alias(0)
        assert v is not None
        k[a].normal_()
        v[a].normal_()
        want = (k[a].clone(), v[a].clone())
        unit = emu.launch(side, *_row_range(cache, a, TOKENS), held=True)  # reads a's rows
        cache.free(a, stream=side)
        table = [1, 2, 3, 4][:hits] + [5, 6, 7, 8][hits:]
        b = cache.alloc(hits=table[:hits] if hits else None)
        assert b == a  # the idle row, its blocks still mapped
        unmaps = emu.counter("cuMemUnmap")
        t, result = _step_in_thread(cache, {b: TOKENS}, blocks={b: (0, table, hits)}, stream=0)
        try:
            time.sleep(0.2)
            assert emu.violations == 0, emu.last_violation()
            assert t.is_alive(), "the new table's step unmapped the old blocks under a kernel"
            assert emu.counter("cuMemUnmap") == unmaps
            assert torch.equal(k[a], want[0]) and torch.equal(v[a], want[1])
        finally:
            emu.complete(unit)
            t.join(5)
        assert result == {"ok": True}
        assert emu.violations == 0, emu.last_violation()
        assert cache.stats()["fence_waits"] == 1
        assert cache.block_table(b) == [table]
        hit = hits * TOKENS // 4  # the hits' tokens: the old blocks' pages, mapped in place
        assert torch.equal(k[b, :hit], want[0][:hit]) and torch.equal(v[b, :hit], want[1][:hit])
        # The old blocks' pages are the pool's again: those no row maps go back at once (the
        # hits stay with b, detached), and another request's step takes them instead of new ones.
        assert cache.release_blocks([1, 2, 3, 4]) == (4 - hits) * per_index
        cache.wait()
        created = cache.stats()["pages_created"]
        c = cache.alloc()
        cache.step({c: TOKENS}, blocks={c: (0, [9, 10, 11, 12], 0)})
        assert cache.stats()["pages_created"] - created == hits * per_index
        assert cache._core.check_invariants() == ""
        assert emu.violations == 0, emu.last_violation()
    finally:
        cache.close()
        assert emu.stream_destroy(side) == E.CUDA_SUCCESS


def test_a_reused_rows_fence_costs_nothing_until_the_row_unmaps(emu, engine):
    # The fence alloc() leaves with the row costs nothing while nothing is unmapped: a new request
    # hitting every block the row maps steps at once, with no event query, under the kernel. Its
    # own free() on the legacy stream (done at once: it does not wait for a non-blocking stream)
    # keeps the first fence, still pending: a third request's table that differs waits for it.
    page = E.SUITE_GRANULARITY
    cache = make(
        page_size=page, max_batch_size=2, max_seq_len=TOKENS, num_blocks=16, block_cache=True
    )
    side = emu.stream_create(nonblocking=True)
    try:
        a = cache.alloc()
        cache.step({a: TOKENS}, blocks={a: (0, [1, 2, 3, 4], 0)})
        unit = emu.launch(side, *_row_range(cache, a, TOKENS), held=True)  # reads a's rows
        cache.free(a, stream=side)
        b = cache.alloc(hits=[1, 2, 3, 4])
        assert b == a
        calls = {n: emu.counter(n) for n in ("cuEventQuery", "cuEventSynchronize", "cuMemUnmap")}
        cache.step({b: TOKENS}, blocks={b: (0, [1, 2, 3, 4], 4)})
        cache.step({b: TOKENS})
        assert {n: emu.counter(n) for n in calls} == calls
        cache.free(b, stream=0)
        c = cache.alloc()
        assert c == a
        t, result = _step_in_thread(cache, {c: TOKENS}, blocks={c: (0, [5, 6, 7, 8], 0)})
        try:
            time.sleep(0.2)
            assert emu.violations == 0, emu.last_violation()
            assert t.is_alive(), "the third request's step unmapped the blocks under a kernel"
            assert emu.counter("cuMemUnmap") == calls["cuMemUnmap"]
        finally:
            emu.complete(unit)
            t.join(5)
        assert result == {"ok": True}
        assert cache.stats()["fence_waits"] == 1
        assert cache._core.check_invariants() == ""
        assert emu.violations == 0, emu.last_violation()
    finally:
        cache.close()
        assert emu.stream_destroy(side) == E.CUDA_SUCCESS


def test_a_reused_slots_inherited_pages_outlive_a_kernel_when_trimmed(emu, engine):
    # Pages owned by slots: the new request in a freed row inherits its pages as look-ahead
    # (length 0), which a step of another slot under a one-slot budget trims: only once the old
    # request's kernel completed.
    page = E.SUITE_GRANULARITY
    probe = make(page_size=page, max_batch_size=2, max_seq_len=TOKENS)
    pages = probe.config.pages_for_tokens(TOKENS)
    probe.close()
    cache = make(page_size=page, max_batch_size=2, max_seq_len=TOKENS, memory_budget=pages * page)
    side = emu.stream_create(nonblocking=True)
    try:
        a, b = cache.alloc(), cache.alloc()
        cache.step({a: TOKENS})
        unit = emu.launch(side, *_row_range(cache, a, TOKENS), held=True)  # reads a's rows
        cache.free(a, stream=side)
        assert cache.alloc() == a  # the idle row, pages and all
        unmaps = emu.counter("cuMemUnmap")
        t, result = _step_in_thread(cache, {b: TOKENS})  # takes the new request's look-ahead
        try:
            time.sleep(0.2)
            assert emu.violations == 0, emu.last_violation()
            assert t.is_alive(), "the trim unmapped the inherited pages under a kernel"
            assert emu.counter("cuMemUnmap") == unmaps
        finally:
            emu.complete(unit)
            t.join(5)
        assert result == {"ok": True}
        assert cache.stats()["fence_waits"] == 1
        assert cache.mapped_tokens(b) == TOKENS and cache.mapped_tokens(a) == 0
        assert cache._core.check_invariants() == ""
        assert emu.violations == 0, emu.last_violation()
    finally:
        cache.close()
        assert emu.stream_destroy(side) == E.CUDA_SUCCESS


@pytest.mark.checks_own_cleanup  # on failure the violation is the finding; cleaned up below
def test_a_global_capture_beside_the_prefetch_thread_is_not_invalidated(emu, engine):
    cache = make(page_size=E.SUITE_GRANULARITY, max_batch_size=4, max_seq_len=TOKENS)
    stream = emu.stream_create(nonblocking=True)
    capturing = False
    try:
        slots = [cache.alloc() for _ in range(4)]
        cache.step({s: 1 for s in slots})
        emu.gate("cuMemMap")  # the prefetch thread's first map waits here ...
        cache.prefetch({s: TOKENS for s in slots}, lookahead_tokens=0)
        try:
            emu.wait_gate_held()
        except AssertionError as e:
            raise RuntimeError(f"setup: {e}") from None
        assert emu.begin_capture(stream, E.CU_STREAM_CAPTURE_MODE_GLOBAL) == E.CUDA_SUCCESS
        capturing = True
        emu.gate_open()  # ... and maps, and grants access, while this thread captures
        error = None
        try:
            cache.wait()
        except vattention.DriverError as e:
            error = e
        rc = emu.end_capture(stream)
        capturing = False
        assert error is None, f"the prefetch thread failed during the capture: {error}"
        assert rc == E.CUDA_SUCCESS, f"cuStreamEndCapture returned {rc} (901: invalidated)"
        assert emu.violations == 0, emu.last_violation()
        assert all(cache.mapped_tokens(s) >= TOKENS for s in slots)
    finally:
        emu.gate_open()
        if capturing:
            emu.end_capture(stream)
        cache.close()
        emu.stream_destroy(stream)


def test_the_headroom_is_created_by_the_prefetch_thread_not_in_the_step(emu, engine):
    # The step takes the headroom's pages; the refill's first cuMemCreate is held at a gate: the
    # step has returned by then, having created nothing, and the thread makes the pages after.
    page = E.SUITE_GRANULARITY
    cache = make(page_size=page, max_batch_size=2, max_seq_len=TOKENS, num_blocks=8)
    try:
        per_block = cache.config.pages_per_index
        cache.set_headroom(2 * per_block * page)
        cache.wait()
        assert cache.stats()["pages_free"] == 2 * per_block
        creates = emu.counter("cuMemCreate")
        emu.gate("cuMemCreate")
        a = cache.alloc()
        cache.step({a: 1}, blocks={a: (0, [3], 0)})  # one block's pages, from the free list
        s = cache.stats()
        assert s["step_pages_created"] == 0 and s["pages_free"] == per_block
        emu.wait_gate_held()  # the refill, on the prefetch thread
        assert emu.counter("cuMemCreate") == creates + 1
        emu.gate_open()
        cache.wait()
        s = cache.stats()
        assert s["pages_free"] == 2 * per_block and s["background_pages_created"] == 3 * per_block
    finally:
        emu.gate_open()
        cache.close()


def test_a_step_waits_for_one_page_of_the_refill_at_most(emu, engine):
    # 50 ms a cuMemCreate: refilling 30 pages takes 1.5 s at the least (each create is held that
    # long on the monotonic clock, however loaded the machine). A step on engine blocks that
    # arrives meanwhile waits for the page under way (it settles), then creates its own 4 (the
    # free list is short): a quarter of a second, not the whole refill. Checked against the
    # refill's own progress, counted, not against a time: when the step returns, the refill has
    # not finished (a step that waited for it would return after its 30th page).
    page = E.SUITE_GRANULARITY
    cache = make(page_size=page, max_batch_size=2, max_seq_len=TOKENS, num_blocks=8)
    try:
        emu.set_latency_us("cuMemCreate", 50_000)
        cache.set_headroom(30 * page)
        time.sleep(0.02)  # the first page is under way
        a = cache.alloc()
        cache.step({a: 1}, blocks={a: (0, [3], 0)})
        refilled = cache.stats()["background_pages_created"]
        assert refilled < 30, "the step waited for the whole refill"
        cache.wait()
        assert cache.stats()["pages_free"] == 30
    finally:
        emu.set_latency_us("cuMemCreate", 0)
        cache.close()
