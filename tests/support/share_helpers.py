"""Helpers of the sharing and swap tests: cheap deterministic patterns and sized caches.

`fast_fill` copies slices of one cached random pool instead of drawing new random numbers: a 2 MB
page holds a million elements, and generating data for every page would dominate the tests. Its
result works with helpers.check_pattern.
"""

from __future__ import annotations

import torch

from .helpers import kv_views

_POOL = {}


def _pool(dtype, numel):
    pool = _POOL.get(dtype)
    if pool is None or pool.numel() < numel:
        size = max(numel, 1 << 20) * 2
        pool = torch.randn(size, generator=torch.Generator().manual_seed(1234)).to(dtype)
        _POOL[dtype] = pool
    return pool


def fast_fill(cache, slot, start, end, seed):
    """Write data unique to (seed, layer, K/V, start) into tokens [start, end) of `slot`."""
    cfg = cache.config
    written = []
    for layer in range(cfg.num_layers):
        shape = (end - start, cfg.layer_kv_heads[layer], cfg.layer_head_dims[layer])
        numel = shape[0] * shape[1] * shape[2]
        pool = _pool(cfg.dtype, numel + 100_003)
        k, v = kv_views(cache, layer)
        pair = []
        for kv, tensor in enumerate((k, v)):
            offset = (seed * 7919 + layer * 211 + kv * 101 + start * 13) % 100_003
            data = pool[offset : offset + numel].view(shape)
            tensor[slot, start:end] = data
            pair.append(data)
        written.append(tuple(pair))
    return written


def prefix(written, n):
    """The first n tokens of a fast_fill/fill_pattern result."""
    return [(k[:n], v[:n]) for k, v in written]


def paged_cache(make_cache, pages=4, **kwargs):
    """A cache whose slots hold `pages` pages per tensor (so multi-page cases exist at 2 MB too)."""
    probe = make_cache(**{**kwargs, "max_batch_size": 1, "max_seq_len": 1})
    tpp = probe.config.tokens_per_page
    probe.close()
    return make_cache(max_seq_len=pages * tpp, **kwargs)


def bits(tensor):
    """The tensor's raw bits as integers, on the CPU: exact comparison, and far faster than
    float16 equality on a CPU busy with other work (torch's float16 paths spin up its thread
    pool). On the CPU because the other side of a comparison is usually a CPU tensor, and a
    GPU cache's tensors are not (the emulation's are host memory, so it cannot catch a mix)."""
    return tensor.cpu().view(
        {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    )


def check_pattern(cache, slot, start, end, written):
    """Bit-exact version of helpers.check_pattern."""
    for layer, (kd, vd) in enumerate(written):
        k, v = kv_views(cache, layer)
        assert torch.equal(bits(k[slot, start:end]), bits(kd)), f"K of layer {layer} slot {slot}"
        assert torch.equal(bits(v[slot, start:end]), bits(vd)), f"V of layer {layer} slot {slot}"
