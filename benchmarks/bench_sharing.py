"""Physical KV memory with prefix sharing vs without, vAttention pages vs vLLM-style blocks.

Workloads on request lengths from a trace (default: the packaged ShareGPT sample):
  * parallel sampling: n samples per prompt (n=4); every sample holds the prompt and its own
    output. Sample i's output length is the trace's decode length times 0.6 + 0.8 i/(n-1), so the
    mean equals the trace's. Memory: everything held at its final length, summed over prompts.
  * beam search: width W (4); every `segment` decode tokens (16) each new beam picks a parent
    among the current ones (probabilities 0.4/0.3/0.2/0.1, seeded): a parent chosen k times goes on
    as one child and is forked k-1 times; parents chosen by none are freed. Memory: the peak over
    the search, summed over prompts. Copies at fork time (the partial page/block) are reported.

Memory model: sharing is by whole units below the fork point, the partial unit is copied, as the
library does (vLLM copies on the first write instead; for these workloads the result is the same
because the parent always writes on). vAttention's unit is one page in every virtual tensor
(layer layout: 2 x layers tensors; mega: 2), vLLM's a 16-token block over all layers.

The vAttention columns are also MEASURED with the library (host backend) on the first
`--validate` prompts, with a small stand-in model that has the same tokens per page (bytes scale
exactly with the model), and the benchmark fails if measurement and arithmetic differ.

Run:  .venv/bin/python benchmarks/bench_sharing.py [--prompts 400] [--validate 40]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

import vattention
from vattention.bench.traces import load_trace

GiB = 1 << 30


@dataclass(frozen=True)
class Model:
    name: str = "Llama-3-8B"
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    element_bytes: int = 2

    @property
    def bytes_per_token(self) -> int:  # K and V, all layers
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_bytes


@dataclass(frozen=True)
class Scheme:
    """A sharing granularity: `tokens_per_unit` tokens cost `unit_bytes` bytes."""

    name: str
    tokens_per_unit: int
    unit_bytes: int


def vattention_scheme(model: Model, layout: str, page_bytes: int) -> Scheme:
    layer_token = model.num_kv_heads * model.head_dim * model.element_bytes
    token_bytes = layer_token * (model.num_layers if layout == "mega" else 1)
    tensors = 2 if layout == "mega" else 2 * model.num_layers
    label = (
        f"vAttention {layout} {page_bytes >> 10}KB"
        if page_bytes < (1 << 20)
        else f"vAttention {layout} {page_bytes >> 20}MB"
    )
    return Scheme(label, page_bytes // token_bytes, tensors * page_bytes)


def vllm_scheme(model: Model, block_tokens: int = 16) -> Scheme:
    return Scheme(
        f"vLLM paged, block {block_tokens}", block_tokens, block_tokens * model.bytes_per_token
    )


# ---- the arithmetic: sequences as lists of unit ids with reference counts ------------------------


class UnitPool:
    def __init__(self, tokens_per_unit: int, share: bool):
        self.tpu = tokens_per_unit
        self.share = share
        self.refs: Counter = Counter()
        self.next_id = 0
        self.copies = 0

    def _new(self, count):
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        self.refs.update(ids)
        return ids

    def grow(self, seq, new_len):
        need = -(-new_len // self.tpu)
        if need > len(seq):
            seq.extend(self._new(need - len(seq)))

    def fork(self, seq, length):
        if not self.share:
            return self._new(-(-length // self.tpu))
        full = length // self.tpu
        child = seq[:full]
        self.refs.update(child)
        if length % self.tpu:
            child += self._new(1)
            self.copies += 1
        return child

    def free(self, seq):
        self.refs.subtract(seq)
        for unit in set(seq):
            if self.refs[unit] == 0:
                del self.refs[unit]

    def live(self):
        return len(self.refs)


def sample_lengths(decode, n):
    if n == 1:
        return [decode]
    return [max(1, round(decode * (0.6 + 0.8 * i / (n - 1)))) for i in range(n)]


def parallel_sampling(pool: UnitPool, prompt, decode, n):
    parent = []
    pool.grow(parent, prompt)
    samples = [parent] + [pool.fork(parent, prompt) for _ in range(n - 1)]
    for seq, out in zip(samples, sample_lengths(decode, n)):
        pool.grow(seq, prompt + out)
    live = pool.live()
    for seq in samples:
        pool.free(seq)
    return live


def beam_parents(rng, width):
    p = np.array([0.4, 0.3, 0.2, 0.1][:width], dtype=float)
    return rng.choice(width, size=width, p=p / p.sum())


def beam_search(pool: UnitPool, prompt, decode, width, segment, seed):
    rng = np.random.default_rng(seed)
    first = []
    pool.grow(first, prompt)
    beams = [first] + [pool.fork(first, prompt) for _ in range(width - 1)]
    length, peak = prompt, pool.live()
    while length < prompt + decode:
        parents = beam_parents(rng, width)
        counts = Counter(parents.tolist())
        new = []
        for b, seq in enumerate(beams):
            k = counts.get(b, 0)
            if k == 0:
                pool.free(seq)
                continue
            new.append(seq)
            new.extend(pool.fork(seq, length) for _ in range(k - 1))
        beams = new
        length = min(prompt + decode, length + segment)
        for seq in beams:
            pool.grow(seq, length)
        peak = max(peak, pool.live())
    for seq in beams:
        pool.free(seq)
    return peak


def arithmetic(scheme: Scheme, trace, workload, share, args):
    pool = UnitPool(scheme.tokens_per_unit, share)
    units = 0
    for i, (prompt, decode) in enumerate(trace):
        if workload == "parallel":
            units += parallel_sampling(pool, int(prompt), int(decode), args.samples)
        else:
            units += beam_search(pool, int(prompt), int(decode), args.beam_width, args.segment, i)
    assert pool.live() == 0
    return units * scheme.unit_bytes, pool.copies * scheme.unit_bytes


# ---- the measurement: the same workloads through the library -------------------------------------


def stand_in(model: Model, layout: str, page_bytes: int, max_seq: int, max_batch: int):
    """A one-layer config with the same tokens per page, pages a multiple of 4 KB; and the factor
    from its bytes to the model's."""
    tpp = vattention_scheme(model, layout, page_bytes).tokens_per_unit
    heads = 1
    while (tpp * heads * model.head_dim * 2) % 4096:
        heads *= 2
    cfg = vattention.KVCacheConfig(
        num_layers=1,
        num_kv_heads=heads,
        head_dim=model.head_dim,
        max_batch_size=max_batch,
        max_seq_len=max_seq,
        dtype=torch.bfloat16,
        page_size=tpp * heads * model.head_dim * 2,
        layout=layout,
        reclaim="eager",
    )
    unit_bytes = vattention_scheme(model, layout, page_bytes).unit_bytes
    factor = unit_bytes / (cfg.num_tensors * cfg.page_bytes)
    return cfg, factor


