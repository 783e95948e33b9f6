"""The plugin's elastic block pool on vLLM's real ``BlockPool``, run in the vLLM venv.

Run with the vLLM venv's python; prints one JSON document: ``{case: "ok" | error text}``. Each
case builds vLLM's ``BlockPool`` (prefix caching on), installs
:class:`vattention.integrations.vllm.elastic.ElasticBlockPool` on it over a ledger, and drives it
as vLLM's KV cache manager does (``get_num_free_blocks`` then ``get_new_blocks``, ``touch`` for
hits, ``free_blocks``), with ``begin_schedule``/``settle``/``step_done`` around each step as the
plugin's scheduler does. Ledgers: vattention's own (``LocalLedger``; ``PoolLedger`` in a temporary
folder for two pools sharing one budget).
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: support.*

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id  # noqa: E402

from vattention.integrations.vllm.elastic import ElasticBlockPool, ElasticPolicy  # noqa: E402
from vattention.pool_ledger import LocalLedger, PoolLedger  # noqa: E402

BB = 1000  # bytes of a block's pages


def make(num_blocks=33, cap=4, headroom=2, step=8, ledger=None, max_blocks=None):
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=16)
    ledger = ledger or LocalLedger(max_bytes=(max_blocks or num_blocks - 1) * BB)
    policy = ElasticPolicy(
        block_bytes=BB, cache_cap_blocks=cap, headroom_blocks=headroom, step_blocks=step
    )
    return ElasticBlockPool.install(pool, ledger, policy), ledger


def cache(pool, blocks, tag=0):
    """Give ``blocks`` prefix-cache hashes, as vLLM's ``cache_full_blocks`` does."""
    for i, block in enumerate(blocks):
        key = make_block_hash_with_group_id(BlockHash(f"{tag}-{i}".encode()), 0)
        pool._insert_block_hash(key, block, None)
    return [b.block_hash for b in blocks]


def alloc(pool, n):
    """vLLM's allocate_slots: check, then take."""
    assert n <= pool.get_num_free_blocks(), (n, pool.get_num_free_blocks())
    return pool.get_new_blocks(n)


def step(pool, fn=None, run=True):
    """One schedule() (``fn`` inside it); ``run``: the worker then runs the step at once, as a
    synchronous engine's does (update_from_output)."""
    pool.begin_schedule()
    out = fn() if fn else None
    elastic = pool.settle()
    if run:
        pool.step_done(elastic)
    return elastic, out


def case_nothing_backed_at_start_and_grants_follow_use():
    pool, ledger = make()
    assert ledger.held == 0
    elastic, blocks = step(pool, lambda: alloc(pool, 5))
    assert [b.block_id for b in blocks] == [1, 2, 3, 4, 5]  # vLLM's order, new pages
    # held: 5 backed + headroom 2, granted now
    assert elastic.budget_blocks == 7 and elastic.headroom_blocks == 2
    assert ledger.held == 7 * BB and elastic.release == []


def case_free_uncached_blocks_give_their_pages_back():
    pool, ledger = make()
    _, blocks = step(pool, lambda: alloc(pool, 6))
    pool.free_blocks(blocks)  # a request without cacheable blocks ends
    elastic, _ = step(pool, run=False)
    assert sorted(elastic.release) == [b.block_id for b in blocks]
    assert elastic.budget_blocks == 2  # only the headroom is left
    assert ledger.held == 8 * BB  # the worker has not run the step yet
    pool.step_done(elastic)
    assert ledger.held == 2 * BB


def case_cached_blocks_kept_up_to_the_cap_in_lru_order():
    pool, ledger = make(cap=3)
    _, blocks = step(pool, lambda: alloc(pool, 6))
    hashes = cache(pool, blocks)
    pool.free_blocks(blocks)  # vLLM frees a request's blocks last-first: ordered by eviction
    elastic, _ = step(pool, run=False)
    # the three oldest go, their hashes with them: no lookup can hit a block without pages
    assert elastic.release == [b.block_id for b in blocks[:3]], elastic.release
    for h in hashes[:3]:
        assert pool.cached_block_hash_to_block.get_one_block(h) is None
    for h, b in zip(hashes[3:], blocks[3:]):
        assert pool.cached_block_hash_to_block.get_one_block(h) is b
    assert elastic.budget_blocks == 3 + 2
    pool.step_done(elastic)
    assert ledger.held == 5 * BB


