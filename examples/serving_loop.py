"""Continuous batching on a vattention cache: admission, growth, completion, preemption.

A toy scheduler serves synthetic requests (prompt and output lengths drawn from a seeded RNG) under
a physical memory budget small enough that the batch runs out of pages. Each iteration:

1. **admit** waiting requests while a slot is free and ``capacity()`` says the prompt fits with
   one more page of growth for every running request (it runs ``step()``'s accounting and maps
   nothing; otherwise the request waits), then ``alloc()`` and one ``step()``;
2. **grow** every running request by one token with one ``step()``; on ``OutOfPagesError`` the
   newest request is **preempted** (slot freed, progress dropped, requeued first) and the step is
   retried -- the error is recoverable because the failed step changed nothing;
3. **compute** one decode step per layer with :func:`vattention.integrations.flash_attn.decode`
   (flash-attn on GPUs, the SDPA reference here), appending each token's K/V in place;
4. **complete** finished requests: ``free(slot)``; their pages stay mapped for the next admission
   (deferred reclamation) until another slot needs them.

Every K row a request writes encodes (request id, position); on completion the script checks the
row, so a page shared by mistake between requests would be caught.

Run: ``python examples/serving_loop.py [--requests 48] [--budget-pages 96]``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import random

import torch

import vattention
from vattention.integrations import flash_attn as fa


@dataclasses.dataclass
class Request:
    rid: int
    prompt_len: int
    output_len: int
    generated: int = 0
    slot: int = -1

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.generated


def key_pattern(rid: int, start: int, end: int, heads: int, dim: int) -> torch.Tensor:
    """K rows that encode (request, position): checked when the request completes."""
    pos = torch.arange(start, end, dtype=torch.float32)
    return (rid * 1000 + pos).view(-1, 1, 1).expand(-1, heads, dim)


class Server:
    def __init__(self, cache: vattention.KVCache, heads: int) -> None:
        self.cache, self.cfg, self.heads = cache, cache.config, heads
        self.running: dict[int, Request] = {}  # slot -> request, in admission order
        self.preemptions = 0
        self.deferred_admissions = 0  # capacity() said no: the request waited (nothing raised)
        self.peak_pages = 0

    def admit(self, waiting: collections.deque) -> None:
        while waiting and len(self.running) < self.cfg.max_batch_size:
            req = waiting[0]
            # Admit only if the prompt fits AND every running request can still grow by a page
            # (a watermark), so admission rarely forces the preemption of a running request.
            # capacity() runs step()'s accounting and maps nothing.
            ahead = self.cfg.tokens_per_page
            lengths = {
                s: min(r.seq_len + ahead, r.prompt_len + r.output_len)
                for s, r in self.running.items()
            }
            if not self.cache.capacity(lengths, new_requests=[req.prompt_len]).fits:
                self.deferred_admissions += 1
                return
            slot = self.cache.alloc()
            lengths[slot] = req.prompt_len
            self.cache.step(lengths)  # fits: capacity() said so, and nothing ran in between
            waiting.popleft()
            req.slot, req.generated = slot, 0
            self.running[slot] = req
            self.prefill(req)

    def prefill(self, req: Request) -> None:
        n, hkv, dim = req.prompt_len, self.cfg.num_kv_heads, self.cfg.head_dim
        for layer in range(self.cfg.num_layers):
            k_cache, v_cache = self.cache.layer(layer)
            keys = key_pattern(req.rid, 0, n, hkv, dim).to(self.cfg.dtype)
            fa.prefill(
                torch.randn(n, self.heads, dim, dtype=self.cfg.dtype),
                keys,
                torch.randn(n, hkv, dim, dtype=self.cfg.dtype),
                k_cache,
                v_cache,
                req.slot,
            )

    def grow(self, waiting: collections.deque) -> None:
        while self.running:
            try:
                self.cache.step({slot: r.seq_len + 1 for slot, r in self.running.items()})
                return
            except vattention.OutOfPagesError:
                slot, victim = list(self.running.items())[-1]  # newest request
                del self.running[slot]
                self.cache.free(slot)
                victim.generated, victim.slot = 0, -1  # recompute from the prompt
                waiting.appendleft(victim)
                self.preemptions += 1

    def decode(self) -> None:
        slots = list(self.running)
        reqs = [self.running[s] for s in slots]
        n, hkv, dim, dtype = len(slots), self.cfg.num_kv_heads, self.cfg.head_dim, self.cfg.dtype
        lens = torch.tensor([r.seq_len for r in reqs])
        new_k = torch.stack(
            [key_pattern(r.rid, r.seq_len, r.seq_len + 1, hkv, dim) for r in reqs]
        ).to(dtype)
        for layer in range(self.cfg.num_layers):
            k_cache, v_cache = self.cache.layer(layer)
            fa.decode(
                torch.randn(n, 1, self.heads, dim, dtype=dtype),
                k_cache,
                v_cache,
                new_k,
                torch.randn(n, 1, hkv, dim, dtype=dtype),
                lens,
                torch.tensor(slots),
            )
        for r in reqs:
            r.generated += 1
        self.peak_pages = max(self.peak_pages, self.cache.stats()["pages_mapped"])

    def complete(self) -> list[Request]:
        done = [r for r in self.running.values() if r.generated >= r.output_len]
        for r in done:
            rows = self.cache.layer(0)[0][r.slot, : r.seq_len].float()
            expected = key_pattern(r.rid, 0, r.seq_len, self.cfg.num_kv_heads, self.cfg.head_dim)
            if not torch.equal(rows, expected):
                raise AssertionError(f"request {r.rid}: K rows were overwritten")
            del self.running[r.slot]
            self.cache.free(r.slot)
        return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument(
        "--budget-pages",
        type=int,
        default=96,
        help="physical memory budget, in pages of --page-size",
    )
    parser.add_argument("--page-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(1)  # tiny tensors: extra threads only add overhead
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    requests = [Request(i, rng.randint(8, 120), rng.randint(4, 96)) for i in range(args.requests)]
    cfg = vattention.KVCacheConfig(
        num_layers=2,
        num_kv_heads=2,
        head_dim=32,
        max_batch_size=12,
        max_seq_len=256,
        dtype=torch.float32,
        device="cpu",
        page_size=args.page_size,
        layout="layer",
    )
    budget = args.budget_pages * cfg.page_bytes
    print(
        f"{len(requests)} requests, {cfg.max_batch_size} slots, {cfg.tokens_per_page} tokens "
        f"per page, budget {args.budget_pages} pages ({budget // 1024} KiB) vs "
        f"{cfg.static_bytes // 1024} KiB for a static cache"
    )

    waiting = collections.deque(requests)
    finished: list[Request] = []
    iterations = 0
    with vattention.KVCache(cfg, memory_budget=budget) as cache:
        server = Server(cache, heads=4)
        while waiting or server.running:
            server.admit(waiting)
            if not server.running:
                raise SystemExit(f"request {waiting[0].rid} cannot fit in the budget alone")
            server.grow(waiting)
            if server.running:
                server.decode()
            finished += server.complete()
            iterations += 1
        stats = cache.stats()
    print(
        f"iterations {iterations}, completed {len(finished)}/{len(requests)}, "
        f"preemptions {server.preemptions}, peak pages mapped {server.peak_pages}/"
        f"{args.budget_pages}, map calls {stats['map_calls']}"
    )
    print(
        f"OutOfPagesError {stats['oom_events']} times (each one preempted a request); admissions "
        f"deferred by capacity() {server.deferred_admissions} times (no error: nothing was mapped)"
    )
    ok = len(finished) == len(requests) and server.peak_pages <= args.budget_pages
    print("all requests completed, K rows intact:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
