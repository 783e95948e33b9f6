"""A torch stand-in for FlashAttention-4's ``flash_attn_varlen_func``, for the FA4 path on the CPU
(no GPU, no flash-attn-4 here).

Signature and semantics are FA4's own, as read from ``flash_attn/cute/interface.py`` of the
``flash-attn-4`` 4.0.0b36 wheel (``flash_attn_varlen_func``, ``_flash_attn_fwd``,
``_resolve_causal_local_window``) and ``cute_dsl_utils.py`` (``maybe_contiguous``):

* ``k``/``v`` are ``[batch, seqlen_k, kv_heads, head_dim]`` with ``seqused_k`` (row ``i`` holds
  ``seqused_k[i]`` keys), or ``[num_pages, page_size, kv_heads, head_dim]`` with ``page_table``
  ``[batch, pages_per_seq]`` (int32, contiguous last dim); no ``cache_batch_idx``: row ``i`` of
  the batch is row ``i`` of ``k``;
* ``q`` is ``[total_q, heads, head_dim]`` with ``cu_seqlens_q`` (int32 ``[batch + 1]``), else
  ``[batch, seqlen_q, heads, head_dim]``; GQA: query head ``h`` reads KV head
  ``h // (heads // kv_heads)``; fp16/bf16, one dtype for q, k, v;
* causal and windows are aligned bottom right: query ``j`` of ``Lq`` at position
  ``p = j + Lk - Lq`` sees keys ``[p - left, p + right]`` (``None`` or both negative: unlimited;
  ``causal`` sets ``right = 0``); a query that sees no key gets zeros and LSE ``-inf``;
* it returns ``(out, lse)``, ``lse`` ``[heads, total_q]`` (varlen) or ``[batch, heads, seqlen_q]``
  when ``return_lse``, else ``None``;
* a tensor FA4's ``maybe_contiguous`` finds misaligned (last stride not 1, address or another
  stride not a multiple of 16 bytes) is COPIED first, as FA4 does: over a cache that copy reads
  every row. Calls record whether a copy was made (``calls[i]["copied"]``).

What makes it a model of the hazard the cache must prevent: it reads key tiles whole, as FA4's
TMA loads do. A row of ``n`` keys is read up to ``n`` rounded up to ``tile_n`` (FA4's
``_tile_size_fwd_sm90`` for the head dim and mask, as :func:`fa4_key_tile` gives it; a paged row:
its pages whole; a window: from the tile of its first key), the scores past ``n`` are masked
(``P = 0``) but ``P @ V`` runs over the whole tile, so a NaN in a masked row of V makes the
output NaN, as on a GPU; an unmapped row of a vattention cache faults (SIGSEGV on the host
backend).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from vattention.integrations.flash_attn4 import fa4_key_tile

ALIGN = 16


def _aligned(t: torch.Tensor) -> bool:
    """FA4's ``_is_aligned_layout`` (``maybe_contiguous``'s test for a non-contiguous tensor)."""
    if t.stride(-1) != 1 or t.data_ptr() % ALIGN:
        return False
    unit = max(1, ALIGN // t.element_size())
    return all(s == 0 or s % unit == 0 for s in t.stride()[:-1])


class FA4StandIn:
    """``flash_attn_varlen_func`` with FA4's signature; ``arch`` picks the tile as FA4 does."""

    def __init__(self, arch: int = 90):
        self.arch = arch
        self.calls: List[dict] = []

    def flash_attn_varlen_func(
        self,
        q,
        k,
        v,
        qv=None,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
        min_seqlen_k=None,
        seqused_q=None,
        seqused_k=None,
        gather_kv_indices=None,
        page_table=None,
        softmax_scale=None,
        causal=False,
        window_size=(None, None),
        learnable_sink=None,
        softcap=0.0,
        num_splits=1,
        pack_gqa=None,
        deterministic=False,
        score_mod=None,
        score_mod_bwd=None,
        mask_mod=None,
        block_sparse_tensors=None,
        aux_tensors=None,
        aux_scalars=None,
        return_lse=False,
        scheduler_metadata=None,
        seqlen_k_per_split=None,
        disable_scheduler_metadata=False,
        gather_bwd_recompute_p=False,
        gather_bwd_token_chunk=None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        # What the cache path never uses: FA4's defaults only.
        assert qv is None and cu_seqlens_k is None and seqused_q is None
        assert gather_kv_indices is None and learnable_sink is None and softcap == 0.0
        assert score_mod is None and mask_mod is None and block_sparse_tensors is None
        copied = [not _aligned(t) for t in (q, k, v)]
        self.calls.append(
            dict(
                copied=any(copied),
                causal=causal,
                window_size=tuple(window_size),
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                paged=page_table is not None,
                num_splits=num_splits,
            )
        )
        # maybe_contiguous: FA4 copies what it finds misaligned (every row of it).
        q, k, v = [t.contiguous() if c else t for t, c in zip((q, k, v), copied)]
        # _flash_attn_fwd's asserts
        heads, head_dim = q.shape[-2:]
        if cu_seqlens_q is None:
            batch, seqlen_q = q.shape[:2]
            total_q = batch * seqlen_q
        else:
            batch = cu_seqlens_q.shape[0] - 1
            total_q = q.shape[0]
        if page_table is not None:
            assert page_table.dtype == torch.int32, "page_table must be int32"
            assert page_table.stride(-1) == 1, "page_table must be contiguous in the last dim"
            assert page_table.shape[0] == batch
            num_pages, page_size = v.shape[:2]
        else:
            page_size = None
            seqlen_k = v.shape[-3]
            assert k.shape == (batch, seqlen_k, v.shape[-2], head_dim)
        kv_heads, head_dim_v = v.shape[-2:]
        assert v.dtype in (torch.float16, torch.bfloat16), "inputs must be float16 or bfloat16"
        assert q.dtype == k.dtype == v.dtype, "q, k, v must have the same dtype"
        for t in (cu_seqlens_q, seqused_k):
            if t is not None:
                assert t.dtype == torch.int32 and t.stride(0) == 1
        assert seqused_k is None or seqused_k.shape == (batch,)
        assert heads % kv_heads == 0, "num_head must be divisible by num_head_kv"
        assert head_dim % 8 == 0 and head_dim_v % 8 == 0
        scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        causal, local, left, right = _resolve(causal, window_size)
        tile = fa4_key_tile(
            head_dim, head_dim_v, causal=causal, window_size=(left, right), arch=self.arch
        )
        if cu_seqlens_q is None:
            starts = [i * q.shape[1] for i in range(batch + 1)]
            q_flat = q.reshape(total_q, heads, head_dim)
        else:
            starts = cu_seqlens_q.tolist()
            q_flat = q
        if seqused_k is not None:
            lens = seqused_k.tolist()
        else:
            lens = [page_table.shape[1] * page_size if page_table is not None else seqlen_k] * batch
        out = torch.zeros(total_q, heads, head_dim_v, dtype=q.dtype)
        lse = torch.full((heads, total_q), float("-inf"))
        group = heads // kv_heads
        for i in range(batch):
            a, b = starts[i], starts[i + 1]
            n_k, n_q = lens[i], b - a
            if n_q == 0 or n_k == 0:
                continue  # no tile: FA4's first load aims at block -1 (zero filled)
            # A window starts at the tile of its first query's first key (FA4's n_block_min).
            first = 0
            if local and left is not None:
                first = max(0, n_k - n_q - left) // tile * tile
            if page_table is not None:
                pages = -(-n_k // page_size)
                skip = first // page_size
                ids = page_table[i, skip:pages].tolist()
                first = skip * page_size
                end = pages * page_size  # a row's pages, read whole
                keys = k[ids].reshape(-1, kv_heads, head_dim)
                values = v[ids].reshape(-1, kv_heads, head_dim_v)
            else:
                end = min(k.shape[1], -(-n_k // tile) * tile)  # the last tile, whole
                keys, values = k[i, first:end], v[i, first:end]
            keys, values = keys.float(), values.float()  # reads every row of the tiles
            qi = q_flat[a:b].float()
            ki = keys.repeat_interleave(group, dim=1)
            vi = values.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
            pos = torch.arange(n_q)[:, None] + n_k - n_q
            key_pos = torch.arange(first, end)[None, :]
            visible = key_pos < n_k
            if causal:
                visible = visible & (key_pos <= pos)
            if local:
                if left is not None:
                    visible = visible & (key_pos >= pos - left)
                if right is not None:
                    visible = visible & (key_pos <= pos + right)
            scores = scores.masked_fill(~visible, float("-inf"))
            row_max = scores.amax(dim=-1, keepdim=True)
            seen = torch.isfinite(row_max)
            p = torch.exp(scores - torch.where(seen, row_max, torch.zeros_like(row_max)))
            # P = 0 past the length, and P @ V still runs over the whole tile: 0 x NaN is NaN.
            # The keys past the length are summed on their own, so that the result does not hang
            # on how far the tiles or pages reach: a reduction over 256 keys, the last 56 of them
            # zero, need not round as one over 200 does (on the Zen 5 machine torch's did not).
            n = n_k - first
            total = p[..., :n].sum(dim=-1, keepdim=True) + p[..., n:].sum(dim=-1, keepdim=True)
            pv = torch.einsum("hqk,khd->qhd", p[..., :n], vi[:n])
            pv = pv + torch.einsum("hqk,khd->qhd", p[..., n:], vi[n:])
            o = pv / torch.where(seen, total, 1.0).transpose(0, 1)
            out[a:b] = torch.where(seen.transpose(0, 1), o, torch.zeros_like(o)).to(out.dtype)
            lse[:, a:b] = torch.where(
                seen, row_max + torch.log(total), torch.full_like(row_max, float("-inf"))
            ).squeeze(-1)
        if cu_seqlens_q is None:
            out = out.reshape(q.shape[0], q.shape[1], heads, head_dim_v)
            lse = lse.reshape(heads, batch, -1).transpose(0, 1)
        return out, (lse if return_lse else None)


def _resolve(causal, window_size):
    """FA4's ``_resolve_causal_local_window``: (causal, local, left, right)."""
    left, right = window_size
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    if left is not None or right is not None:
        if left is None and right == 0:
            return True, False, None, None
        return False, True, left, right
    return causal, False, left, right