def case_new_pages_before_evicting_cached_blocks_then_lru():
    pool, ledger = make(num_blocks=11, cap=10, headroom=0, step=10)  # 10 blocks, all grantable
    _, blocks = step(pool, lambda: alloc(pool, 4))
    cache(pool, blocks)
    pool.free_blocks(blocks)
    step(pool)
    # 6 never-used blocks are granted before any of the 4 cached ones is evicted
    _, fresh = step(pool, lambda: alloc(pool, 6))
    assert not {b.block_id for b in fresh} & {b.block_id for b in blocks}
    assert all(b.block_hash is not None for b in blocks)
    # the budget is spent: the next block is the least recently used cached one, evicted
    _, more = step(pool, lambda: alloc(pool, 1))
    assert more[0] is blocks[0] and blocks[0].block_hash is None
    assert ledger.held == 10 * BB


def case_cached_blocks_beyond_the_cap_are_reused_before_new_pages():
    pool, ledger = make(cap=2, headroom=0)
    _, blocks = step(pool, lambda: alloc(pool, 5))
    hashes = cache(pool, blocks)
    pool.free_blocks(blocks)  # a request ends: 5 cached, 3 beyond the cap until settle()
    assert ledger.held == 5 * BB
    # the next request's 4 blocks: the 3 doomed ones (LRU first), then 1 new page; the 2 cached
    # blocks within the cap keep their pages and their hashes
    elastic, taken = step(pool, lambda: alloc(pool, 4))
    assert [b.block_id for b in taken[:3]] == [b.block_id for b in blocks[:3]], taken
    assert taken[3].block_id not in {b.block_id for b in blocks}
    assert elastic.release == [] and elastic.budget_blocks == 4 + 2
    for h in hashes[:3]:
        assert pool.cached_block_hash_to_block.get_one_block(h) is None
    for h, b in zip(hashes[3:], blocks[3:]):
        assert pool.cached_block_hash_to_block.get_one_block(h) is b
    assert ledger.held == 6 * BB  # one page more, none destroyed and made again
    # fewer blocks wanted than are doomed: the oldest is reused, the rest go at settle()
    cache(pool, taken, tag=1)
    pool.free_blocks(taken)  # queue, oldest first: blocks[3], blocks[4], taken[0..3]
    elastic, more = step(pool, lambda: alloc(pool, 1))
    assert more == [blocks[3]] and more[0].block_hash is None
    assert elastic.release == [blocks[4].block_id, taken[0].block_id, taken[1].block_id]
    assert pool.free_block_queue.num_free_blocks == 2
    assert ledger.held == 3 * BB  # 1 live + 2 cached; no headroom


def case_outside_schedule_the_blocks_taken_are_granted_when_taken():
    pool, ledger = make(max_blocks=5, headroom=0)
    assert pool.get_num_free_blocks() == 5 and ledger.held == 0  # a peek, no grant
    blocks = pool.get_new_blocks(5)
    assert len(blocks) == 5 and ledger.held == 5 * BB
    assert pool.get_num_free_blocks() == 0
    try:
        pool.get_new_blocks(1)
    except ValueError:
        pass
    else:
        raise AssertionError("a block beyond the budget was handed out")


def case_a_hit_on_a_cached_block_takes_no_grant():
    pool, ledger = make(cap=8, headroom=0)
    _, blocks = step(pool, lambda: alloc(pool, 3))
    cache(pool, blocks)
    pool.free_blocks(blocks)
    step(pool)
    held = ledger.held
    pool.begin_schedule()
    pool.touch(blocks)  # vLLM's hit: the blocks leave the free queue
    elastic = pool.settle()
    assert elastic.release == [] and ledger.held == held == 3 * BB


def case_what_is_counted_free_is_granted_before_it_is_taken():
    shared = tempfile.mkdtemp(prefix="vattention-pool-check-")
    a_ledger = PoolLedger.join(
        "check", 10 * BB, device="cpu", model="a", max_bytes=32 * BB, directory=shared
    )
    b_ledger = PoolLedger.join(
        "check", 10 * BB, device="cpu", model="b", max_bytes=32 * BB, directory=shared
    )
    a, _ = make(ledger=a_ledger, headroom=0, step=8)
    b, _ = make(ledger=b_ledger, headroom=0, step=8)
    a.begin_schedule()
    assert a.get_num_free_blocks() == 8  # A's check took 8 blocks' grant ...
    b.begin_schedule()
    assert b.get_num_free_blocks() == 2  # ... so B sees what is left, not the same blocks
    alloc(b, 2)
    alloc(a, 3)
    b_step, a_step = b.settle(), a.settle()
    assert a_ledger.held + b_ledger.held <= 10 * BB
    assert a_step.budget_blocks == 3 and b_step.budget_blocks == 2
    # A's unused grant went back at once: B may grow now
    b.begin_schedule()
    assert b.get_num_free_blocks() == 5
    b.settle()
    for ledger in (a_ledger, b_ledger):
        ledger.close()


