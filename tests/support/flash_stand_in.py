"""Torch stand-ins for vLLM's FlashAttention and its cache write, for the plugin's CUDA path on
the CPU (no GPU, no CUDA vLLM here).

``flash_attn_varlen_func`` has ``vllm.vllm_flash_attn``'s signature (0.32.0 / 0.33.0) and its
paged-varlen semantics, as read from its docstring and Python wrapper: ``block_table`` rows name
``[num_pages, page_size, kv_heads, head_dim]`` blocks, ``seqused_k`` the keys of each request,
``cu_seqlens_q`` its queries; causal aligned bottom right; a window ``(left, right)`` keeps keys
``[p - left, p + right]`` of a query at ``p``; GQA (query head ``h`` reads KV head
``h // (heads // kv_heads)``); fp8 inputs are multiplied by their ``(batch, kv_heads)`` descales.
It also refuses what the wrapper asserts and what the extensions' messages say they refuse (block
size not a multiple of 16, a block table too narrow for ``max(seqused_k)``, dtypes, head sizes).
It reads whole blocks, as the kernels load whole tiles; ``on_block_read`` sees every block id read.

``reshape_and_cache_flash`` writes ``key``/``value`` at ``slot_mapping`` (``block * block_size +
offset``) of ``[num_blocks, block_size, kv_heads, head_dim]`` caches; fp8 (uint8 caches): divided
by the scale, saturated to the format's finite range, rounded to nearest (torch's conversion), as
vLLM's Triton version of the op divides by the scale.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class StandIn:
    """The two functions, recording their calls; ``on_block_read(block_id)`` checks each read."""

    def __init__(self, on_block_read: Optional[Callable[[int], None]] = None) -> None:
        self.on_block_read = on_block_read
        self.calls: List[dict] = []
        self.writes: List[dict] = []

    def reshape_and_cache_flash(
        self, key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
    ) -> None:
        self.writes.append(dict(kv_cache_dtype=kv_cache_dtype, slot_mapping=slot_mapping.clone()))
        assert slot_mapping.dtype == torch.int64
        n, block_size = slot_mapping.shape[0], key_cache.shape[1]
        keep = slot_mapping >= 0  # vLLM skips padded (-1) slots
        block, offset = slot_mapping[keep] // block_size, slot_mapping[keep] % block_size
        for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
            rows = src[:n][keep]
            if kv_cache_dtype == "auto":
                assert cache.dtype == src.dtype
                cache[block, offset] = rows
            else:
                assert cache.dtype == torch.uint8, "vLLM's fp8 cache is uint8"
                fmt = FP8[kv_cache_dtype]
                top = torch.finfo(fmt).max
                stored = (rows.float() / scale.float()).clamp(-top, top).to(fmt)
                cache[block, offset] = stored.view(torch.uint8)

    def flash_attn_varlen_func(
        self,
        q,
        k,
        v,
        max_seqlen_q,
        cu_seqlens_q,
        max_seqlen_k,
        cu_seqlens_k=None,
        seqused_k=None,
        q_v=None,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=None,
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
        return_softmax_lse=False,
        out=None,
        scheduler_metadata=None,
        q_descale=None,
        k_descale=None,
        v_descale=None,
        num_splits=0,
        output_scale=None,
        fa_version=2,
        s_aux=None,
        **unused,
    ):
        self.calls.append(
            dict(
                fa_version=fa_version,
                window_size=window_size,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                block_table=None if block_table is None else block_table.clone(),
                descales=q_descale is not None,
            )
        )
        # the Python wrapper's asserts
        assert cu_seqlens_k is not None or seqused_k is not None
        assert block_table is None or seqused_k is not None
        assert fa_version in (2, 3), fa_version
        # the extensions' checks
        batch = cu_seqlens_q.shape[0] - 1
        assert cu_seqlens_q.dtype == torch.int32 and seqused_k.dtype == torch.int32
        assert seqused_k.shape == (batch,)
        assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
        assert block_table.dim() == 2 and block_table.shape[0] == batch
        num_pages, page_size, kv_heads, head_dim = k.shape
        assert v.shape == k.shape and k.stride(-1) == 1 and v.stride(-1) == 1
        assert page_size % 16 == 0, "Paged KV cache block size must be divisible by 16"
        lens = seqused_k.tolist()
        assert max(lens, default=0) <= block_table.shape[1] * page_size, "block_table too narrow"
        assert max(lens, default=0) <= max_seqlen_k
        starts = cu_seqlens_q.tolist()
        assert max((b - a for a, b in zip(starts, starts[1:])), default=0) <= max_seqlen_q
        total, heads, q_dim = q.shape
        assert q_dim == head_dim and head_dim % 8 == 0 and head_dim <= 256
        assert heads % kv_heads == 0
        half = (torch.float16, torch.bfloat16)
        if fa_version == 2:
            assert q.dtype in half and k.dtype == q.dtype, "FA2: fp16/bf16, same dtypes"
            assert q_descale is None and k_descale is None, "FA2 takes no descales"
        else:
            assert q.dtype in half + (torch.float8_e4m3fn,) and k.dtype == q.dtype == v.dtype
        fp8 = q.dtype == torch.float8_e4m3fn
        assert out.shape == q.shape and out.dtype == (torch.bfloat16 if fp8 else q.dtype)
        scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        left, right = window_size if window_size is not None else (-1, -1)
        group = heads // kv_heads

        def descaled(x, descale, row, query_heads=False):
            x = x.float()
            if descale is None:
                return x
            assert descale.shape == (batch, kv_heads)
            d = descale[row].float()
            return x * (d.repeat_interleave(group) if query_heads else d)[:, None]

        for i in range(batch):
            a, b = starts[i], starts[i + 1]
            n_k, n_q = lens[i], b - a
            ids = block_table[i, : math.ceil(n_k / page_size)].tolist()
            for block in ids:
                if self.on_block_read is not None:
                    self.on_block_read(block)
            keys = k[ids].reshape(-1, kv_heads, head_dim)[:n_k]
            values = v[ids].reshape(-1, kv_heads, head_dim)[:n_k]
            qi = descaled(q[a:b], q_descale, i, query_heads=True)
            ki = descaled(keys, k_descale, i).repeat_interleave(group, dim=1)
            vi = descaled(values, v_descale, i).repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
            pos = torch.arange(n_q)[:, None] + n_k - n_q
            key_pos = torch.arange(n_k)[None, :]
            visible = torch.ones(n_q, n_k, dtype=torch.bool)
            if causal:
                visible &= key_pos <= pos
            if left >= 0:
                visible &= key_pos >= pos - left
            if right >= 0:
                visible &= key_pos <= pos + right
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # no key seen: zeros
            out[a:b] = torch.einsum("hqk,khd->qhd", probs, vi).to(out.dtype)
        return out
