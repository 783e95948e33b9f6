"""Random alloc/step/free/reclaim/reserve/shrink sequences against a pure Python model.

The model predicts exactly which page indices every slot has mapped and how many pages the pool
holds, including the reclamation policy under a memory budget (free pages, then new pages within
the budget, then idle slots least recently freed first, then look-ahead of active slots). After
every rule the real cache must agree with it, its internal invariants must hold, and the data
written into active slots must still be there. With a tile rule (kv_tile_tokens) the model maps
each row's read end, and a request's rows are filled with NaN when it ends: every active row's
tokens from its length to its read end must still be finite (what a tile-loading kernel reads).
"""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import vattention

from support.helpers import kv_views

PAGE = 64 << 10
LENGTHS = [0, 1, 255, 256, 257, 511, 512, 513, 1024, 1500, 2048]


class Model:
    def __init__(self, cfg: vattention.KVCacheConfig, budget_pages):
        self.cfg = cfg
        self.T = cfg.pages_per_index  # pages of one page index over all tensors
        self.cap = budget_pages  # None = no budget
        self.state = ["free"] * cfg.max_batch_size
        self.mapped = [0] * cfg.max_batch_size  # page indices
        self.seq = [0] * cfg.max_batch_size
        self.freed_at = [0] * cfg.max_batch_size
        self.clock = 0
        self.total = 0

    def idx(self, tokens):
        """Page indices a row of `tokens` tokens maps: its read end's (the tile rule)."""
        end = self.cfg.read_end(tokens)
        return -(-end * self.cfg.unit_bytes // self.cfg.page_bytes)

    @property
    def in_use(self):
        return sum(self.mapped) * self.T

    def alloc(self):
        idle = [i for i, s in enumerate(self.state) if s == "idle"]
        if idle:
            best = idle[0]
            for i in idle:
                if self.mapped[i] > self.mapped[best]:
                    best = i
        else:
            free = [i for i, s in enumerate(self.state) if s == "free"]
            if not free:
                return None
            best = free[0]
        self.state[best] = "active"
        self.seq[best] = 0
        return best

    def free(self, slot):
        self.state[slot] = "idle" if self.mapped[slot] else "free"
        self.seq[slot] = 0
        self.clock += 1
        self.freed_at[slot] = self.clock

    def _spare(self, growing):
        spare = 0
        for i, s in enumerate(self.state):
            if s == "idle":
                spare += self.mapped[i] * self.T
            elif s == "active" and i not in growing:
                spare += max(0, self.mapped[i] - self.idx(self.seq[i])) * self.T
        return spare

    def _release_spare(self, n, growing):
        released = 0
        while released < n:
            idle = [i for i, s in enumerate(self.state) if s == "idle" and self.mapped[i]]
            floor = 0
            if idle:
                victim = min(idle, key=lambda i: self.freed_at[i])
            else:
                victim, best = None, 0
                for i, s in enumerate(self.state):
                    if s != "active" or i in growing:
                        continue
                    excess = self.mapped[i] - self.idx(self.seq[i])
                    if excess > best:
                        victim, best, floor = i, excess, self.idx(self.seq[i])
                if victim is None:
                    break
            want = -(-(n - released) // self.T)
            keep = max(floor, self.mapped[victim] - want if self.mapped[victim] > want else 0)
            released += (self.mapped[victim] - keep) * self.T
            self.mapped[victim] = keep
            if self.state[victim] == "idle" and keep == 0:
                self.state[victim] = "free"

    def step(self, lens):
        """Returns 'oom' (state unchanged) or None."""
        plan = {s: self.idx(n) for s, n in lens.items() if self.idx(n) > self.mapped[s]}
        need = sum(to - self.mapped[s] for s, to in plan.items()) * self.T
        old = list(self.seq)
        for s, n in lens.items():
            self.seq[s] = max(n, old[s])
        if need:
            free = self.total - self.in_use
            headroom = None if self.cap is None else max(0, self.cap - self.total)
            spare = self._spare(plan)
            if headroom is not None and free + headroom + spare < need:
                self.seq = old
                return "oom"
            take = min(need, free)
            create = need - take if headroom is None else min(need - take, headroom)
            self.total += create
            missing = need - take - create
            if missing:
                self._release_spare(missing, plan)
            for s, to in plan.items():
                self.mapped[s] = to
        for s, n in lens.items():
            self.seq[s] = n
        return None

    def reclaim(self):
        for i, s in enumerate(self.state):
            if s == "idle":
                self.mapped[i] = 0
                self.state[i] = "free"

    def reserve(self, pages):
        if pages <= self.total:
            return None
        if self.cap is not None and pages > self.cap:
            return "oom"
        self.total = pages
        return None

    def shrink(self, keep_pages):
        self.total = max(self.in_use, min(self.total, keep_pages))


class CacheMachine(RuleBasedStateMachine):
    DEVICE = "cpu"  # test_cuda_backend.py runs the same machine on the emulated CUDA backend

    @initialize(
        layout=st.sampled_from(["layer", "mega", "per-layer"]),
        budget=st.one_of(st.integers(min_value=2, max_value=12), st.none()),
        # 384 divides neither page (256 or 512 tokens): read ends cross page boundaries
        tile=st.sampled_from([0, 128, 384]),
    )
    def setup(self, layout, budget, tile):
        # per-layer: layer 1 has twice layer 0's KV heads (1 + 2 pages per page index and K/V).
        heads = (1, 2) if layout == "per-layer" else 1
        self.cfg = vattention.KVCacheConfig(
            num_layers=2,
            num_kv_heads=heads,
            head_dim=64,
            max_batch_size=4,
            max_seq_len=2048,
            dtype=torch.float16,
            page_size=PAGE,
            layout="layer" if layout == "per-layer" else layout,
            device=self.DEVICE,
            kv_tile_tokens=tile,
        )
        budget_pages = None if budget is None else budget * self.cfg.pages_per_index
        self.cache = vattention.KVCache(
            self.cfg, memory_budget=None if budget is None else budget_pages * PAGE
        )
        self.model = Model(self.cfg, budget_pages)
        self.marks = {}  # slot -> (position, value) written in layer 0's K

    def teardown(self):
        if hasattr(self, "cache"):
            self.cache.close()
            assert self.cache.closed

    @rule()
    def alloc(self):
        expected = self.model.alloc()
        if expected is None:
            try:
                self.cache.alloc()
            except vattention.InvalidSlotError:
                return
            raise AssertionError("alloc succeeded with every slot active")
        assert self.cache.alloc() == expected
        self.marks.pop(expected, None)

    @precondition(lambda self: "active" in self.model.state)
    @rule(data=st.data())
    def free(self, data):
        active = [i for i, s in enumerate(self.model.state) if s == "active"]
        slot = data.draw(st.sampled_from(active))
        # What the request leaves behind may be anything: the next owner of these pages must
        # never read it past its own length.
        mapped = self.cache.mapped_tokens(slot)
        for layer in range(self.cfg.num_layers):
            for t in kv_views(self.cache, layer):
                t[slot, :mapped] = float("nan")
        self.cache.free(slot)
        self.model.free(slot)
        self.marks.pop(slot, None)

    @precondition(lambda self: "active" in self.model.state)
    @rule(data=st.data())
    def step(self, data):
        active = [i for i, s in enumerate(self.model.state) if s == "active"]
        chosen = data.draw(st.lists(st.sampled_from(active), min_size=1, unique=True))
        # Lengths around page boundaries (256 tokens per mega page, 512 per layer page) make ties
        # and exact fits, where policies differ, far more likely than uniform draws.
        lens = {s: data.draw(st.sampled_from(LENGTHS)) for s in chosen}
        self._step(lens)

    def _step(self, lens):
        """Steps cache and model alike, writes each slot's new tokens (as its request would:
        finite values), then marks its last token to check it later."""
        old = {s: self.cache.seq_len(s) for s in lens}
        outcome = self.model.step(lens)
        try:
            self.cache.step(lens)
        except vattention.OutOfPagesError:
            assert outcome == "oom"
            return
        assert outcome is None
        for layer in range(self.cfg.num_layers):
            for t in kv_views(self.cache, layer):
                for s, n in lens.items():
                    if n > old[s]:
                        t[s, old[s] : n] = 1.0
        k, _ = kv_views(self.cache, 0)
        for s, n in lens.items():
            self.marks.pop(s, None)
            if n:
                value = float((s * 7 + n) % 100)
                k[s, n - 1, 0, 0] = value
                self.marks[s] = (n - 1, value)

    # Extra weight on the paths where policies differ: several idle slots holding pages, then a
    # slot growing under the budget (hypothesis picks rules uniformly).
    @precondition(lambda self: "active" in self.model.state)
    @rule(data=st.data())
    def free_again(self, data):
        self.free(data)

    @precondition(lambda self: "active" in self.model.state)
    @rule(data=st.data())
    def grow_to_max(self, data):
        active = [i for i, s in enumerate(self.model.state) if s == "active"]
        slot = data.draw(st.sampled_from(active))
        self._step({slot: self.cfg.max_seq_len})

    @rule()
    def reclaim(self):
        self.cache.reclaim()
        self.model.reclaim()

    @rule(pages=st.integers(min_value=0, max_value=40))
    def reserve(self, pages):
        outcome = self.model.reserve(pages)
        try:
            self.cache.reserve(pages * PAGE)
        except vattention.OutOfPagesError:
            assert outcome == "oom"
            return
        assert outcome is None

    @rule(pages=st.integers(min_value=0, max_value=40))
    def shrink(self, pages):
        self.cache.shrink(pages * PAGE)
        self.model.shrink(pages)

    @invariant()
    def agrees_with_model(self):
        if not hasattr(self, "cache"):
            return
        stats = self.cache.stats()
        m = self.model
        assert stats["pages_free"] + stats["pages_mapped"] == stats["pages_total"]
        assert stats["pages_total"] == m.total
        assert stats["pages_mapped"] == m.in_use
        if m.cap is not None:
            assert stats["pages_total"] <= m.cap
        for s in range(self.cfg.max_batch_size):
            assert self.cache.mapped_tokens(s) == min(
                self.cfg.max_seq_len, m.mapped[s] * PAGE // self.cfg.unit_bytes
            )
            if m.state[s] == "active":
                assert self.cache.mapped_tokens(s) >= m.seq[s] == self.cache.seq_len(s)
        assert sorted(self.cache.active_slots()) == [
            i for i, s in enumerate(m.state) if s == "active"
        ]
        assert self.cache._core.check_invariants() == ""
        k, _ = kv_views(self.cache, 0)
        for s, (pos, value) in self.marks.items():
            assert float(k[s, pos, 0, 0]) == value
        if self.cfg.kv_tile_tokens:
            for s in self.cache.active_slots():
                n = self.cache.seq_len(s)
                for layer in range(self.cfg.num_layers):
                    for t in kv_views(self.cache, layer):
                        tail = t[s, n : self.cfg.read_end(n)].cpu()
                        assert bool(tail.isfinite().all()), (s, n, layer)


TestCacheStateMachine = CacheMachine.TestCase
TestCacheStateMachine.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
