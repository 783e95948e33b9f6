"""Hypothesis stateful test of sharing and swap: random fork / share_prefix / ensure_private /
swap_out / swap_in / swap_drop / grow / free / reclaim sequences under tight page and swap
budgets, against a model holding every live request's expected K/V bytes.

Invariants after every operation: the core's check_invariants() (refcount == mappings + swap
references, shared pages only inside read-only prefixes), pages_free + pages_mapped ==
pages_total, every active slot backs its length, every active slot holds exactly its model's bytes,
and a failed call (OutOfPagesError, SwapSpaceError, no free slot) changed nothing. At the end,
freeing and dropping everything leaves no page mapped and no host memory held.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import vattention

from support.helpers import kv_views, page_state
from support.share_helpers import bits

FAILURES = (vattention.OutOfPagesError, vattention.SwapSpaceError, vattention.InvalidSlotError)


class SharingMachine(RuleBasedStateMachine):
    device = "cpu"
    layout = "layer"

    def __init__(self):
        super().__init__()
        page_size = "64KB" if self.device == "cpu" else "2MB"
        cfg = vattention.KVCacheConfig(
            num_layers=2,
            num_kv_heads=1,
            head_dim=64,
            max_batch_size=4,
            max_seq_len=1,
            dtype=torch.float16,
            device=self.device,
            page_size=page_size,
            layout=self.layout,
        )
        tpp = cfg.tokens_per_page
        cfg = vattention.KVCacheConfig(
            num_layers=2,
            num_kv_heads=1,
            head_dim=64,
            max_batch_size=4,
            max_seq_len=3 * tpp,
            dtype=torch.float16,
            device=self.device,
            page_size=page_size,
            layout=self.layout,
        )
        slot_bytes = cfg.pages_for_tokens(cfg.max_seq_len) * cfg.page_bytes
        self.cache = vattention.KVCache(
            cfg, memory_budget=slot_bytes * 2 + slot_bytes // 3, swap_budget=slot_bytes * 3 // 2
        )
        self.cfg = cfg
        self.active = {}  # slot -> expected tensor [L, 2, seq_len, H, D]
        self.handles = {}  # swap handle -> expected tensor
        self.seed = 0

    # ---- model helpers --------------------------------------------------------------------
    def _random(self, n):
        self.seed += 1
        gen = torch.Generator().manual_seed(self.seed)
        c = self.cfg
        data = torch.randn(c.num_layers, 2, n, c.num_kv_heads, c.head_dim, generator=gen)
        return data.to(c.dtype)

    def _write(self, slot, start, end):
        data = self._random(end - start)
        for layer in range(self.cfg.num_layers):
            k, v = kv_views(self.cache, layer)
            k[slot, start:end] = data[layer, 0]
            v[slot, start:end] = data[layer, 1]
        old = self.active.get(slot, data[:, :, :0])
        self.active[slot] = torch.cat([old[:, :, :start], data], dim=2)

    def _matches(self, slot, expected):
        n = expected.shape[2]
        for layer in range(self.cfg.num_layers):
            k, v = kv_views(self.cache, layer)
            if not (
                torch.equal(bits(k[slot, :n]), bits(expected[layer, 0]))
                and torch.equal(bits(v[slot, :n]), bits(expected[layer, 1]))
            ):
                return False
        return True

    def _attempt(self, call):
        """(True, call()) or, on an expected failure that provably changed nothing, (False,
        None)."""
        before = page_state(self.cache)
        try:
            return True, call()
        except FAILURES:
            assert page_state(self.cache) == before
            return False, None

    def _pick(self, data, pool):
        return data.draw(st.sampled_from(sorted(pool)))

    # ---- rules ----------------------------------------------------------------------------
    @rule(n=st.integers(1, 3 * 256))
    def new_request(self, n):
        ok, slot = self._attempt(self.cache.alloc)
        if not ok:
            return
        n = min(n, self.cfg.max_seq_len)
        if not self._attempt(lambda: self.cache.step({slot: n}))[0]:
            self.cache.free(slot)
            return
        self._write(slot, 0, n)

    @precondition(lambda self: self.active)
    @rule(data=st.data(), extra=st.integers(1, 300))
    def grow(self, data, extra):
        slot = self._pick(data, self.active)
        old = self.cache.seq_len(slot)
        new = min(self.cfg.max_seq_len, old + extra)
        if not self._attempt(lambda: self.cache.step({slot: new}))[0]:
            return
        self._write(slot, old, new)

    @precondition(lambda self: self.active)
    @rule(data=st.data(), frac=st.floats(0, 1))
    def fork(self, data, frac):
        src = self._pick(data, self.active)
        n = int(frac * self.cache.seq_len(src))
        ok, child = self._attempt(lambda: self.cache.fork(src, n))
        if ok:
            assert child not in self.active and self.cache.seq_len(child) == n
            self.active[child] = self.active[src][:, :, :n].clone()

    @precondition(lambda self: self.active)
    @rule(data=st.data(), frac=st.floats(0, 1))
    def share_prefix(self, data, frac):
        src = self._pick(data, self.active)
        n = int(frac * self.cache.seq_len(src))
        ok, dst = self._attempt(self.cache.alloc)
        if not ok:
            return
        if not self._attempt(lambda: self.cache.share_prefix(src, dst, n))[0]:
            self.cache.free(dst)
            return
        self.active[dst] = self.active[src][:, :, :n].clone()

    @precondition(lambda self: self.active)
    @rule(data=st.data(), frac=st.floats(0, 1))
    def rewrite_history(self, data, frac):
        slot = self._pick(data, self.active)
        length = self.cache.seq_len(slot)
        start = int(frac * length)
        if not self._attempt(lambda: self.cache.ensure_private(slot, start))[0]:
            return  # out of pages for the copies: the shared pages may not be written
        self._write(slot, start, length)

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def swap_out(self, data):
        slot = self._pick(data, self.active)
        ok, handle = self._attempt(lambda: self.cache.swap_out(slot))
        if ok:
            self.handles[handle] = self.active.pop(slot)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def swap_in(self, data):
        handle = self._pick(data, self.handles)
        ok, slot = self._attempt(lambda: self.cache.swap_in(handle))
        if ok:
            assert slot not in self.active
            self.active[slot] = self.handles.pop(handle)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def swap_drop(self, data):
        handle = self._pick(data, self.handles)
        self.cache.swap_drop(handle)
        del self.handles[handle]

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def free(self, data):
        slot = self._pick(data, self.active)
        self.cache.free(slot)
        del self.active[slot]

    @rule()
    def reclaim(self):
        self.cache.reclaim()

    # ---- invariants -----------------------------------------------------------------------
    @invariant()
    def consistent(self):
        assert self.cache._core.check_invariants() == ""
        stats = self.cache.stats()
        assert stats["pages_free"] + stats["pages_mapped"] == stats["pages_total"]
        assert stats["swap_handles"] == len(self.handles)
        assert sorted(self.cache.active_slots()) == sorted(self.active)
        for slot, expected in self.active.items():
            n = expected.shape[2]
            assert self.cache.seq_len(slot) == n
            assert self.cache.mapped_tokens(slot) >= n
            assert self._matches(slot, expected), f"slot {slot} lost its data"

    def teardown(self):
        try:
            for slot in list(self.active):
                self.cache.free(slot)
            for handle in list(self.handles):
                self.cache.swap_drop(handle)
            self.cache.reclaim()
            stats = self.cache.stats()
            assert (stats["pages_mapped"], stats["mappings"]) == (0, 0)
            assert (stats["swap_host_bytes"], stats["swap_device_pages"]) == (0, 0)
            assert stats["pages_free"] == stats["pages_total"]
            assert self.cache._core.check_invariants() == ""
        finally:
            self.cache.close()


def test_sharing_state_machine(device, layout):  # fixtures: every backend and layout
    machine = type(
        f"SharingMachine_{layout}", (SharingMachine,), {"device": device, "layout": layout}
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a thread pool only adds wake-ups on a busy CI box
    try:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=40,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    finally:
        torch.set_num_threads(threads)
