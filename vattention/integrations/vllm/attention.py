"""The attention backend vLLM runs when the plugin is on: dense per-layer caches, no block table.

vLLM calls :meth:`VAttentionImpl.forward` once per layer with the step's new ``key``/``value`` rows
and queries. The layer's K and V are one vattention tensor each, ``[max_num_seqs, max_seq,
kv_heads, head_dim]`` (``max_seq``: ``max_model_len`` rounded up to whole blocks), whose pages the
runner mapped with ``KVCache.step()`` before the forward. The whole batch (decode rows and prefill
chunks together, vLLM's varlen layout) goes through one attention call: each request's new K/V
are written at ``[past, past + new)`` of its row (its slot), and its queries attend causally over
its row, with the layer's sliding window and fp8 scales.

* CPU: vattention's native kernel (:func:`vattention.attention.cpu_attention`, with
  ``flash_attn_with_kvcache``'s semantics: ``cache_batch_idx`` = slots), writing into vLLM's
  output buffer; prepared once per layer (:class:`~vattention.attention.CpuAttentionPlan`) and
  once per step (:class:`~vattention.attention.CpuAttentionBatch`, in the metadata), so that a
  layer's call checks only its own tensors.
* CUDA (:class:`VAttentionFlashBackend`): the kernel is chosen once per process when the first
  layer is built (:func:`.flash.select_cuda_kernel`). vLLM's own FlashAttention,
  ``vllm.vllm_flash_attn`` (in every CUDA wheel), first: its ``flash_attn_varlen_func`` reads
  each row as a block table over a blocked view of the dense tensor, after vLLM's
  ``reshape_and_cache_flash`` wrote the new K/V (:mod:`.flash`). Else the ``flash-attn``
  package, as before: ``flash_attn_with_kvcache`` (one varlen call with FlashAttention 3, else
  one batched decode call and one call per prefill chunk). Neither: refused at start-up. The
  CUDA path was read from vLLM 0.32.0's and 0.33.0's wheel sources and tested on the CPU with a
  torch stand-in for the kernel; it never ran on a GPU.

No kernel reads a position at or beyond a request's length, and the block tables keep the paged
kernel off a sliding window's released pages, so nothing unmapped is touched.

``forward_includes_kv_cache_update = True`` tells vLLM not to write K/V into a block buffer of its
own (there is none: the runner binds empty placeholders).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, ClassVar, List, Optional

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from ...attention import CpuAttentionBatch, CpuAttentionPlan
from .. import flash_attn as fa
from .flash import (
    CudaKernel,
    FlashBatch,
    QKVScales,
    layer_blocks,
    paged_attention,
    select_cuda_kernel,
)
from .kv_layout import FP8_DTYPES
from .prefix_hint import SharedPrefixMemo

if TYPE_CHECKING:
    from .runner import BatchSlots

__all__ = [
    "VAttentionBackend",
    "VAttentionCPUBackend",
    "VAttentionFlashBackend",
    "VAttentionFlashImpl",
    "VAttentionFlashMetadataBuilder",
    "VAttentionImpl",
    "VAttentionMetadata",
    "VAttentionMetadataBuilder",
]


@dataclasses.dataclass
class VAttentionMetadata:
    """One step's batch as the kernel needs it (rows in vLLM's batch order, decodes first)."""

    num_actual_tokens: int
    num_decodes: int  # leading rows with one query token (all decodes on CUDA)
    query_start: List[int]  # row i's tokens are [query_start[i], query_start[i + 1])
    slots: List[int]  # vattention slot of each row
    past: List[int]  # tokens cached for each row before this step
    cu_seqlens_q: torch.Tensor  # int32 [rows + 1], on the model's device
    cache_batch_idx: torch.Tensor  # int32 [rows]
    cache_seqlens: torch.Tensor  # int32 [rows]
    max_query_len: int
    # CPU with prefix caching: rows sharing cached blocks (the kernel's prefix hint), else None
    prefix_groups: Optional[torch.Tensor] = None
    prefix_lens: Optional[torch.Tensor] = None
    # CUDA with vLLM's FlashAttention: the step's block tables and cache slots, else None
    flash: Optional[FlashBatch] = None
    # CPU: the step's requests as the kernel takes them, checked once for every layer
    cpu_batch: Optional[CpuAttentionBatch] = None


class VAttentionMetadataBuilder(AttentionMetadataBuilder[VAttentionMetadata]):
    """Builds :class:`VAttentionMetadata` from vLLM's common metadata and the runner's slots."""

    reorder_batch_threshold: ClassVar[Optional[int]] = 1  # vLLM moves one-token (decode) rows first

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Set by the runner when it builds the cache: the step's slots and cached lengths.
        self.batch_source: Optional[Callable[[], Optional[BatchSlots]]] = None

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> VAttentionMetadata:
        cm = common_attn_metadata
        batch = self.batch_source() if self.batch_source is not None else None
        if batch is None or len(batch.slots) != cm.num_reqs:
            raise RuntimeError(
                f"vattention: attention metadata for {cm.num_reqs} requests but the runner "
                f"placed {0 if batch is None else len(batch.slots)} in slots this step"
            )
        starts = cm.query_start_loc_cpu[: cm.num_reqs + 1]
        qlens = (starts[1:] - starts[:-1]).tolist()
        num_decodes = next((i for i, n in enumerate(qlens) if n != 1), len(qlens))
        ints = dict(dtype=torch.int32, device=self.device)
        return VAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_decodes=num_decodes,
            query_start=starts.tolist(),
            slots=batch.slots,
            past=batch.past,
            cu_seqlens_q=starts.to(**ints),
            cache_batch_idx=torch.tensor(batch.slots, **ints),
            cache_seqlens=torch.tensor(batch.past, **ints),
            max_query_len=max(qlens, default=0),
        )


class VAttentionCPUMetadataBuilder(VAttentionMetadataBuilder):
    """The CPU kernel takes decode rows and prefill chunks in any order in its one call: vLLM
    need not reorder the batch each step (it costs about as much as the runner's own update).
    With prefix caching it also tells the kernel which rows share cached blocks
    (:mod:`.prefix_hint`)."""

    reorder_batch_threshold: ClassVar[Optional[int]] = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        self.shared_prefixes = SharedPrefixMemo()

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> VAttentionMetadata:
        m = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.prefix_caching:
            # block ids count kv_cache_spec.block_size tokens: the backend takes any kernel block
            # size (MultipleOf(1)), so vLLM keeps its manager's block size for this table
            # (select_common_block_size)
            cm = common_attn_metadata
            m.prefix_groups, m.prefix_lens = self.shared_prefixes(
                cm.block_table_tensor[: cm.num_reqs], m.past, self.kv_cache_spec.block_size
            )
        m.cpu_batch = CpuAttentionBatch(
            m.cu_seqlens_q,
            m.cache_seqlens,
            m.cache_batch_idx,
            prefix_groups=m.prefix_groups,
            prefix_lens=m.prefix_lens,
        )
        return m


class VAttentionFlashMetadataBuilder(VAttentionMetadataBuilder):
    """CUDA: with vLLM's FlashAttention, also the step's :class:`.flash.FlashBatch` (block tables
    over the slots' rows, the new tokens' cache slots), built once per step on the device for
    the group's layers."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.paged = select_cuda_kernel().paged
        self.block_size = int(kv_cache_spec.block_size)  # one page of the cache (kv_layout)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> VAttentionMetadata:
        m = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.paged:
            starts = m.query_start
            m.flash = FlashBatch.build(
                cu_seqlens_q=m.cu_seqlens_q,
                slots=m.cache_batch_idx,
                past=m.cache_seqlens,
                query_lens=[b - a for a, b in zip(starts, starts[1:])],
                past_lens=m.past,
                block_size=self.block_size,
            )
        return m


class VAttentionImpl(AttentionImpl):
    """Causal decoder self-attention over each request's contiguous row of the vattention cache,
    with the layer's sliding window and fp8 K/V scales."""

    kernel: Optional[CudaKernel] = None  # CUDA: chosen when the layer is built (the Flash impl)

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: Optional[List[float]],
        sliding_window: Optional[int],
        kv_cache_dtype: str,
        logits_soft_cap: Optional[float] = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: Optional[str] = None,
        sinks: Optional[torch.Tensor] = None,
    ) -> None:
        unsupported = {
            "ALiBi": alibi_slopes is not None,
            f"logits soft-capping ({logits_soft_cap})": bool(logits_soft_cap),
            "attention sinks": sinks is not None,
            "cross-layer KV sharing": kv_sharing_target_layer_name is not None,
            f"{attn_type} attention": attn_type != AttentionType.DECODER,
            f"kv_cache_dtype={kv_cache_dtype!r}": kv_cache_dtype not in ("auto", *FP8_DTYPES),
        }
        bad = [name for name, present in unsupported.items() if present]
        if bad:
            raise NotImplementedError(
                "vattention's vLLM plugin serves causal decoder attention without "
                f"{', '.join(bad)}; unset VATTENTION_VLLM to serve this model"
            )
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        # vLLM's window W: a query at p reads keys (p - W, p]; FlashAttention's (W - 1, 0).
        self.window_size = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = kv_cache_dtype != "auto"
        self.kv_sharing_target_layer_name = None
        # CPU: the layer's kernel call prepared for its caches and scales (_cpu_plan)
        self._plan: Optional[CpuAttentionPlan] = None
        self._plan_for: Any = None  # the layer's (k_cache, v_cache) it was made for
        self._plan_scales: Optional[tuple] = None  # and the fp8 scales

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Optional[VAttentionMetadata],
        output: torch.Tensor,
        output_scale=None,
        output_block_scale=None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("vattention: fused output quantization is not supported")
        if attn_metadata is None:  # vLLM's warm-up, profiling and CUDA graph capture runs
            return output
        m = attn_metadata
        n = m.num_actual_tokens
        out = output
        if n != query.shape[0]:  # buffers padded past the step's tokens (CUDA graphs' sizes)
            query, key, value, out = query[:n], key[:n], value[:n], output[:n]
        if not query.is_cpu:
            self._forward_cuda(layer, query, key, value, m, out)
            return output
        if m.cpu_batch is None:
            raise RuntimeError(
                "vattention: the CPU kernel needs VAttentionCPUMetadataBuilder's batch (the "
                "CPU_ATTN backend's builder)"
            )
        # the kernel writes straight into vLLM's output buffer (no new tensor, no copy)
        self._cpu_plan(layer, query.dtype)(query, key, value, m.cpu_batch, out.view(query.shape))
        return output

    def _cpu_plan(self, layer, dtype: torch.dtype) -> CpuAttentionPlan:
        """The layer's prepared kernel call, made again when the runner gives the layer other
        caches or vLLM other fp8 scales (its first forward may compute them)."""
        kv = layer.vattention_kv
        scales = (layer._k_scale_float, layer._v_scale_float) if self.fp8 else None
        plan = self._plan
        if plan is None or self._plan_for is not kv or self._plan_scales != scales:
            k_cache, v_cache = kv
            plan = CpuAttentionPlan(
                k_cache,
                v_cache,
                self.num_heads,
                dtype=dtype,
                softmax_scale=self.scale,
                causal=True,
                window_size=self.window_size,
                **self._float_scales(layer),
            )
            self._plan, self._plan_for, self._plan_scales = plan, kv, scales
        return plan

    def _float_scales(self, layer) -> dict:
        """vLLM's per-tensor fp8 scales as floats (1.0 unless the checkpoint brings its own)."""
        if not self.fp8:
            return {}
        return dict(k_descale=layer._k_scale_float, v_descale=layer._v_scale_float)

    def _forward_cuda(self, layer, query, key, value, m: VAttentionMetadata, output) -> None:
        """vLLM's FlashAttention over the blocked rows, else flash-attn as before (the tensors
        are the step's ``num_actual_tokens`` rows)."""
        kernel = self.kernel or select_cuda_kernel()
        if kernel.paged:
            if m.flash is None:
                raise RuntimeError(
                    "vattention: vLLM's FlashAttention needs VAttentionFlashMetadataBuilder's "
                    "block tables (the FLASH_ATTN backend's builder)"
                )
            paged_attention(
                kernel,
                query,
                key,
                value,
                layer_blocks(layer, m.flash.block_size),
                m.flash,
                output.view(query.shape),  # vLLM's buffer, written in place (as on the CPU)
                softmax_scale=self.scale,
                window_size=self.window_size,
                kv_cache_dtype=self.kv_cache_dtype,
                scales=QKVScales(layer._q_scale, layer._k_scale, layer._v_scale),
            )
            return
        k_cache, v_cache = layer.vattention_kv
        scales = self._float_scales(layer)
        if not kernel.kvcache_varlen:
            _per_row(self, query, key, value, k_cache, v_cache, m, output, scales)
            return
        output[:] = fa.flash_attn_with_kvcache(
            query,
            k_cache,
            v_cache,
            k=key,
            v=value,
            cache_seqlens=m.cache_seqlens,
            cache_batch_idx=m.cache_batch_idx,
            cu_seqlens_q=m.cu_seqlens_q,
            max_seqlen_q=m.max_query_len,
            softmax_scale=self.scale,
            causal=True,
            window_size=self.window_size,
            check_reads=False,  # stepped to these lengths this step; a check would sync per layer
            **scales,
        )