def case_a_lowered_pool_budget_releases_cached_pages_first():
    shared = tempfile.mkdtemp(prefix="vattention-pool-check-")
    ledger = PoolLedger.join(
        "low", 20 * BB, device="cpu", model="a", max_bytes=32 * BB, directory=shared
    )
    pool, _ = make(ledger=ledger, cap=10, headroom=2)
    _, live = step(pool, lambda: alloc(pool, 4))
    _, old = step(pool, lambda: alloc(pool, 6))
    cache(pool, old)
    pool.free_blocks(old)
    step(pool)
    assert ledger.held == 12 * BB  # 4 live + 6 cached + 2 headroom
    from vattention.pool_ledger import set_budget

    set_budget("low", 7 * BB, directory=shared)
    elastic, _ = step(pool, run=False)
    # 5 over: 5 cached blocks go (oldest first), the headroom too; the live blocks stay
    assert elastic.release == [b.block_id for b in old[:5]]
    assert elastic.budget_blocks == 4 + 1 and elastic.headroom_blocks == 0
    pool.step_done(elastic)
    assert ledger.held == 5 * BB
    pool.begin_schedule()
    assert pool.get_num_free_blocks() == 1 + 2  # the cached one, plus 2 blocks within 7
    pool.settle()
    ledger.close()


def case_reset_prefix_cache_releases_every_cached_page():
    pool, ledger = make(cap=8)
    _, blocks = step(pool, lambda: alloc(pool, 3))
    cache(pool, blocks)
    pool.free_blocks(blocks)
    step(pool)
    assert pool.reset_prefix_cache()
    elastic, _ = step(pool)
    assert sorted(elastic.release) == [b.block_id for b in blocks]
    assert elastic.budget_blocks == 2


def case_unpinned_blocks_that_lose_their_pages_tell_their_reuse_watcher():
    # vLLM's HiSparse releases blocks with unpin_blocks() and keeps reading them until its
    # watcher says the pool reused them: pages released at settle() (beyond the cap) end the
    # blocks' content too, so the watcher fires for those, in the step that releases them.
    pool, ledger = make(num_blocks=6, cap=2, headroom=0)  # 5 blocks
    _, blocks = step(pool, lambda: alloc(pool, 5))
    cache(pool, blocks[:3])  # hashed or not, an unpinned block joins the free queue's tail
    reused = []
    pool.unpin_blocks(blocks, reused.append)
    assert reused == [] and pool.free_block_queue.num_free_blocks == 5
    elastic, _ = step(pool, run=False)
    assert elastic.release == [b.block_id for b in blocks[:3]]
    assert reused == blocks[:3]  # told before the worker runs the step that unmaps them
    pool.step_done(elastic)
    assert ledger.held == 2 * BB
    # the two kept ones: told when handed out again, as in vLLM's own pool, and only then
    # (the three released come back first, as new pages: no watcher of theirs is left)
    _, taken = step(pool, lambda: alloc(pool, 4))
    assert taken[3] is blocks[3] and reused == blocks[:4]


def case_an_unpinned_block_freed_without_a_hash_tells_its_watcher():
    # unpin_blocks() on a block another request still holds: the watcher waits; when that
    # request frees it, a block without a hash loses its pages at once, and the watcher fires.
    pool, _ = make(cap=4, headroom=0)
    _, blocks = step(pool, lambda: alloc(pool, 2))
    pool.touch(blocks)  # a second holder of both
    reused = []
    pool.unpin_blocks(blocks, reused.append)
    assert reused == [] and pool.free_block_queue.num_free_blocks == 0
    pool.free_blocks(blocks)
    assert reused == blocks
    elastic, _ = step(pool)
    assert sorted(elastic.release) == [b.block_id for b in blocks]


def case_the_schedulers_docstring_examples_run():
    import doctest

    from vattention.integrations.vllm import scheduler

    result = doctest.testmod(scheduler)
    assert result.attempted > 0 and result.failed == 0, result


def main() -> int:
    results = {}
    for name, fn in sorted(globals().items()):
        if name.startswith("case_"):
            try:
                fn()
                results[name[5:]] = "ok"
            except Exception:
                results[name[5:]] = traceback.format_exc()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
