"""FlashAttention-4 over the virtual cache: the measurements of the GPU check's flash-attn-4 part
and of bench_fa4_paged.py.

Every function takes FA4's ``flash_attn_varlen_func`` as an argument (``fa4``) and a device, so
that the same code runs on the CPU against a torch stand-in of FA4 (tests/test_fa4_kit.py: the
plumbing, never a figure) and on a GPU against FA4 itself.

* :func:`accuracy` -- FA4 over the cache and over a contiguous copy of the same K/V, each against
  an fp32 SDPA per row: FA4 over the cache must be as close as over the copy (bit-equal, here).
* :func:`nan_past_the_length` -- NaN planted in pages a row gets from the pool; the cache's tail
  rule zeroes what FA4's whole tiles read past the length.
* :func:`mega_boundary` -- a mega-layout row ending just before a page boundary (32 tokens a
  2 MB page for a Llama-3-8B shape): FA4's tile reaches the next page, which the rule maps.
* :func:`time_virtual_vs_copy` -- FA4's time over the cache against a contiguous copy.
* :func:`paged_vs_virtual` -- FA4 with a ``page_table`` over a paged pool (the same data) against
  FA4 over the virtual cache: the vAttention comparison in one kernel family.

Times: CUDA events on a GPU (perf_counter elsewhere), both sides warmed up, alternated A B B A,
min and median over the rounds.
"""

from __future__ import annotations

import importlib
import os
import site
import statistics
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

import vattention

Fn = Callable[..., Any]

# KV shapes per GPU: Llama-3-8B (8 KV heads, GQA 4) and Llama-3-70B at tensor parallel 8 (one KV
# head, 8 query heads a GPU); head_dim 128 for both.
SHAPES = {
    "llama3-8b": dict(num_layers=32, kv_heads=8, heads=32, head_dim=128),
    "llama3-70b-tp8": dict(num_layers=80, kv_heads=1, heads=8, head_dim=128),
}


def load_fa4() -> Tuple[Optional[Fn], str]:
    """(FA4's flash_attn_varlen_func, its version) or (None, why not). A wheel folder the GPU
    check installed (GPU_CHECK_FA4_SITE, see fa4_wheels.py) is added as a site directory first,
    so the cutlass-dsl meta wheel's .pth file is read."""
    extra = os.environ.get("GPU_CHECK_FA4_SITE")
    if extra:
        site.addsitedir(extra)
    try:
        module = importlib.import_module("flash_attn.cute")
    except Exception as e:  # not installed, or cutlass-dsl / the CUDA libraries failing to load
        return None, f"{type(e).__name__}: {e}"[:300]
    try:
        from importlib.metadata import version

        found = version("flash-attn-4")
    except Exception:
        found = getattr(module, "__version__", "?")
    return module.flash_attn_varlen_func, found


# ---- helpers --------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def alternate(fns: Dict[str, Callable[[], Any]], device: str, rounds: int = 6, calls: int = 5):
    """(min, median) milliseconds per call of each function: each warmed up, then timed in
    rounds, in the listed order on even rounds and reversed on odd ones (A B B A)."""
    for fn in fns.values():
        fn()
        fn()
    _sync(device)
    names = list(fns)
    samples: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else list(reversed(names)):
            fn = fns[name]
            if device.startswith("cuda"):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) / calls)
            else:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples[name].append((time.perf_counter() - t0) * 1e3 / calls)
    return {n: (min(s), statistics.median(s)) for n, s in samples.items()}


def sdpa_fp32(q, k, v, lens: List[int], q_len: int, causal: bool = True) -> torch.Tensor:
    """The fp32 oracle: SDPA per row over keys [0, lens[i]), queries q[i] ([B, q_len, H, D]),
    causal aligned bottom right; returns fp32 [B, q_len, H, D]."""
    heads, kv_heads = q.shape[2], k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i, n in enumerate(lens):
        if n == 0:
            continue
        qi = q[i].float().transpose(0, 1)  # [H, q_len, D]
        ki = k[i, :n].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        vi = v[i, :n].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        mask = None
        if causal:
            pos = torch.arange(q_len, device=q.device)[:, None] + n - q_len
            mask = torch.arange(n, device=q.device)[None, :] <= pos
        o = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask)
        out[i] = o.transpose(0, 1)
    return out


def call(fa4: Fn, q, k, v, lens_t, causal: bool = True, **kw) -> torch.Tensor:
    """FA4 over [B, S, H, D] tensors with one length per row (4-D q: every row q_len queries)."""
    out = fa4(q, k, v, seqused_k=lens_t, causal=causal, **kw)
    return out[0] if isinstance(out, tuple) else out


