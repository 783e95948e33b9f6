"""Per-call latency of cuMemCreate / cuMemMap / cuMemSetAccess / cuMemUnmap / cuMemRelease, by
page size, through ctypes (``call_floor_us`` is what a call that does nothing costs that way)."""

from __future__ import annotations

import time

from cudrv import Driver

MB = 1 << 20


def call_floor_us(drv: Driver, calls: int = 2000) -> float:
    """Microseconds per cuCtxGetCurrent: ctypes' share of every figure below."""
    t0 = time.perf_counter()
    for _ in range(calls):
        drv.current_context()
    return (time.perf_counter() - t0) / calls * 1e6


def measure(page_sizes_mb=(2, 32), total_mb: int = 512, drv: Driver | None = None) -> list[dict]:
    """One row per page size: mean microseconds per call over total_mb of pages (at least 4)."""
    drv = drv or Driver()
    rows = []
    for size_mb in page_sizes_mb:
        size = size_mb * MB
        if size % drv.granularity():
            continue
        n = max(4, total_mb // size_mb)
        va = drv.reserve(n * size)
        t = {}
        t0 = time.perf_counter()
        handles = [drv.create(size) for _ in range(n)]
        t["create"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i, h in enumerate(handles):
            drv.map(va + i * size, size, h)
        t["map"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(n):
            drv.set_access(va + i * size, size)
        t["set_access"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(n):
            drv.unmap(va + i * size, size)
        t["unmap"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for h in handles:
            drv.release(h)
        t["release"] = time.perf_counter() - t0
        drv.free(va, n * size)
        rows.append(
            {
                "page_MB": size_mb,
                "pages": n,
                **{f"{k}_us": round(v / n * 1e6, 2) for k, v in t.items()},
            }
        )
    return rows


if __name__ == "__main__":
    for r in measure():
        print(r)
