"""Testing a non-paged attention kernel on a vattention cache: ragged lengths, and faults.

A kernel developer writes attention for dense ``[batch, seq, heads, dim]`` caches -- no block
tables. vattention hands it exactly that, with physical pages only under each request's tokens, so
the kernel is tested on realistic ragged batches without any paging code. And because the rest of
each row is *unmapped*, a kernel that reads past ``cache_seqlens`` does not silently read stale or
zero memory: it faults (``SIGSEGV`` on the host backend; an illegal-address error on CUDA). The
fault is shown in a child process, so this script survives it and reports the signal.

Run: ``python examples/kernel_dev.py``.
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys

import torch

import vattention
from vattention.integrations import flash_attn as fa

LENGTHS = [1, 17, 64, 200, 513]


def my_decode_kernel(q, k_cache, v_cache, cache_seqlens, cache_batch_idx):
    """The kernel under test: one query token per request, GQA, dense cache rows (no paging)."""
    out = torch.empty_like(q)
    groups = q.shape[2] // k_cache.shape[2]
    for i, (slot, n) in enumerate(zip(cache_batch_idx.tolist(), cache_seqlens.tolist())):
        keys = k_cache[slot, :n].repeat_interleave(groups, 1)  # [n, heads, dim]
        vals = v_cache[slot, :n].repeat_interleave(groups, 1)
        scores = torch.einsum("hd,nhd->hn", q[i, 0], keys) / math.sqrt(q.shape[-1])
        out[i, 0] = torch.einsum("hn,nhd->hd", scores.softmax(-1), vals)
    return out


def buggy_kernel_reads_whole_row(k_cache, slot):
    """A classic bug: reduce over the full max_seq_len row instead of the request's length."""
    return float(k_cache[slot].sum())


def make_cache() -> vattention.KVCache:
    cfg = vattention.KVCacheConfig(
        num_layers=1,
        num_kv_heads=2,
        head_dim=64,
        max_batch_size=8,
        max_seq_len=2048,
        dtype=torch.float32,
        device="cpu",
        page_size="64KB",
    )
    return vattention.KVCache(cfg)


def ragged_check() -> float:
    torch.manual_seed(0)
    with make_cache() as cache:
        slots = [cache.alloc() for _ in LENGTHS]
        cache.step(dict(zip(slots, LENGTHS)))
        k_cache, v_cache = cache.layer(0)
        for slot, n in zip(slots, LENGTHS):
            k_cache[slot, :n] = torch.randn(n, 2, 64)
            v_cache[slot, :n] = torch.randn(n, 2, 64)
        q = torch.randn(len(LENGTHS), 1, 8, 64)
        seqlens, batch_idx = torch.tensor(LENGTHS), torch.tensor(slots)
        got = my_decode_kernel(q, k_cache, v_cache, seqlens, batch_idx)
        want = fa.flash_attn_with_kvcache_reference(
            q, k_cache, v_cache, cache_seqlens=seqlens, cache_batch_idx=batch_idx
        )
        backed = [cache.mapped_tokens(s) for s in slots]
        print(f"ragged lengths {LENGTHS}; tokens backed by pages {backed} of 2048 per row")
        return float((got - want).abs().max())


def child_read_past_end() -> None:
    """Runs in a child process: read one token past the backed part of a row."""
    with make_cache() as cache:
        slot = cache.alloc()
        cache.step({slot: 100})
        k_cache, _ = cache.layer(0)
        print(
            f"child: slot {slot} backs {cache.mapped_tokens(slot)} tokens; reading the row",
            flush=True,
        )
        value = buggy_kernel_reads_whole_row(k_cache, slot)
        print(f"child: read returned {value} -- no fault", flush=True)


def fault_check() -> str:
    child = subprocess.run(
        [sys.executable, __file__, "--child"], capture_output=True, text=True, timeout=60
    )
    print(child.stdout.strip())
    if child.returncode < 0:
        return signal.Signals(-child.returncode).name
    return f"exit code {child.returncode}"


def main() -> int:
    if sys.argv[1:] == ["--child"]:
        child_read_past_end()
        return 0
    torch.set_num_threads(1)  # tiny tensors: extra threads only add overhead
    err = ragged_check()
    print(f"my_decode_kernel vs reference: max abs error {err:.2e}")
    outcome = fault_check()
    faulted = outcome in ("SIGSEGV", "SIGBUS")
    print(
        f"reading past cache_seqlens: child process ended by {outcome} -> "
        f"{'faulted (good: no silent garbage)' if faulted else 'NO FAULT'}"
    )
    return 0 if err < 1e-4 and faulted else 1


if __name__ == "__main__":
    raise SystemExit(main())