def measured(model, layout, page_bytes, trace, workload, args):
    width = args.samples if workload == "parallel" else args.beam_width
    max_seq = max(int(p) + max(sample_lengths(int(d), width)) for p, d in trace)
    cfg, factor = stand_in(model, layout, page_bytes, max_seq, 2 * width)
    pages = 0
    with vattention.KVCache(cfg) as cache:
        for i, (prompt, decode) in enumerate(trace):
            prompt, decode = int(prompt), int(decode)
            parent = cache.alloc()
            cache.step({parent: prompt})
            if workload == "parallel":
                samples = [parent] + [cache.fork(parent) for _ in range(width - 1)]
                outs = sample_lengths(decode, width)
                cache.step({s: prompt + out for s, out in zip(samples, outs)})
                pages += cache.stats()["pages_mapped"]
            else:
                rng = np.random.default_rng(i)
                beams = [parent] + [cache.fork(parent) for _ in range(width - 1)]
                length, peak = prompt, cache.stats()["pages_mapped"]
                while length < prompt + decode:
                    counts = Counter(beam_parents(rng, width).tolist())
                    new = []
                    for b, slot in enumerate(beams):
                        k = counts.get(b, 0)
                        if k == 0:
                            cache.free(slot)
                            continue
                        new.append(slot)
                        new.extend(cache.fork(slot, length) for _ in range(k - 1))
                    beams = new
                    length = min(prompt + decode, length + args.segment)
                    cache.step({s: length for s in beams})
                    peak = max(peak, cache.stats()["pages_mapped"])
                pages += peak
                samples = beams
            for s in samples:
                cache.free(s)
            assert cache.stats()["pages_mapped"] == 0, cache.stats()
    return round(pages * cfg.page_bytes * factor)


