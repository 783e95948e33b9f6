"""Host time of one decode step's ``update()`` calls: VAttentionCache against transformers'
DynamicCache, measured in the same run.

A decode step of a transformers model calls ``cache.update(k, v, layer)`` once per layer. On a GPU
the kernels run asynchronously and what the cache costs the step is the host time of those calls
(the first GPU run measured 1089 us for VAttentionCache against 432 us for DynamicCache, 16 layers
x batch 8; ``make gpu-check``'s generate part measures it there with this module). On a CPU the
calls also do their memory work synchronously, so two shapes are measured:

* ``dispatch``: 16 cached tokens. DynamicCache's ``torch.cat`` copies a few KB: both sides are
  bound by Python and torch dispatch, the part a GPU's host also pays.
* ``llama-1b``: Llama-3.2-1B's KV shape with 1024 cached tokens (bf16, batch 8). DynamicCache
  re-copies its whole cache every step here (16 MB a layer), VAttentionCache writes one token:
  the ratio is this CPU's memory traffic, not a GPU's host time.

Each timed step is one decode step at the same length: both caches are cropped back between steps
(untimed). Rounds alternate the caches (A B C C B A ...), after a warm-up; each sample is the mean
of ``--steps`` steps; min and median over the rounds. ``step()``'s own cost with nothing to map
(VAttentionCache calls it once per forward, in the first layer) is measured alone beside them.

    python benchmarks/bench_hf_update.py [--rounds 8] [--steps 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
from transformers import DynamicCache

import vattention
from vattention.integrations.transformers import VAttentionCache

SHAPES = {
    # name: (layers, batch, kv heads, head dim, cached tokens, dtype)
    "dispatch": (16, 8, 8, 64, 16, torch.bfloat16),
    "llama-1b": (16, 8, 8, 64, 1024, torch.bfloat16),
}


def make_caches(layers, batch, heads, dim, cached, dtype, device="cpu"):
    """name -> (cache, (k, v) of one new token): each prefilled with ``cached`` tokens."""
    cfg = vattention.KVCacheConfig(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=dim,
        max_batch_size=batch,
        max_seq_len=cached + 64,
        dtype=dtype,
        device=device,
        page_size="2MB",
        scrub=True,
    )
    caches = {
        "DynamicCache": DynamicCache(),
        "VAttentionCache": VAttentionCache(vattention.KVCache(cfg), owns_cache=True),
    }
    if "compileable" in VAttentionCache.__init__.__code__.co_varnames:  # absent before it existed
        caches["VAttentionCache(compileable)"] = VAttentionCache(
            vattention.KVCache(cfg), owns_cache=True, compileable=True
        )
    prompt = torch.randn(batch, heads, cached, dim, device=device).to(dtype)
    for cache in caches.values():
        for layer in range(layers):
            cache.update(prompt, prompt, layer)
    new = torch.randn(batch, heads, 1, dim, device=device).to(dtype)
    return caches, (new, new.clone())


def timed_step(cache, layers: int, k, v, cached: int) -> float:
    """Seconds of one decode step's update() calls at ``cached`` tokens; then crop back."""
    if getattr(cache, "compileable", False):
        cache.prepare_forward(1)  # generate() calls it through get_mask_sizes: outside update()
    elif isinstance(cache, VAttentionCache):
        cache._backed_len = cached  # as in generate(): the first layer's step() maps (or not)
    t0 = time.perf_counter()
    for layer in range(layers):
        cache.update(k, v, layer)
    elapsed = time.perf_counter() - t0
    cache.crop(-1)  # drop the token again (transformers 5.23 refuses a positive length)
    if k.is_cuda:  # the next step starts with an empty queue: only host time is timed
        torch.cuda.synchronize()
    return elapsed


def step_alone(cache: VAttentionCache, cached: int) -> Callable[[], None]:
    lens = dict.fromkeys(cache.slots, cached + 1)
    return lambda: cache.kv_cache.step(lens)


def measure(
    shape: str, rounds: int, steps: int, device: str = "cpu", quiet: bool = False
) -> list[dict]:
    """Print (unless ``quiet``) and return one row per cache: update() host time of a decode
    step, min / median over the rounds, and its ratio to DynamicCache's."""
    layers, batch, heads, dim, cached, dtype = SHAPES[shape]
    caches, (k, v) = make_caches(layers, batch, heads, dim, cached, dtype, device)
    names = list(caches)
    for name in names:  # warm-up: allocator, first calls
        for _ in range(5):
            timed_step(caches[name], layers, k, v, cached)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            t = [timed_step(caches[name], layers, k, v, cached) for _ in range(steps)]
            samples[name].append(sum(t) / steps)
    step_fn = step_alone(caches["VAttentionCache"], cached)
    step_fn()
    t0 = time.perf_counter()
    for _ in range(1000):
        step_fn()
    step_us = (time.perf_counter() - t0) / 1000 * 1e6
    base = samples["DynamicCache"]
    rows = []
    for name in names:
        t = samples[name]
        rows.append(
            {
                "update() host time": name,
                "shape": f"{shape}: {layers} layers, batch {batch}, {cached} cached",
                "step_us": f"{min(t) * 1e6:.0f} / {statistics.median(t) * 1e6:.0f}",
                "per_layer_us": round(statistics.median(t) / layers * 1e6, 1),
                "over_DynamicCache": f"{min(t) / min(base):.2f} / "
                f"{statistics.median(t) / statistics.median(base):.2f}",
            }
        )
    rows.append({"KVCache.step() alone, nothing to map (us)": round(step_us, 1)})
    for cache in caches.values():
        if isinstance(cache, VAttentionCache):
            cache.close()
    if not quiet:
        print(
            f"\n{shape}: {layers} layers, batch {batch}, {heads} KV heads x {dim}, {cached} "
            f"cached, {str(dtype).replace('torch.', '')}; {rounds} rounds x {steps} steps"
        )
        print("| cache | step us (min / median) | per layer us (median) | / DynamicCache |")
        print("|---|---:|---:|---:|")
        for row in rows[:-1]:
            print(
                f"| {row['update() host time']} | {row['step_us']} | {row['per_layer_us']} "
                f"| {row['over_DynamicCache']} |"
            )
        print(f"KVCache.step() with nothing to map, alone: {step_us:.1f} us (once per forward)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"CPU only (no GPU): torch {torch.__version__}, 1 thread, load average {load}")
    for shape in args.shape or list(SHAPES):
        measure(shape, args.rounds, args.steps)


if __name__ == "__main__":
    main()
