"""The attention backend vLLM runs when the plugin is on: dense per-layer caches, no block table.

vLLM calls :meth:`VAttentionImpl.forward` once per layer with the step's new ``key``/``value``
rows and queries. The layer's K and V are one vattention tensor each, ``[max_num_seqs,
max_model_len, kv_heads, head_dim]``, whose pages the runner mapped with ``KVCache.step()`` before
the forward. Decode rows (one query each; vLLM puts them first, see ``reorder_batch_threshold``)
go through one batched :func:`vattention.integrations.flash_attn.decode` call with
``cache_batch_idx`` = the requests' slots; each prefill (or prefill chunk) goes through
:func:`~vattention.integrations.flash_attn.prefill`. Both append the new K/V in place at
``[num_computed, num_computed + new)`` and attend causally; both dispatch to FlashAttention's
``flash_attn_with_kvcache`` for CUDA tensors and to its SDPA reference on the CPU. No kernel reads
a position at or beyond a request's length, so nothing unmapped is touched.

``forward_includes_kv_cache_update = True`` tells vLLM not to write K/V into a block buffer of its
own (there is none: the runner binds empty placeholders).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, List, Optional

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from .. import flash_attn as fa
from .runner import current_batch

__all__ = ["VAttentionBackend", "VAttentionCPUBackend", "VAttentionFlashBackend",
           "VAttentionImpl", "VAttentionMetadata",
           "VAttentionMetadataBuilder"]


@dataclasses.dataclass
class VAttentionMetadata:
    """One step's batch as the kernels need it (rows in vLLM's batch order, decodes first)."""

    num_actual_tokens: int
    num_decodes: int                 # leading rows with exactly one query token
    query_start: List[int]           # row i's tokens are [query_start[i], query_start[i + 1])
    slots: List[int]                 # vattention slot of each row
    past: List[int]                  # tokens cached for each row before this step
    decode_slots: torch.Tensor       # int32 [num_decodes], on the model's device
    decode_past: torch.Tensor        # int32 [num_decodes]


class VAttentionMetadataBuilder(AttentionMetadataBuilder[VAttentionMetadata]):
    """Builds :class:`VAttentionMetadata` from vLLM's common metadata and the runner's slots."""

    reorder_batch_threshold: ClassVar[int] = 1    # vLLM moves one-token (decode) rows first

    # vLLM declares the base __init__ abstract: a builder must define one even if it adds nothing.
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> VAttentionMetadata:
        cm = common_attn_metadata
        batch = current_batch()
        if batch is None or len(batch.slots) != cm.num_reqs:
            raise RuntimeError(
                f"vattention: attention metadata for {cm.num_reqs} requests but the runner "
                f"placed {0 if batch is None else len(batch.slots)} in slots this step")
        starts = cm.query_start_loc_cpu[:cm.num_reqs + 1].tolist()
        qlens = [b - a for a, b in zip(starts, starts[1:])]
        num_decodes = next((i for i, n in enumerate(qlens) if n != 1), len(qlens))
        return VAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens, num_decodes=num_decodes, query_start=starts,
            slots=batch.slots, past=batch.past,
            decode_slots=torch.tensor(batch.slots[:num_decodes], dtype=torch.int32,
                                      device=self.device),
            decode_past=torch.tensor(batch.past[:num_decodes], dtype=torch.int32,
                                     device=self.device))


class VAttentionImpl(AttentionImpl):
    """Causal decoder self-attention over a request's contiguous row of the vattention cache."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Optional[List[float]], sliding_window: Optional[int],
                 kv_cache_dtype: str, logits_soft_cap: Optional[float] = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None,
                 sinks: Optional[torch.Tensor] = None) -> None:
        unsupported = {
            "ALiBi": alibi_slopes is not None,
            f"a sliding window ({sliding_window})": sliding_window is not None,
            f"logits soft-capping ({logits_soft_cap})": bool(logits_soft_cap),
            "attention sinks": sinks is not None,
            "cross-layer KV sharing": kv_sharing_target_layer_name is not None,
            f"{attn_type} attention": attn_type != AttentionType.DECODER,
            f"kv_cache_dtype={kv_cache_dtype!r}": kv_cache_dtype != "auto",
        }
        bad = [name for name, present in unsupported.items() if present]
        if bad:
            raise NotImplementedError(
                "vattention's vLLM plugin serves causal decoder attention without "
                f"{', '.join(bad)}; unset VATTENTION_VLLM to serve this model")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.kv_sharing_target_layer_name = None

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Optional[VAttentionMetadata],
                output: torch.Tensor, output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("vattention: fused output quantization is not supported")
        if attn_metadata is None:  # vLLM's warm-up and profiling runs carry no metadata
            return output
        m = attn_metadata
        k_cache, v_cache = layer.vattention_kv
        d = m.num_decodes
        if d:
            out = fa.decode(query[:d].unsqueeze(1), k_cache, v_cache, key[:d].unsqueeze(1),
                            value[:d].unsqueeze(1), m.decode_past, m.decode_slots,
                            softmax_scale=self.scale)
            output[:d] = out.squeeze(1)
        for row in range(d, len(m.slots)):
            a, b = m.query_start[row], m.query_start[row + 1]
            output[a:b] = fa.prefill(query[a:b], key[a:b], value[a:b], k_cache, v_cache,
                                     m.slots[row], start=m.past[row], softmax_scale=self.scale)
        return output


class VAttentionBackend(AttentionBackend):
    """Dense-cache attention over vattention tensors; registered under a vLLM backend name."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[List[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_impl_cls():
        return VAttentionImpl

    @staticmethod
    def get_builder_cls():
        return VAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple:
        # Only vLLM's own allocator asks; the vattention runner never allocates this buffer.
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> List[int]:
        return []   # any: the kernels take the head size from the tensors

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False


class VAttentionCPUBackend(VAttentionBackend):
    """Registered in place of vLLM's ``CPU_ATTN``, the backend the CPU platform selects."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"


class VAttentionFlashBackend(VAttentionBackend):
    """Registered in place of vLLM's ``FLASH_ATTN``, which the plugin selects on CUDA."""

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"