def fits_host_mappings(model, layout, page_bytes, trace, workload, args, limit=24_000):
    """The first --validate requests whose mappings stay under the host backend's share of
    vm.max_map_count (about 28,000 page mappings by default):
    every slot maps each of its pages, shared or not, and the host backend needs one mmap each."""
    width = args.samples if workload == "parallel" else 2 * args.beam_width
    tpp = vattention_scheme(model, layout, page_bytes).tokens_per_unit
    keep = [row for row in trace if -(-(int(row[0]) + 2 * int(row[1])) // tpp) * 2 * width <= limit]
    return np.array(keep[: args.validate]).reshape(-1, 2)


# ---- report --------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default="sharegpt")
    ap.add_argument("--prompts", type=int, default=400, help="first N requests of the trace")
    ap.add_argument(
        "--validate", type=int, default=40, help="requests also run through the library (0: none)"
    )
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--segment", type=int, default=16, help="decode tokens between beam re-forks")
    args = ap.parse_args()
    model = Model()
    trace = load_trace(args.trace)[: args.prompts]
    print(
        f"{model.name} ({model.bytes_per_token >> 10} KiB/token), {len(trace)} requests of "
        f"{args.trace}: mean prompt {trace[:, 0].mean():.0f}, "
        f"mean output {trace[:, 1].mean():.0f}"
    )
    vllm = vllm_scheme(model)
    configs = [(layout, page) for layout in ("layer", "mega") for page in (2 << 20, 64 << 10)]
    for workload, title in (
        ("parallel", f"parallel sampling, n={args.samples}"),
        ("beam", f"beam search, width {args.beam_width}, re-fork every {args.segment} tokens"),
    ):
        start = time.time()
        v_private, _ = arithmetic(vllm, trace, workload, False, args)
        v_shared, v_copied = arithmetic(vllm, trace, workload, True, args)
        print(f"\n## {title}")
        print(
            f"{'scheme':<28}{'no sharing GiB':>15}{'sharing GiB':>13}{'ratio':>8}"
            f"{'vs vLLM shared':>16}{'copied GiB':>12}{'checked':>9}"
        )
        print(
            f"{vllm.name:<28}{v_private / GiB:>15.2f}{v_shared / GiB:>13.2f}"
            f"{v_shared / v_private:>8.3f}{1.0:>16.3f}{v_copied / GiB:>12.2f}{'':>9}"
        )
        for layout, page in configs:
            scheme = vattention_scheme(model, layout, page)
            private, _ = arithmetic(scheme, trace, workload, False, args)
            shared, copied = arithmetic(scheme, trace, workload, True, args)
            checked = ""
            if args.validate:
                sub = fits_host_mappings(model, layout, page, trace, workload, args)
                want, _ = arithmetic(scheme, sub, workload, True, args)
                got = measured(model, layout, page, sub, workload, args)
                if got != want:
                    raise SystemExit(
                        f"{scheme.name} {workload}: library {got} bytes, arithmetic {want} bytes"
                    )
                checked = f"{len(sub)} req"
            print(
                f"{scheme.name:<28}{private / GiB:>15.2f}{shared / GiB:>13.2f}"
                f"{shared / private:>8.3f}{shared / v_shared:>16.3f}{copied / GiB:>12.2f}"
                f"{checked:>9}"
            )
        print(f"({time.time() - start:.1f} s)")


if __name__ == "__main__":
    main()
