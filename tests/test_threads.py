"""Thread-safety: Python threads hammer one cache while its prefetch thread works."""

from __future__ import annotations

import gc
import os
import random
import threading
import time

import pytest
import torch
from test_sparse import rss_shmem_bytes

import vattention

from support.helpers import kv_views

MIN_SECONDS = 1.5  # of concurrent hammering, at the least
MIN_STEPS = 200  # successful steps, at the least (1.5 s gives thousands on a 2-core VM)
HANG_S = 120.0  # no normal run comes near it


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.not_on_gpu("64 KB pages (a GPU takes 2 MB) and host-memory checks (fds, RSS)")
def test_concurrent_alloc_step_prefetch_free_stats(device, layout):
    gc.collect()  # earlier tests' garbage must not close descriptors during this one
    fds, rss = open_fds(), rss_shmem_bytes()
    cfg = vattention.KVCacheConfig(
        num_layers=2,
        num_kv_heads=4,
        head_dim=64,
        max_batch_size=16,
        max_seq_len=4096,
        dtype=torch.float16,
        page_size="64KB",
        layout=layout,
        device=device,
    )
    cache = vattention.KVCache(cfg, memory_budget="24MB")
    errors, counts = [], {"steps": 0, "oom": 0, "no_slot": 0}
    # Counted, not timed: the threads hammer for at least MIN_SECONDS and at least MIN_STEPS
    # successful steps, so a slow or loaded machine runs longer instead of checking less. The
    # deadline only guards against a hang (a normal run reaches MIN_STEPS well within
    # MIN_SECONDS); reaching it fails the test below.
    started = time.monotonic()
    hang_deadline = started + HANG_S
    lock = threading.Lock()

    def done() -> bool:
        now = time.monotonic()
        with lock:
            steps = counts["steps"]
        return now >= hang_deadline or (now >= started + MIN_SECONDS and steps >= MIN_STEPS)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine = {}  # slot -> length; only this thread frees its slots
        try:
            while not done():
                op = rng.random()
                if op < 0.2 and len(mine) < 4:
                    try:
                        mine[cache.alloc()] = 0
                    except vattention.InvalidSlotError:
                        with lock:
                            counts["no_slot"] += 1
                elif op < 0.6 and mine:
                    lens = {
                        s: min(cfg.max_seq_len, n + rng.randint(1, 300)) for s, n in mine.items()
                    }
                    try:
                        cache.step(lens)
                        mine.update(lens)
                        k, v = kv_views(cache, 0)
                        for s, n in lens.items():
                            k[s, n - 1] = float(s)  # the last token must be backed
                        with lock:
                            counts["steps"] += 1
                    except vattention.OutOfPagesError:
                        with lock:
                            counts["oom"] += 1
                        s = rng.choice(list(mine))  # preempt one of ours
                        cache.free(s)
                        del mine[s]
                elif op < 0.75 and mine:
                    cache.prefetch({s: min(cfg.max_seq_len, n + 64) for s, n in mine.items()})
                elif op < 0.85 and mine:
                    s = rng.choice(list(mine))
                    cache.free(s)
                    del mine[s]
                elif op < 0.9:
                    cache.reclaim()
                else:
                    stats = cache.stats()
                    assert stats["pages_free"] + stats["pages_mapped"] == stats["pages_total"]
            for s in mine:
                cache.free(s)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    cache.wait()
    assert counts["steps"] >= MIN_STEPS, f"fewer than {MIN_STEPS} steps in {HANG_S} s: {counts}"
    assert cache._core.check_invariants() == ""
    stats = cache.stats()
    assert stats["active_slots"] == 0
    assert stats["pages_total"] * cfg.page_bytes <= 24 << 20
    cache.close()
    cache = None  # drop the last reference (worker() shares the variable: `del` reads as F821)
    gc.collect()
    assert open_fds() <= fds  # memfd arenas closed
    assert rss_shmem_bytes() - rss < (1 << 20)  # and their memory returned