def _per_row(impl: VAttentionImpl, query, key, value, k_cache, v_cache, m, output, scales):
    """FlashAttention 2 (flash-attn) on CUDA: one batched call for the decode rows, one per
    prefill chunk."""
    d = m.num_decodes
    # The worker stepped the cache to these lengths this step: no read check (on CUDA it would
    # copy the lengths to the host, a synchronization per layer).
    common = dict(
        softmax_scale=impl.scale,
        causal=True,
        window_size=impl.window_size,
        check_reads=False,
        **scales,
    )
    if d:
        output[:d] = fa.flash_attn_with_kvcache(
            query[:d].unsqueeze(1),
            k_cache,
            v_cache,
            k=key[:d].unsqueeze(1),
            v=value[:d].unsqueeze(1),
            cache_seqlens=m.cache_seqlens[:d],
            cache_batch_idx=m.cache_batch_idx[:d],
            **common,
        ).squeeze(1)
    for row in range(d, len(m.slots)):
        a, b = m.query_start[row], m.query_start[row + 1]
        output[a:b] = fa.flash_attn_with_kvcache(
            query[a:b].unsqueeze(0),
            k_cache,
            v_cache,
            k=key[a:b].unsqueeze(0),
            v=value[a:b].unsqueeze(0),
            cache_seqlens=m.cache_seqlens[row : row + 1],
            cache_batch_idx=m.cache_batch_idx[row : row + 1],
            **common,
        ).squeeze(0)


