"""The GPU check's `memory` part: the driver's free memory against what the cache says it holds.

A user sizes a server by what the cache reports (``bytes_mapped``, ``committed_bytes``) and sees
what the driver reports (``nvidia-smi``, ``torch.cuda.mem_get_info``). This part checks that they
agree at each stage of a cache's life: created (virtual tensors larger than the device's memory,
which must cost nothing), stepped, freed, reclaimed, refused by a memory budget, closed. The
driver's figure is ``cuMemGetInfo`` on the device's primary context, read through ctypes
(cudrv.py), the call behind ``torch.cuda.mem_get_info``.

On the emulation (``--emulated``) the device is the emulation's budget (set here to 4 GiB; its
``cuMemGetInfo`` reports the budget less what live handles hold): the plumbing runs, the figures
describe the emulation.
"""

from __future__ import annotations

import math
from typing import Any, Callable

MB = 1 << 20
GB = 1 << 30
# What the driver may hold beyond the cache's pages before a stage fails: none was seen on the
# H200 (8192 MiB mapped, free memory down by exactly 8192 MiB), so a few pages' worth, which a
# leak of a whole row (a page per layer) still exceeds.
TOLERANCE = 8 * MB
LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128)  # 128 KiB a token in bf16
SMALL = dict(num_layers=4, num_kv_heads=8, head_dim=128)  # 16 KiB a token: the emulation's

Emit = Callable[..., None]


def memory(emit: Emit, emulated: bool) -> None:
    """Runs the stages; raises SystemExit naming the stages where the figures disagree."""
    import torch
    from cudrv import Driver

    import vattention

    if emulated:
        import emu

        emu.Emulator.load().set_device_memory_bytes(4 * GB)
    drv = Driver()  # the primary context current on this thread, for cuMemGetInfo
    free0, total = drv.mem_info()
    dims, rows, stepped, tokens, capped = _sizes(total, free0, emulated)
    emit(
        kind="note",
        text=f"device memory {total / GB:.1f} GiB, {free0 / GB:.1f} GiB free before the cache; "
        f"driver_used: how far cuMemGetInfo's free memory fell since; a stage fails when it "
        f"differs from the caches' committed_bytes by more than {TOLERANCE // MB} MiB",
    )
    caches: list[Any] = []
    failed: list[str] = []

    def stage(name: str, all_mapped: bool = False, **extra: Any) -> None:
        """One row; all_mapped: every page the caches hold is mapped (bytes_mapped must agree
        with the driver too)."""
        free, _ = drv.mem_info()
        used = free0 - free
        live = [c for c in caches if not c.closed]
        committed = sum(c.stats()["committed_bytes"] for c in live)
        mapped = sum(c.stats()["bytes_mapped"] for c in live)
        ok = abs(used - committed) <= TOLERANCE and (
            not all_mapped or abs(used - mapped) <= TOLERANCE
        )
        if not ok:
            failed.append(name)
        emit(
            kind="row",
            stage=name,
            driver_used_MiB=round(used / MB, 1),
            committed_MiB=round(committed / MB, 1),
            bytes_mapped_MiB=round(mapped / MB, 1),
            agree=ok,
            **extra,
        )

    def config(max_seq_len: int) -> vattention.KVCacheConfig:
        return vattention.KVCacheConfig(
            **dims,
            max_batch_size=rows,
            max_seq_len=max_seq_len,
            dtype=torch.bfloat16,
            page_size="2MB",
            device="cuda:0",
        )

    cfg = config(_row_tokens(total, rows, dims))
    cache = vattention.KVCache(cfg)
    caches.append(cache)
    stage("create", virtual_GiB=round(cfg.virtual_bytes / GB, 1), device_GiB=round(total / GB, 1))
    slots = [cache.alloc() for _ in range(stepped)]
    cache.step({s: tokens for s in slots})
    stage("step", all_mapped=True, rows=stepped, tokens=tokens)
    for s in slots:
        cache.free(s)
    stage("free")
    pages = cache.reclaim()
    stage("reclaim", pages_to_pool=pages)
    capped_cache = vattention.KVCache(config(tokens), memory_budget=capped)
    caches.append(capped_cache)
    slot = capped_cache.alloc()
    try:
        capped_cache.step({slot: tokens})
        refused = "no"
    except vattention.OutOfPagesError:
        refused = "OutOfPagesError"
    stage("budget refusal", budget_MiB=capped // MB, refused=refused)
    if refused == "no":
        failed.append("budget refusal (stepped past its budget)")
    for c in caches:
        c.close()
    stage("close")
    if failed:
        raise SystemExit(f"memory: the driver and the cache disagree at: {', '.join(failed)}")


def _sizes(total: int, free: int, emulated: bool) -> tuple[dict, int, int, int, int]:
    """(model dims, rows, rows stepped, tokens each, the capped cache's budget): about a
    sixteenth of the free memory mapped, at most 16 rows of 4096 tokens."""
    dims = SMALL if emulated else LLAMA3_8B
    per_token = 2 * dims["num_layers"] * dims["num_kv_heads"] * dims["head_dim"] * 2  # K+V bf16
    rows, tokens = 64, 4096
    stepped = max(1, min(16, free // 16 // (tokens * per_token)))
    capped = max(2 * MB, min(GB, tokens * per_token // 2))  # half a row: the step must not fit
    return dims, rows, stepped, tokens, capped


def _row_tokens(total: int, rows: int, dims: dict) -> int:
    """max_seq_len (a power of two) that makes the cache's virtual tensors at least 1.5x the
    device's memory."""
    per_token = 2 * dims["num_layers"] * dims["num_kv_heads"] * dims["head_dim"] * 2
    return 1 << math.ceil(math.log2(1.5 * total / (rows * per_token)))
