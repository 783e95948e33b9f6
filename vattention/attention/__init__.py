"""vattention's own attention over dense KV caches: the CPU kernel and its SDPA reference.

A vattention cache gives each request a contiguous row ``k_cache[slot, :seq_len]`` of a dense
tensor ``[max_batch, max_seq, kv_heads, head_dim]``; these functions attend over such rows with
FlashAttention's ``flash_attn_with_kvcache`` semantics (new keys appended in place, causal masks
aligned to the bottom right, sliding windows in absolute positions, fp8 caches with per-tensor
descales). For FlashAttention's own signature, on CPU and GPU alike, use
:mod:`vattention.integrations.flash_attn`.

=====================================  =========================================================
:func:`cpu_attention`                  the native kernel (``csrc/attention``): CPU tensors, one
                                       call per batch, OpenMP threads, the GIL released; can
                                       write into a caller's buffer (``out=``) and read a shared
                                       prefix once (``prefix_groups``/``prefix_lens``)
:class:`CpuAttentionPlan`              the same kernel for a serving loop: one layer's fixed
                                       arguments checked once, a step's requests once
                                       (:class:`CpuAttentionBatch`), each call only its tensors
:func:`reference_attention`            the same semantics in torch SDPA, any dtype and device:
                                       the test oracle
:func:`kernel_isa`                     the instruction set the kernel runs here
:func:`kernel_variants`                every variant of the kernel, best first, and what each
                                       needs of the CPU; :func:`kernel_report` says which one
                                       runs and why (``python -m vattention info``)
:func:`supports`                       whether the kernel takes tensors of these dtypes/devices
:func:`fp8_store_like_vllm`            how a new key is stored in an fp8 cache
=====================================  =========================================================

None of them maps pages: call ``KVCache.step({slot: new_length})`` first, so positions up to the
new length are backed. None reads a key position at or beyond ``cache_seqlens + new``, nor below a
sliding window's start (those pages may be unmapped).

Examples
--------
>>> import torch
>>> from vattention import attention
>>> k_cache = torch.zeros(4, 16, 2, 8); v_cache = torch.zeros(4, 16, 2, 8)
>>> q = torch.randn(2, 1, 4, 8); k = torch.randn(2, 1, 2, 8); v = torch.randn(2, 1, 2, 8)
>>> args = dict(cache_seqlens=torch.tensor([3, 0]), cache_batch_idx=torch.tensor([2, 0]),
...             causal=True)
>>> out = attention.cpu_attention(q, k_cache, v_cache, k, v, **args)
>>> want = attention.reference_attention(q, k_cache.clone(), v_cache.clone(), k, v, **args)
>>> out.shape, bool(torch.equal(k_cache[2, 3], k[0, 0])), bool(torch.allclose(out, want, atol=1e-5))
(torch.Size([2, 1, 4, 8]), True, True)
"""

from __future__ import annotations

from .arguments import IntArg, Scale
from .fp8 import fp8_store_like_vllm
from .kernel import cpu_attention, kernel_isa, supports
from .plan import CpuAttentionBatch, CpuAttentionPlan
from .reference import reference_attention
from .variants import KernelVariant, kernel_report, kernel_variants

__all__ = [
    "cpu_attention",
    "CpuAttentionPlan",
    "CpuAttentionBatch",
    "reference_attention",
    "kernel_isa",
    "kernel_variants",
    "kernel_report",
    "KernelVariant",
    "supports",
    "fp8_store_like_vllm",
    "IntArg",
    "Scale",
]