class VAttentionFlashImpl(VAttentionImpl):
    """:class:`VAttentionImpl` on CUDA. Building the first layer chooses the process's kernel
    (:func:`.flash.select_cuda_kernel`, logged once); each layer then refuses what that kernel
    cannot run, and with an fp8 cache on FlashAttention 3 asks vLLM's layer to quantize the
    queries (``supports_quant_query_input``, as vLLM's FLASH_ATTN backend does)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kernel = select_cuda_kernel()
        self.kernel.check_layer(self.head_size, self.kv_cache_dtype)
        self.supports_quant_query_input = self.kernel.quantizes_query(self.kv_cache_dtype)


class VAttentionBackend(AttentionBackend):
    """Dense-cache attention over vattention tensors; registered under a vLLM backend name."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[List[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", *FP8_DTYPES]

    @staticmethod
    def get_impl_cls():
        return VAttentionImpl

    @staticmethod
    def get_builder_cls():
        return VAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple:
        # Only vLLM's own allocator would ask; the vattention runner never allocates this buffer.
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> List[int]:
        return []  # any: the kernels take the head size from the tensors

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True  # absolute positions over the dense row; released pages are never read


class VAttentionCPUBackend(VAttentionBackend):
    """Registered in place of vLLM's ``CPU_ATTN``, the backend the CPU platform selects."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_builder_cls():
        return VAttentionCPUMetadataBuilder


class VAttentionFlashBackend(VAttentionBackend):
    """Registered in place of vLLM's ``FLASH_ATTN``, which the plugin selects on CUDA."""

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"

    @staticmethod
    def get_impl_cls():
        return VAttentionFlashImpl

    @staticmethod
    def get_builder_cls():
        return VAttentionFlashMetadataBuilder
