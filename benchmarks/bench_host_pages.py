"""Host backend pages in 2 MB huge pages of the OS against 4 KB ones (host/host_backend.h).

Two caches of the same geometry live in one process: one whose pages were gathered into 2 MB
folios (the default where the page size is a whole number of 2 MB and the kernel has
MADV_COLLAPSE), one made with ``VATTENTION_HOST_HUGE_PAGES=0`` (4 KB pages, the baseline). Both
are warmed up, then timed alternately (A B B A), min and median printed:

- **remap**: 16 rows take tables of 7 blocks each, rotated every round so that every row maps
  other blocks' existing pages (unmap, map, populate: what `step()` does when an engine hands a
  row new blocks); no page is created.
- **read**: `sum()` over every row's K (all layers), every row mapped: a streaming read through
  the cache's mappings, where the two page sizes differ only in TLB reach.
- **decode**: one decode attention call (`flash_attn_with_kvcache`, one query token per row) over
  layer 0 of every row: in the mega layout a layer's K and V are `1 / layers` of every token's
  row, so each token's read lands in another 4 KB page, where the page sizes differ most.
- **create**: a new cache and its first step, which creates every page (the one-time cost the
  huge pages add: the collapse copies each page once).

Every token's K and V hold a mark of its row and position, the same in both caches; the run stops
if the caches' sums or attention outputs differ, or if the outputs differ from the attention the
marks imply (a page mapped at the wrong row or place).

    .venv/bin/python benchmarks/bench_host_pages.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import vattention  # noqa: E402

from _timing import compare_min_median  # noqa: E402

ROWS, BLOCKS_PER_ROW = 16, 7


@contextlib.contextmanager
def huge_pages(on: bool):
    old = os.environ.get("VATTENTION_HOST_HUGE_PAGES")
    os.environ["VATTENTION_HOST_HUGE_PAGES"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["VATTENTION_HOST_HUGE_PAGES"]
        else:
            os.environ["VATTENTION_HOST_HUGE_PAGES"] = old


def config(layers: int) -> vattention.KVCacheConfig:
    # mega layout, 128 tokens a page: layers x 8 KV heads x 64 x 4 bytes x 128 = layers x 256 KB.
    return vattention.KVCacheConfig(
        num_layers=layers,
        num_kv_heads=8,
        head_dim=64,
        max_batch_size=ROWS,
        max_seq_len=4096,
        dtype=torch.float32,
        page_size=layers * (256 << 10),
        layout="mega",
        device="cpu",
        num_blocks=ROWS * BLOCKS_PER_ROW + 1,
        block_cache=True,
    )


def tables(slots, rotate: int = 0):
    """Block tables for `slots`: row i takes the 7 blocks of row (i + rotate) % ROWS."""
    return {
        s: (
            0,
            list(
                range(
                    1 + BLOCKS_PER_ROW * ((i + rotate) % ROWS),
                    1 + BLOCKS_PER_ROW * ((i + rotate) % ROWS + 1),
                )
            ),
            0,
        )
        for i, s in enumerate(slots)
    }


def marks(tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """[ROWS, tokens]: token t of row i is marked (i * tokens + t) / (ROWS * tokens)."""
    return (torch.arange(ROWS * tokens, dtype=dtype) / (ROWS * tokens)).view(ROWS, tokens)


class Remapper:
    """A cache whose rows are handed rotated block tables, one round per call."""

    def __init__(self, cfg: vattention.KVCacheConfig, huge: bool) -> None:
        with huge_pages(huge):
            self.cache = vattention.KVCache(cfg)
        self.tokens = BLOCKS_PER_ROW * cfg.tokens_per_page
        self.round = 0
        self.call()  # creates every page once
        self.huge_bytes = self.cache.stats()["huge_page_bytes"]

    def call(self) -> None:
        slots = [self.cache.alloc() for _ in range(ROWS)]
        self.cache.step({s: self.tokens for s in slots}, blocks=tables(slots, self.round))
        for s in slots:
            self.cache.free(s)
        self.round += 1

    def reader(self):
        slots = [self.cache.alloc() for _ in range(ROWS)]
        self.cache.step({s: self.tokens for s in slots}, blocks=tables(slots))
        k, v = self.cache.mega_tensors()  # [rows, tokens, layers, heads, head_dim]
        rows = k[:, : self.tokens]
        # every token's K and V hold its own (row, token) mark, the same in both caches, so a page
        # mapped at the wrong row or place changes the sums and the attention outputs compared
        mark = marks(self.tokens, torch.float32).view(ROWS, self.tokens, 1, 1, 1)
        rows.copy_(mark.expand_as(rows))
        v[:, : self.tokens].copy_((1.0 - mark).expand_as(rows))
        return lambda: rows.sum()

    def decoder(self):
        """Decode attention over layer 0 of every row (the rows `reader` mapped)."""
        from vattention.integrations.flash_attn import flash_attn_with_kvcache

        k, v = self.cache.layer(0)
        q = torch.randn(ROWS, 1, k.shape[2], k.shape[3], generator=torch.Generator().manual_seed(0))
        self.q = q
        lens = torch.full((ROWS,), self.tokens, dtype=torch.int32)
        return lambda: flash_attn_with_kvcache(
            q, k[:ROWS], v[:ROWS], cache_seqlens=lens, causal=True
        )

    def expected_decode(self) -> torch.Tensor:
        """What `decoder` must return, from the marks `reader` wrote: token t of row i has K =
        m[i, t] and V = 1 - m[i, t] in every element."""
        m = marks(self.tokens, torch.float64).view(ROWS, 1, self.tokens)
        q = self.q.double()[:, 0]  # [rows, heads, head_dim]
        scores = m * q.sum(-1, keepdim=True) / q.shape[-1] ** 0.5  # [rows, heads, tokens]
        out = (scores.softmax(-1) * (1.0 - m)).sum(-1)  # [rows, heads]
        return out[:, None, :, None].expand_as(self.q).float()


def create_once(cfg: vattention.KVCacheConfig, huge: bool) -> None:
    with huge_pages(huge):
        cache = vattention.KVCache(cfg)
    with cache:
        slots = [cache.alloc() for _ in range(ROWS)]
        cache.step({s: BLOCKS_PER_ROW * cfg.tokens_per_page for s in slots}, blocks=tables(slots))


def fmt(t) -> str:
    return f"{t[0] * 1e3:.2f} ({t[1] * 1e3:.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    print(
        f"{ROWS} rows x {BLOCKS_PER_ROW} blocks of 128 tokens, mega layout, fp32, 8 KV heads x "
        f"64; {torch.get_num_threads()} thread(s); load average {os.getloadavg()[0]:.2f}\n"
    )
    print(
        "| layers | page | huge pages in use | remap ms, huge (4 KB) | ratio | "
        "read ms, huge (4 KB) | ratio | decode ms, huge (4 KB) | ratio | "
        "create ms, huge (4 KB) | ratio |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layers in (4, 8, 16):
        cfg = config(layers)
        caches = {"huge": Remapper(cfg, True), "4k": Remapper(cfg, False)}
        in_use = caches["huge"].huge_bytes
        state = (
            "n/a (page not whole 2 MB)"
            if in_use < 0
            else "yes"
            if in_use > 0
            else "no (the kernel would not)"
        )
        remap = compare_min_median(
            {n: c.call for n, c in caches.items()}, calls=3, rounds=args.rounds
        )
        readers = {n: c.reader() for n, c in caches.items()}
        sums = {n: float(r()) for n, r in readers.items()}
        if sums["huge"] != sums["4k"] or sums["huge"] <= 0:  # the same marks through both
            raise SystemExit(f"the two caches read differently: {sums}")
        read = compare_min_median(readers, calls=3, rounds=args.rounds)
        decoders = {n: c.decoder() for n, c in caches.items()}
        outs = {n: d() for n, d in decoders.items()}
        if not torch.equal(outs["huge"], outs["4k"]):
            raise SystemExit("the two caches' attention outputs differ")
        expected = caches["huge"].expected_decode()
        if not torch.allclose(outs["huge"], expected, rtol=1e-4, atol=1e-5):
            err = (outs["huge"] - expected).abs().max().item()
            raise SystemExit(f"the attention outputs differ from the marks' (max error {err:.3g})")
        decode = compare_min_median(decoders, calls=5, rounds=args.rounds)
        for c in caches.values():
            c.cache.close()
        create = compare_min_median(
            {"huge": lambda: create_once(cfg, True), "4k": lambda: create_once(cfg, False)},
            calls=1,
            rounds=args.rounds,
        )
        cells = []
        for t in (remap, read, decode, create):
            cells.append(f"{fmt(t['huge'])} ({fmt(t['4k'])}) | {t['huge'][1] / t['4k'][1]:.2f}")
        print(f"| {layers} | {cfg.page_bytes >> 10} KB | {state} | " + " | ".join(cells) + " |")
    print(
        "\nms: min (median) per call; ratio: huge / 4 KB medians. load average at end "
        f"{os.getloadavg()[0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