def filled_cache(
    device: str,
    layout: str,
    dtype: torch.dtype,
    lens: List[int],
    kv_heads: int,
    head_dim: int,
    num_layers: int = 2,
    seed: int = 0,
    kv_tile_tokens: int = 128,
):
    """A cache (2 MB pages on CUDA, 64 KB on the host; the tile rule on) whose rows 0..B-1 hold
    random K/V for lens[i] tokens in its last layer (in the mega layout: that layer's view, the
    other layers' tokens around it)."""
    cfg = vattention.KVCacheConfig(
        num_layers=num_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_batch_size=len(lens),
        max_seq_len=max(max(lens), 1),
        dtype=dtype,
        device=device,
        layout=layout,
        page_size="2MB" if device.startswith("cuda") else "64KB",
        kv_tile_tokens=kv_tile_tokens,
    )
    cache = vattention.KVCache(cfg)
    slots = [cache.alloc() for _ in lens]
    cache.step(dict(zip(slots, lens)))
    k, v = cache.layer(num_layers - 1)
    gen = torch.Generator(device=device).manual_seed(seed)
    for slot, n in zip(slots, lens):
        shape = (n, kv_heads, head_dim)
        k[slot, :n] = torch.randn(shape, generator=gen, device=device).to(dtype)
        v[slot, :n] = torch.randn(shape, generator=gen, device=device).to(dtype)
    return cache, k, v


def copy_rows(k: torch.Tensor, lens: List[int]) -> torch.Tensor:
    """A contiguous [B, S, H, D] tensor with the rows' first lens[i] tokens (zeros after)."""
    out = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    for i, n in enumerate(lens):
        out[i, :n] = k[i, :n]
    return out


