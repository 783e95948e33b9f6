"""Elastic KV memory in vLLM's scheduler: which blocks have pages, and how many may.

vLLM's ``BlockPool`` hands every block id out once before it reuses any (never-used ids sit
ahead of the cached ones in its free queue), and with prefix caching a vattention block keeps
its pages until its id is handed out fresh: left alone, a block cache reaches its whole budget
after one budget's worth of tokens. :class:`ElasticBlockPool` is installed on the scheduler's own
pool (:mod:`.scheduler`) and keeps three kinds of blocks apart:

* **backed**: the block has pages in the workers: in use by a request, or free and cached
  (hashed, ref 0: vLLM's free queue, in its LRU order);
* **unbacked**: no pages. These leave vLLM's free queue; a worker creates their pages when the
  block is first handed out;
* the **reserve**: pages granted by the ledger (:mod:`vattention.pool_ledger`) that no block has
  yet. The worker keeps them created ahead (its headroom), so a step that admits a request maps
  existing pages instead of creating them.

What vLLM's scheduler sees: ``get_num_free_blocks()`` is the free backed blocks plus the unbacked
ones the reserve can back, so admission follows what memory can really back, and a request is
admitted only with its pages granted (the grant is taken while the scheduler checks, not after).
``get_new_blocks()`` takes the cached blocks beyond the cap first (they would lose their pages at
the end of the step: the engine takes no grant for new pages while it holds pages it is about to
release), then reserved unbacked blocks (new pages within the budget keep the prefix cache), then
the other cached blocks in LRU order (evicting them, as vLLM does).

At the end of every ``schedule()`` (:meth:`ElasticBlockPool.settle`) the pool:

* releases the pages of cached blocks beyond the prefix-cache cap, oldest first, evicting them
  from vLLM's index in the same step, so no later lookup can hit a block whose pages are gone
  (also beyond what the pool's budget allows, when it was lowered);
* releases the pages of free blocks that are not cached (they can never be hit);
* tells the reuse watcher of every block released this way that vLLM's ``unpin_blocks()`` had
  given back while its owner still reads it (HiSparse): losing its pages ends the block's
  content as vLLM's own reuse of it would, and the owner stops reading it from that step on;
* trims or refills the reserve to the headroom;
* hands the worker an :class:`ElasticStep`: the blocks whose pages it releases, the step's page
  budget and headroom.

The ledger's figure for this engine drops only once the worker has run the step that released
the pages (:meth:`ElasticBlockPool.step_done`): other engines never create pages this one still
holds.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Any, Deque, Dict, List, Optional

from vllm.v1.core.block_pool import BlockPool

__all__ = ["ElasticBlockPool", "ElasticPolicy", "ElasticStep"]

logger = logging.getLogger("vllm.vattention")


@dataclasses.dataclass(frozen=True)
class ElasticPolicy:
    """The numbers :class:`ElasticBlockPool` works with, in blocks (``block_bytes`` each: one vLLM
    block's pages in every worker of the engine)."""

    block_bytes: int
    cache_cap_blocks: int  # free cached blocks kept with their pages
    headroom_blocks: int  # pages kept created ahead, within the budget
    step_blocks: int  # the most new blocks one schedule() can hand out (granted while it checks)


@dataclasses.dataclass
class ElasticStep:
    """What a step's worker does with its memory, sent with the scheduler's output.

    ``release``: block ids whose pages go (before the step maps anything); ``budget_blocks``:
    the blocks the worker may hold pages for during the step (backed plus headroom);
    ``headroom_blocks``: of those, how many to keep created ahead; ``figures``: the ledger's view
    (stats files).
    """

    release: List[int]
    budget_blocks: int
    headroom_blocks: int
    figures: Dict[str, Any] = dataclasses.field(default_factory=dict)


class ElasticBlockPool(BlockPool):
    """vLLM's ``BlockPool`` whose blocks have pages only while used or worth caching.

    Never constructed: :meth:`install` turns the scheduler's own pool into one (its queue and
    cache index stay vLLM's), before any block is handed out.
    """

    _ledger: Any
    _policy: ElasticPolicy
    _unbacked: Deque[int]
    _backed: int
    _reserve: int
    _release: List[int]
    _granting: bool
    _topped_up: bool
    _in_flight: Dict[int, int]
    _done_blocks: int
    _counting_all: bool

    @classmethod
    def install(cls, pool: BlockPool, ledger: Any, policy: ElasticPolicy) -> ElasticBlockPool:
        if pool.get_num_free_blocks() != pool.num_gpu_blocks - 1:
            raise RuntimeError("vattention: the elastic block pool is installed before any use")
        pool.__class__ = cls
        assert isinstance(pool, ElasticBlockPool)
        pool._ledger, pool._policy = ledger, policy
        free = pool.free_block_queue.popleft_n(pool.free_block_queue.num_free_blocks)
        pool._unbacked = deque(b.block_id for b in free)  # vLLM's order: low ids first
        pool._backed = pool._reserve = pool._done_blocks = 0
        pool._release, pool._in_flight = [], {}
        pool._granting = pool._topped_up = pool._counting_all = False
        return pool

    # ---- what vLLM calls ------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        queued = self.free_block_queue.num_free_blocks
        unbacked = len(self._unbacked)
        if self._counting_all:
            return queued + unbacked
        if self._granting:
            # Inside schedule(): what is counted is granted now, so the blocks vLLM then takes
            # are backed whatever other engines do meanwhile (no check-then-allocate race).
            self._top_up(min(unbacked, self._policy.step_blocks))
            return queued + min(unbacked, self._reserve)
        grantable = self._reserve + self._ledger.available() // self._policy.block_bytes
        return queued + min(unbacked, grantable)

    def get_new_blocks(self, num_blocks: int) -> list:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        queued = self.free_block_queue.num_free_blocks
        # Cached blocks beyond the cap lose their pages at settle() anyway (the least recently
        # used first, the same ones popleft_n takes): handing them out keeps their pages with a
        # block, so no grant for new pages is taken while this engine holds pages it would release.
        doomed = min(num_blocks, max(0, queued - self._policy.cache_cap_blocks))
        # Then new pages before evicting cached blocks: grant more if the reserve is short
        # (outside schedule() the count above was only a peek, so this grant backs the blocks).
        wanted = min(num_blocks - doomed, len(self._unbacked))
        if self._reserve < wanted:
            self._top_up(wanted, force=True)
        fresh = min(wanted, self._reserve)
        if num_blocks - fresh > queued:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(doomed)
        ret += [self.blocks[self._unbacked.popleft()] for _ in range(fresh)]
        self._reserve -= fresh
        self._backed += fresh
        ret += self.free_block_queue.popleft_n(num_blocks - doomed - fresh)  # cached, LRU first
        if self._reuse_watchers:
            self._notify_reuse(ret)
        for block in ret:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt += 1
            if self.metrics_collector:
                self.metrics_collector.on_block_allocated(block)
        return ret

    def free_blocks(self, ordered_blocks) -> None:
        ordered = list(ordered_blocks)
        super().free_blocks(ordered)
        for block in ordered:
            # A free block vLLM cannot hit has nothing worth keeping: its pages go to the reserve
            # (the worker's headroom), and it leaves the queue for the unbacked ones.
            if (
                block.pool is self
                and not block.is_null
                and block.ref_cnt == 0
                and (block.block_hash is None or not self.enable_caching)
            ):
                self.free_block_queue.remove(block)
                self._unback(block.block_id)
                self._reserve += 1

    def reset_prefix_cache(self) -> bool:
        self._counting_all = True
        try:
            if not super().reset_prefix_cache():
                return False
        finally:
            self._counting_all = False
        self._release_cached(self.free_block_queue.num_free_blocks)
        return True

    # ---- the scheduler's calls ---------------------------------------------------------------
    def begin_schedule(self) -> None:
        self._granting, self._topped_up = True, False

    def abandon_schedule(self) -> None:
        """``schedule()`` raised (the engine fails): no step reaches the workers."""
        self._granting = False

    def settle(self) -> ElasticStep:
        """End of ``schedule()``: cap the cache, size the reserve, say what the worker does."""
        self._granting = False
        policy = self._policy
        queued = self.free_block_queue.num_free_blocks
        over = max(0, queued - policy.cache_cap_blocks)
        excess = self._ledger.over_budget()
        if excess:  # the pool's budget was lowered: cached pages go first
            over = max(over, min(queued, -(-excess // policy.block_bytes)))
        self._release_cached(over)
        want = policy.headroom_blocks if not excess else 0
        if self._reserve > want:
            self._reserve = want
        elif self._reserve < want:
            self._top_up(want, force=True)
        held = self._backed + self._reserve
        step = ElasticStep(
            release=self._release,
            budget_blocks=held,
            headroom_blocks=self._reserve,
            figures=self.figures(),
        )
        self._release = []
        self._in_flight[id(step)] = held
        self._sync_ledger()
        return step

    def step_done(self, step: Optional[ElasticStep]) -> None:
        """The worker ran ``step``: the pages it released are gone, the ledger may drop them."""
        if step is None:
            return
        held = self._in_flight.pop(id(step), None)
        if held is not None:
            self._done_blocks = held
        self._sync_ledger()

    def close(self) -> None:
        """The engine shuts down: its ledger entry goes (the pool's other engines may grow)."""
        self._ledger.close()

    def figures(self) -> Dict[str, Any]:
        bb = self._policy.block_bytes
        cached = self.free_block_queue.num_free_blocks
        return {
            "live_bytes": (self._backed - cached) * bb,
            "cached_bytes": cached * bb,
            "headroom_bytes": self._reserve * bb,
            "held_bytes": self._ledger.held,
            "pool_budget_bytes": self._ledger.budget_bytes,
        }

    # ---- inside --------------------------------------------------------------------------------
    def _unback(self, block_id: int) -> None:
        """Block ``block_id`` (free) loses its pages at the worker's next step."""
        if block_id in self._reuse_watchers:
            # Released by ``unpin_blocks()``: its owner (vLLM's HiSparse) still reads it until
            # the pool reuses the block, which it learns from this watcher. Losing its pages
            # ends the block's content as a reuse does, in the same step, so the owner is told
            # now, before the worker's step that unmaps them.
            self._notify_reuse([self.blocks[block_id]])
        self._unbacked.append(block_id)
        self._release.append(block_id)
        self._backed -= 1

    def _release_cached(self, n: int) -> None:
        """The ``n`` least recently used cached blocks lose their pages and their hashes."""
        for block in self.free_block_queue.popleft_n(n) if n > 0 else ():
            self._maybe_evict_cached_block(block)
            self._unback(block.block_id)

    def _top_up(self, blocks: int, force: bool = False) -> None:
        """Grow the reserve to ``blocks`` as far as the ledger grants (once per schedule())."""
        if self._reserve >= blocks or (self._topped_up and not force):
            return
        self._topped_up = True
        bb = self._policy.block_bytes
        granted = self._ledger.try_grow((blocks - self._reserve) * bb, unit=bb)
        self._reserve += granted // bb

    def _sync_ledger(self) -> None:
        """The ledger holds what the worker may hold: the most of the steps not yet run, the last
        run, and now. Grants raised it already; this only lowers it."""
        held = self._backed + self._reserve
        target = (
            max([held, self._done_blocks, *self._in_flight.values()]) * self._policy.block_bytes
        )
        if target < self._ledger.held:
            self._ledger.set_held(target)
        bb = self._policy.block_bytes
        cached = self.free_block_queue.num_free_blocks
        self._ledger.report(
            live=(self._backed - cached) * bb, cached=cached * bb, headroom=self._reserve * bb
        )
