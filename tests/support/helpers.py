"""Test helpers shared by several test modules."""

from __future__ import annotations

import pytest
import torch

from .one_device import as_device_view

_DRIVER_ENTRY = {
    "map": "cuMemMap",
    "set_access": "cuMemSetAccess",
    "create_page": "cuMemCreate",
    "unmap": "cuMemUnmap",
    "destroy_page": "cuMemRelease",
}


def inject_backend_fault(cache, op, nth):
    """Make the nth call (1 = next) of backend primitive `op` fail with a driver error.

    Host backend: its fault hook. CUDA backend: the emulated driver entry point behind `op`.
    Returns (the `call` the DriverError will carry, a regex its message matches).
    """
    if cache.config.device == "cpu":
        cache._core.inject_host_fault(op, nth)
        return op, "injected fault"
    from .cuda_setup import CUDA_MODE, cuda_emu

    if CUDA_MODE != "emulated":
        pytest.skip("faults are injected through the host hook or the CUDA emulation only")
    cuda_emu.Emulator.load().inject_fault(_DRIVER_ENTRY[op], nth, cuda_emu.CUDA_ERROR_UNKNOWN)
    return _DRIVER_ENTRY[op], "CUDA_ERROR_UNKNOWN"


def kv_views(cache, layer):
    """Tensors over layer `layer`'s K and V: CPU tensors wherever the memory is host memory (host
    backend, CUDA emulation), torch.cuda tensors on a real GPU. On the emulation they are
    one_device.DeviceView tensors: mixed with a CPU tensor in a torch call they raise, as a GPU's
    do, in the cuda cases a GPU runs (conftest.py)."""
    if cache.config.device == "cpu" or torch.cuda.is_available():
        return cache.layer(layer)
    k, v = cache.host_alias(layer)
    return as_device_view(k), as_device_view(v)


def fill_pattern(cache, slot, start, end, seed):
    """Write a deterministic pattern into tokens [start, end) of `slot` in every layer, K and V."""
    gen = torch.Generator().manual_seed(seed)
    cfg = cache.config
    written = []
    for layer in range(cfg.num_layers):
        k, v = kv_views(cache, layer)
        shape = (end - start, cfg.layer_kv_heads[layer], cfg.layer_head_dims[layer])
        kd = torch.randn(*shape, generator=gen).to(cfg.dtype)
        vd = torch.randn(*shape, generator=gen).to(cfg.dtype)
        k[slot, start:end] = kd.to(k.device)
        if v is None:  # value_cache=False
            vd = None
        else:
            v[slot, start:end] = vd.to(v.device)
        written.append((kd, vd))
    return written


def check_pattern(cache, slot, start, end, written):
    for layer, (kd, vd) in enumerate(written):
        k, v = kv_views(cache, layer)
        assert torch.equal(k[slot, start:end].cpu(), kd), f"K of layer {layer} slot {slot} changed"
        if vd is not None:
            assert torch.equal(v[slot, start:end].cpu(), vd), (
                f"V of layer {layer} slot {slot} changed"
            )


PAGE_STATE_KEYS = (
    "pages_total",
    "pages_free",
    "pages_mapped",
    "mappings",
    "bytes_mapped",
    "active_slots",
    "idle_slots_with_pages",
    "free_slots",
    "bytes_used_by_tokens",
    "map_calls",
    "unmap_calls",
    "pages_created",
    "pages_destroyed",
)


def page_state(cache):
    """The part of stats() a failed call must leave exactly as it was."""
    stats = cache.stats()
    state = {k: stats[k] for k in PAGE_STATE_KEYS}
    state["mapped_tokens"] = [cache.mapped_tokens(s) for s in range(cache.config.max_batch_size)]
    state["seq_lens"] = [cache.seq_len(s) for s in range(cache.config.max_batch_size)]
    return state