def paged_pool(k, v, lens: List[int], page_size: int, seed: int = 0):
    """The rows' tokens in a paged pool ``[num_pages, page_size, H, D]`` (pages in a shuffled
    order, as a block allocator leaves them), its page table ``[B, max_pages]`` (int32) and the
    pool's K and V. Past a row's length its last page holds zeros."""
    batch, max_seq = k.shape[:2]
    per_row = -(-max_seq // page_size)
    used = [-(-n // page_size) for n in lens]
    total = max(sum(used), 1)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(total, generator=gen).tolist()
    shape = (total, page_size) + tuple(k.shape[2:])
    k_pool = torch.zeros(shape, dtype=k.dtype, device=k.device)
    v_pool = torch.zeros(shape, dtype=v.dtype, device=v.device)
    table = torch.zeros(batch, per_row, dtype=torch.int32)
    nxt = 0
    for i, n in enumerate(lens):
        for p in range(used[i]):
            page = order[nxt]
            nxt += 1
            table[i, p] = page
            a, b = p * page_size, min(n, (p + 1) * page_size)
            k_pool[page, : b - a] = k[i, a:b]
            v_pool[page, : b - a] = v[i, a:b]
    return k_pool, v_pool, table.to(k.device)


def _queries(batch: int, q_len: int, heads: int, head_dim: int, dtype, device, seed=1):
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(batch, q_len, heads, head_dim, generator=gen, device=device).to(dtype)


# ---- the checks ---------------------------------------------------------------------------------


def accuracy(
    fa4: Fn,
    device: str,
    cases: Iterable[Tuple[str, torch.dtype, int, int, str]],
    lens: List[int],
) -> Iterable[dict]:
    """Per case (layout, dtype, head_dim, gqa, phase): FA4 over the cache and over a contiguous
    copy against fp32 SDPA per row. Rows: both errors, and whether the two outputs are equal."""
    kv_heads = 2
    for layout, dtype, head_dim, gqa, phase in cases:
        q_len = 1 if phase == "decode" else (64 if phase == "prefill" else 16)
        case = dict(
            check="vs fp32 SDPA",
            layout=layout,
            dtype=str(dtype).replace("torch.", ""),
            head_dim=head_dim,
            gqa=gqa,
            phase=phase,
        )
        try:
            # chunked prefill: the chunk's queries at the end of a longer row
            row_lens = [max(n, q_len) for n in lens]
            cache, k, v = filled_cache(device, layout, dtype, row_lens, kv_heads, head_dim)
            with cache:
                q = _queries(len(row_lens), q_len, kv_heads * gqa, head_dim, dtype, device)
                lens_t = torch.tensor(row_lens, dtype=torch.int32, device=device)
                kc, vc = copy_rows(k, row_lens), copy_rows(v, row_lens)
                virtual = call(fa4, q, k, v, lens_t)
                copy = call(fa4, q, kc, vc, lens_t)
                want = sdpa_fp32(q, kc, vc, row_lens, q_len)
                err_v = (virtual.float() - want).abs().max().item()
                err_c = (copy.float() - want).abs().max().item()
                yield dict(
                    case,
                    err_virtual=round(err_v, 5),
                    err_copy=round(err_c, 5),
                    equal=bool(torch.equal(virtual, copy)),
                )
        except Exception as e:  # one case's failure must not lose the others
            yield dict(case, error=f"{type(e).__name__}: {e}"[:300])


def nan_past_the_length(fa4: Fn, device: str, tile_rule: bool) -> dict:
    """A first request's pages are filled with NaN and go back to the pool; the next request's
    rows get them. With the cache's tail rule FA4's output is finite and equals its output over
    a copy; without it (kv_tile_tokens=0, FA4 called directly) the NaN past the length shows."""
    dtype, kv_heads, head_dim, gqa = torch.bfloat16, 2, 128, 4
    lens = [1000, 77]  # mid-tile
    cfg = vattention.KVCacheConfig(
        num_layers=2,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_batch_size=len(lens),
        max_seq_len=4096,
        dtype=dtype,
        device=device,
        page_size="2MB" if device.startswith("cuda") else "64KB",
        kv_tile_tokens=128 if tile_rule else 0,
    )
    row = dict(check="NaN planted past the length", kv_tile_tokens=cfg.kv_tile_tokens)
    with vattention.KVCache(cfg) as cache:
        first = [cache.alloc() for _ in lens]
        cache.step({s: 4096 for s in first})
        for layer in range(cfg.num_layers):
            for t in cache.layer(layer):
                t[first] = float("nan")
        for s in first:
            cache.free(s)
        cache.reclaim()
        slots = [cache.alloc() for _ in lens]
        cache.step(dict(zip(slots, lens)))
        k, v = cache.layer(1)
        gen = torch.Generator(device=device).manual_seed(0)
        for s, n in zip(slots, lens):
            k[s, :n] = torch.randn(n, kv_heads, head_dim, generator=gen, device=device).to(dtype)
            v[s, :n] = torch.randn(n, kv_heads, head_dim, generator=gen, device=device).to(dtype)
        order = [lens[slots.index(r)] for r in range(len(lens))]  # every row is a request's
        q = _queries(len(order), 1, kv_heads * gqa, head_dim, dtype, device)
        lens_t = torch.tensor(order, dtype=torch.int32, device=device)
        out = call(fa4, q, k, v, lens_t)
        copy = call(fa4, q, copy_rows(k, order), copy_rows(v, order), lens_t)
        finite = bool(out.isfinite().all())
        same = bool(torch.equal(out, copy))
        row["finite"] = finite
        if tile_rule:  # the check: finite, and what FA4 gives over a copy
            row["equal"] = same
            if not finite:
                row["error"] = "NaN in FA4's output over the cache"
        else:  # the hazard the rule removes, shown: not a failure
            row["equal_to_copy"] = same
    return row


def mega_boundary(fa4: Fn, device: str, shape: str = "llama3-8b") -> dict:
    """A mega-layout row ending one token before a page boundary: FA4's 128-key tile reaches
    the next pages, which the tail rule maps (without it: an illegal address, not run here)."""
    s = SHAPES[shape]
    dtype = torch.bfloat16
    cfg = vattention.KVCacheConfig(
        num_layers=s["num_layers"],
        num_kv_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        max_batch_size=2,
        max_seq_len=4096,
        dtype=dtype,
        device=device,
        layout="mega",
        page_size="2MB",  # the host backend too: 32 tokens a page, as on a GPU
        kv_tile_tokens=128,
    )
    tpp = cfg.tokens_per_page
    length = tpp - 1
    row = dict(check="mega row ending before a page boundary", tokens_per_page=tpp, length=length)
    with vattention.KVCache(cfg) as cache:
        slot = cache.alloc()
        cache.step({slot: length})
        row["mapped_tokens"] = cache.mapped_tokens(slot)
        k, v = cache.layer(s["num_layers"] - 1)
        gen = torch.Generator(device=device).manual_seed(0)
        shape_ = (length, s["kv_heads"], s["head_dim"])
        k[slot, :length] = torch.randn(shape_, generator=gen, device=device).to(dtype)
        v[slot, :length] = torch.randn(shape_, generator=gen, device=device).to(dtype)
        q = _queries(1, 1, s["heads"], s["head_dim"], dtype, device)
        lens_t = torch.tensor([length], dtype=torch.int32, device=device)
        out = call(fa4, q, k[slot : slot + 1], v[slot : slot + 1], lens_t)
        _sync(device)
        copy = call(fa4, q, copy_rows(k[slot : slot + 1], [length]), copy_rows(
            v[slot : slot + 1], [length]), lens_t)  # fmt: skip
        row.update(finite=bool(out.isfinite().all()), equal=bool(torch.equal(out, copy)))
        if not row["finite"]:
            row["error"] = "NaN in FA4's output over the cache"
    return row


def time_virtual_vs_copy(
    fa4: Fn,
    device: str,
    batch: int,
    context: int,
    shape: str = "llama3-8b",
    rounds: int = 6,
    phases: Iterable[Tuple[str, int]] = (("decode", 1), ("prefill", 512)),
) -> Iterable[dict]:
    """FA4's time over the cache (layer layout, 2 MB pages) against a contiguous copy of the
    same rows, decode and prefill; outputs compared."""
    s = SHAPES[shape]
    dtype = torch.bfloat16
    lens = [context] * batch
    cache, k, v = filled_cache(device, "layer", dtype, lens, s["kv_heads"], s["head_dim"], 1)
    with cache:
        kc, vc = copy_rows(k, lens), copy_rows(v, lens)
        lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
        for phase, q_len in phases:
            q = _queries(batch, q_len, s["heads"], s["head_dim"], dtype, device)
            t = alternate(
                {
                    "virtual": lambda: call(fa4, q, k, v, lens_t),
                    "copy": lambda: call(fa4, q, kc, vc, lens_t),
                },
                device,
                rounds=rounds,
            )
            yield dict(
                check="time over the cache / a contiguous copy",
                shape=shape,
                phase=phase,
                batch=batch,
                context=context,
                equal=bool(torch.equal(call(fa4, q, k, v, lens_t), call(fa4, q, kc, vc, lens_t))),
                copy_ms=f"{t['copy'][0]:.4f} / {t['copy'][1]:.4f}",
                virtual_over_copy_min=round(t["virtual"][0] / t["copy"][0], 3),
                virtual_over_copy_median=round(t["virtual"][1] / t["copy"][1], 3),
            )


def paged_vs_virtual(
    fa4: Fn,
    device: str,
    points: Iterable[Tuple[int, int]],
    page_sizes: Iterable[int] = (16, 64, 256),
    shape: str = "llama3-8b",
    phases: Iterable[Tuple[str, int]] = (("decode", 1), ("prefill", 512)),
    rounds: int = 6,
) -> Iterable[dict]:
    """FA4 with a page_table over a paged pool holding the same tokens, against FA4 over the
    virtual cache: time ratio (paged / virtual, min and median) and the largest difference of
    the outputs, per (batch, context), phase and page size."""
    s = SHAPES[shape]
    dtype = torch.bfloat16
    for batch, context in points:
        lens = [context] * batch
        cache, k, v = filled_cache(device, "layer", dtype, lens, s["kv_heads"], s["head_dim"], 1)
        with cache:
            lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
            for page_size in page_sizes:
                case = dict(shape=shape, batch=batch, context=context, page_size=page_size)
                try:
                    k_pool, v_pool, table = paged_pool(k, v, lens, page_size)
                except torch.OutOfMemoryError as e:
                    yield dict(case, error=f"OutOfMemoryError: {e}"[:200])
                    continue
                for phase, q_len in phases:
                    q = _queries(batch, q_len, s["heads"], s["head_dim"], dtype, device)

                    def paged():
                        return call(fa4, q, k_pool, v_pool, lens_t, page_table=table)

                    def virtual():
                        return call(fa4, q, k, v, lens_t)

                    try:
                        diff = (paged().float() - virtual().float()).abs().max().item()
                        t = alternate({"paged": paged, "virtual": virtual}, device, rounds)
                    except Exception as e:  # one point's failure must not lose the others
                        yield dict(case, phase=phase, error=f"{type(e).__name__}: {e}"[:300])
                        continue
                    yield dict(
                        case,
                        phase=phase,
                        virtual_ms=round(t["virtual"][1], 4),
                        paged_ms=round(t["paged"][1], 4),
                        paged_over_virtual_min=round(t["paged"][0] / t["virtual"][0], 3),
                        paged_over_virtual_median=round(t["paged"][1] / t["virtual"][1], 3),
                        max_abs_diff=round(diff, 5),
                    )
                k_pool = v_pool = table = None  # before the next page size's pool
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
