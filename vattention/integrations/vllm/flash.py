"""The plugin's CUDA attention: vLLM's own FlashAttention build over the dense rows, seen as blocks.

Every CUDA wheel of vLLM ships FlashAttention as ``vllm.vllm_flash_attn`` (FA2 and FA3 extensions).
Its Python interface offers ``flash_attn_varlen_func`` (paged through ``block_table`` +
``seqused_k``) but no ``flash_attn_with_kvcache``, so it cannot append the step's K/V itself; vLLM's
own FLASH_ATTN backend writes them first with ``reshape_and_cache_flash`` (``vllm._custom_ops``) and
then makes one varlen call for the whole batch. The plugin does the same over the vattention cache:

* A layer's dense K ``[max_batch, max_seq, kv_heads, head_dim]`` is viewed, without a copy, as
  blocks ``[num_blocks, block_size, kv_heads, head_dim]`` (:func:`blocked_cache`): block ``j`` of
  slot ``s`` is block id ``s * blocks_per_row + j``, with the cache's real strides (a row is padded
  to whole pages; in the ``mega`` layout a token's stride spans every layer). The block size is
  vLLM's, which is one page of the cache (FA2 wants a multiple of 16: the plugin makes vLLM's block
  size one on CUDA).
* Each step, :class:`FlashBatch` gives every request the block table of its slot's row; on a
  sliding-window layer the blocks lying wholly before the first key the step reads point at the
  row's last block instead (the kernels load whole tiles, and those pages may be unmapped: the
  kernel masks the keys, so what it loads there never counts).
* :func:`paged_attention` writes the new K/V with ``reshape_and_cache_flash`` on the blocked view
  (vLLM's own op: fp8 caches get vLLM's bytes, divided by the layer's scale), then calls
  ``flash_attn_varlen_func`` once: decode rows and prefill chunks together, causal, the layer's
  window, and for fp8 caches (FA3 only) the q/k/v descales the way vLLM passes them.

Where ``vllm.vllm_flash_attn`` does not import, the ``flash-attn`` package is the fallback
(:func:`select_cuda_kernel`; the caller keeps its ``flash_attn_with_kvcache`` path for it); with
neither, CUDA attention is refused. Written from the 0.32.0 and 0.33.0 wheels' Python sources and
tested on the CPU with a torch stand-in for the kernel (tests/test_vllm_flash.py): it never ran on a
GPU. vLLM is imported only inside :func:`select_cuda_kernel`, so the rest runs without vLLM.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ...errors import BackendUnavailableError
from .. import flash_attn as fa

__all__ = [
    "BLOCK_MULTIPLE",
    "BlockedCache",
    "CudaKernel",
    "FlashBatch",
    "QKVScales",
    "blocked_cache",
    "layer_blocks",
    "paged_attention",
    "reset_selection",
    "select_cuda_kernel",
    "selected_kernel",
]

logger = logging.getLogger("vllm.vattention")

# FA2's paged varlen kernel: "Paged KV cache block size must be divisible by 16" (its extension).
BLOCK_MULTIPLE = 16
# vLLM's FlashAttentionBackend.supports_head_size without FA4: multiples of 8 up to 256.
MAX_HEAD_SIZE = 256
# The FlashAttention versions this path was written for, preferred first. FA4 (Blackwell, a
# CuTe-DSL kernel with page-size rules of its own) is not used: FA2 serves those GPUs here.
PAGED_FA_VERSIONS = (3, 2)
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")  # what FA3 reads: e4m3 only (vLLM's fa_utils)


@dataclasses.dataclass(frozen=True)
class CudaKernel:
    """The CUDA attention this process uses, chosen once by :func:`select_cuda_kernel`.

    ``varlen`` and ``write_kv`` are vLLM's ``flash_attn_varlen_func`` and
    ``reshape_and_cache_flash`` (the paged path); ``kvcache`` is flash-attn's
    ``flash_attn_with_kvcache`` (the fallback, ``kvcache_varlen`` when it takes ``cu_seqlens_q``).
    """

    package: str
    fa_version: Optional[int] = None
    varlen: Optional[Callable[..., Any]] = None
    write_kv: Optional[Callable[..., None]] = None
    kvcache: Optional[Callable[..., Any]] = None
    kvcache_varlen: bool = False

    @property
    def paged(self) -> bool:
        """vLLM's FlashAttention over the blocked view (:func:`paged_attention`)."""
        return self.varlen is not None

    @property
    def label(self) -> str:
        """What the INFO line and the stats file call it."""
        if self.paged:
            return f"{self.package} (FA{self.fa_version})"
        return f"{self.package} ({'varlen' if self.kvcache_varlen else 'per row'})"

    def check_layer(self, head_size: int, kv_cache_dtype: str) -> None:
        """Refuse, when the layer is built, what vLLM's FlashAttention cannot run (vLLM's own
        FLASH_ATTN backend refuses the same)."""
        if not self.paged:
            return  # flash-attn: today's behaviour, its own errors
        if head_size % 8 or head_size > MAX_HEAD_SIZE:
            raise NotImplementedError(
                f"vattention's vLLM plugin on CUDA runs vLLM's FlashAttention, which takes head "
                f"sizes that are multiples of 8 up to {MAX_HEAD_SIZE}, not {head_size}; unset "
                "VATTENTION_VLLM to serve this model"
            )
        if kv_cache_dtype != "auto" and (
            kv_cache_dtype not in FP8_CACHE_DTYPES or self.fa_version != 3
        ):
            raise NotImplementedError(
                f"vattention's vLLM plugin on CUDA reads an fp8 KV cache with vLLM's "
                f"FlashAttention 3 (fp8_e4m3 only); this GPU runs FA{self.fa_version} and the "
                f"cache is {kv_cache_dtype!r}: pass --kv-cache-dtype auto, or unset VATTENTION_VLLM"
            )

    def quantizes_query(self, kv_cache_dtype: str) -> bool:
        """FA3 reads an fp8 cache with fp8 queries: the layer then quantizes them (vLLM's
        ``supports_quant_query_input``), as for vLLM's own FLASH_ATTN backend."""
        return self.paged and kv_cache_dtype in FP8_CACHE_DTYPES


_selected: Optional[CudaKernel] = None


def select_cuda_kernel() -> CudaKernel:
    """This process's CUDA attention: ``vllm.vllm_flash_attn`` when it imports (every CUDA wheel
    of vLLM), else the ``flash-attn`` package; neither raises :class:`BackendUnavailableError`.

    Chosen once (the first attention layer built) and logged once at INFO.
    """
    global _selected
    if _selected is None:
        kernel = _select()
        logger.info("vattention: CUDA attention through %s", _describe(kernel))
        _selected = kernel
    return _selected


def selected_kernel() -> Optional[CudaKernel]:
    """The choice :func:`select_cuda_kernel` made in this process, None before it ran."""
    return _selected


def reset_selection() -> None:
    """Forget this process's choice (tests)."""
    global _selected
    _selected = None


def _select() -> CudaKernel:
    try:
        return _vllm_flash_attn()
    except Exception as e:  # ImportError, or an error loading the CUDA extension
        unavailable = f"vllm.vllm_flash_attn: {e}"
    kernel = fa.flash_kernel()
    if kernel is not None:
        logger.info("vattention: %s; flash-attn is the fallback", unavailable)
        varlen = "cu_seqlens_q" in inspect.signature(kernel).parameters
        return CudaKernel("flash_attn", kvcache=kernel, kvcache_varlen=varlen)
    raise BackendUnavailableError(
        "vattention's vLLM plugin on CUDA needs vLLM's FlashAttention (vllm.vllm_flash_attn, in "
        f"vLLM's CUDA wheels) or the flash-attn package; neither imports ({unavailable}; "
        "flash_attn: not importable). Install vLLM's CUDA wheel, or unset VATTENTION_VLLM"
    )


def _vllm_flash_attn() -> CudaKernel:
    from vllm._custom_ops import reshape_and_cache_flash
    from vllm.vllm_flash_attn import flash_attn_varlen_func, is_fa_version_supported

    return CudaKernel(
        "vllm.vllm_flash_attn",
        fa_version=_fa_version(is_fa_version_supported),
        varlen=flash_attn_varlen_func,
        write_kv=reshape_and_cache_flash,
    )


def _fa_version(is_supported: Callable[[int], bool]) -> int:
    """vLLM's own choice (``get_flash_attn_version``: FA3 on Hopper, FA2 before it, or the
    ``--attention-config`` ``flash_attn_version``) where it is 2 or 3; else the first of
    :data:`PAGED_FA_VERSIONS` this GPU supports."""
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

        chosen = get_flash_attn_version()
    except Exception:  # not there (tests), or vLLM could not tell
        chosen = None
    if chosen in PAGED_FA_VERSIONS:
        return int(chosen)
    for version in PAGED_FA_VERSIONS:
        if is_supported(version):
            return version
    raise ImportError(f"no FlashAttention version among {PAGED_FA_VERSIONS} runs on this GPU")


def _describe(kernel: CudaKernel) -> str:
    if kernel.paged:
        return (
            f"vllm.vllm_flash_attn.flash_attn_varlen_func (FlashAttention {kernel.fa_version}), "
            "one call per layer over the dense rows seen as blocks"
        )
    how = "one varlen call" if kernel.kvcache_varlen else "one decode call plus one per prefill"
    return f"flash_attn.flash_attn_with_kvcache ({how})"


# ---- the dense rows as blocks ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BlockedCache:
    """One layer's K and V seen as ``[num_blocks, block_size, kv_heads, head_dim]`` blocks of the
    same memory: block ``j`` of slot ``s`` is ``s * blocks_per_row + j``. ``dense_k`` is the
    layer's dense K it was made from (a rebuilt cache makes new views)."""

    k: torch.Tensor
    v: torch.Tensor
    block_size: int
    blocks_per_row: int
    dense_k: torch.Tensor

    @property
    def row_tokens(self) -> int:
        """Token positions between the starts of two slots' rows (the padded row)."""
        return self.blocks_per_row * self.block_size


def blocked_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int) -> BlockedCache:
    """The blocked view of a layer's dense K and V (``as_strided`` over their real strides).

    Needs ``block_size`` to be a multiple of :data:`BLOCK_MULTIPLE`, to divide ``max_seq`` (the
    runner rounds the cache's rows up to whole blocks, so that the last slot's last block lies
    within the tensor), and to divide the row stride (a row is padded to whole pages, which are
    whole blocks).
    """
    if block_size % BLOCK_MULTIPLE:
        raise ValueError(
            f"block_size={block_size}: FlashAttention's paged kernel needs a multiple of "
            f"{BLOCK_MULTIPLE}"
        )
    views = [_blocks(t, block_size, name) for t, name in ((k_cache, "K"), (v_cache, "V"))]
    (k, k_per_row), (v, v_per_row) = views
    if k_per_row != v_per_row:
        raise ValueError(f"K rows hold {k_per_row} blocks, V rows {v_per_row}: one table for both")
    return BlockedCache(k, v, block_size, k_per_row, k_cache)


def _blocks(dense: torch.Tensor, block_size: int, name: str) -> Tuple[torch.Tensor, int]:
    if dense.dim() != 4 or dense.stride(3) != 1:
        raise ValueError(f"{name}: a [max_batch, max_seq, heads, dim] tensor with unit last stride")
    max_batch, max_seq, heads, dim = dense.shape
    slot_stride, token_stride, head_stride, _ = dense.stride()
    block_stride = block_size * token_stride
    if max_seq % block_size or slot_stride % block_stride:
        raise ValueError(
            f"{name}: rows of {max_seq} tokens, {slot_stride} elements apart, are not whole "
            f"blocks of {block_size} tokens ({block_stride} elements)"
        )
    per_row = slot_stride // block_stride
    # up to the last row's last token: its padding lies outside the tensor
    num_blocks = (max_batch - 1) * per_row + max_seq // block_size
    view = dense.as_strided(
        (num_blocks, block_size, heads, dim),
        (block_stride, token_stride, head_stride, 1),
        dense.storage_offset(),
    )
    return view, per_row


def layer_blocks(layer: Any, block_size: int) -> BlockedCache:
    """The blocked view of ``layer.vattention_kv``, made once per cache and kept on the layer."""
    k_cache, v_cache = layer.vattention_kv
    cached = getattr(layer, "vattention_blocks", None)
    if cached is None or cached.dense_k is not k_cache or cached.block_size != block_size:
        cached = blocked_cache(k_cache, v_cache, block_size)
        layer.vattention_blocks = cached
    return cached


# ---- one step's batch --------------------------------------------------------------------------
@dataclasses.dataclass
class FlashBatch:
    """One step's batch as ``flash_attn_varlen_func`` reads it, built once per step on the device
    (shared by the layers of a KV cache group): rows in vLLM's order."""

    block_size: int
    cu_seqlens_q: torch.Tensor  # int32 [rows + 1]
    max_seqlen_q: int
    seqused_k: torch.Tensor  # int32 [rows]: keys after this step's tokens
    max_seqlen_k: int
    slots: torch.Tensor  # int64 [rows]
    past: torch.Tensor  # int64 [rows]: tokens cached before this step
    token_slots: torch.Tensor  # int64 [tokens]: each new token's slot
    token_positions: torch.Tensor  # int64 [tokens]: and its position in the row
    _memo: Dict[Tuple[str, int, int, int], torch.Tensor] = dataclasses.field(default_factory=dict)

    @classmethod
    def build(
        cls,
        *,
        cu_seqlens_q: torch.Tensor,
        slots: torch.Tensor,
        past: torch.Tensor,
        query_lens: List[int],
        past_lens: List[int],
        block_size: int,
    ) -> FlashBatch:
        """From the metadata's device tensors (``cu_seqlens_q``, the rows' slots and cached
        lengths) and the host's query and cached lengths (for the host ints)."""
        device = cu_seqlens_q.device
        num_tokens = sum(query_lens)
        starts = cu_seqlens_q[:-1].long()
        lens = cu_seqlens_q[1:].long() - starts
        row = torch.repeat_interleave(
            torch.arange(len(query_lens), device=device), lens, output_size=num_tokens
        )
        slots, past = slots.long(), past.long()
        offset = torch.arange(num_tokens, device=device) - starts[row]
        return cls(
            block_size=block_size,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max(query_lens, default=0),
            seqused_k=(past + lens).to(torch.int32),
            max_seqlen_k=max((p + q for p, q in zip(past_lens, query_lens)), default=0),
            slots=slots,
            past=past,
            token_slots=slots[row],
            token_positions=past[row] + offset,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.token_slots.shape[0])

    def slot_mapping(self, cache: BlockedCache) -> torch.Tensor:
        """``reshape_and_cache_flash``'s slot of each new token: ``block * block_size + offset``
        in the blocked view, i.e. ``slot * row_tokens + position``."""
        key = ("slots", cache.row_tokens, 0, 0)
        if key not in self._memo:
            self._memo[key] = self.token_slots * cache.row_tokens + self.token_positions
        return self._memo[key]

    def block_table(self, cache: BlockedCache, window_left: int) -> torch.Tensor:
        """int32 ``[rows, ceil(max_seqlen_k / block_size)]``: each row's blocks in order.

        With a window (``window_left >= 0``: a query at ``p`` reads keys from ``p - left``), the
        blocks wholly before the first key the step reads (its first query's window start) may
        be unmapped holes: they name the row's last block instead, which holds this step's
        tokens. The kernel masks those keys; whatever a tile load reads there is never used.
        """
        key = ("table", cache.blocks_per_row, cache.block_size, window_left)
        if key not in self._memo:
            bs, device = cache.block_size, self.slots.device
            columns = torch.arange(-(-self.max_seqlen_k // bs), device=device)
            first = self.slots * cache.blocks_per_row
            table = first[:, None] + columns[None, :]
            if window_left >= 0:
                below = (self.past - window_left).clamp(min=0) // bs
                last = first + (self.seqused_k.long() - 1).clamp(min=0) // bs
                table = torch.where(columns[None, :] < below[:, None], last[:, None], table)
            self._memo[key] = table.to(torch.int32)
        return self._memo[key]


@dataclasses.dataclass(frozen=True)
class QKVScales:
    """A layer's fp8 scales as vLLM keeps them (``_q_scale``, ``_k_scale``, ``_v_scale``: float32
    tensors on the device, one element each unless the checkpoint has per-head scales)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def paged_attention(
    kernel: CudaKernel,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: BlockedCache,
    batch: FlashBatch,
    out: torch.Tensor,
    *,
    softmax_scale: float,
    window_size: Tuple[int, int],
    kv_cache_dtype: str,
    scales: QKVScales,
) -> None:
    """The step's attention for one layer, as vLLM's FLASH_ATTN backend does it: write the new
    K/V into the rows, then one ``flash_attn_varlen_func`` call for every request.

    ``query``/``key``/``value``/``out`` are the step's ``[tokens, heads, head_dim]`` rows (query
    already fp8 for an fp8 cache: :meth:`CudaKernel.quantizes_query`).
    """
    assert kernel.varlen is not None and kernel.write_kv is not None
    if batch.num_tokens == 0:
        return
    fp8 = kv_cache_dtype != "auto"
    k_store, v_store = cache.k, cache.v
    if fp8:  # vLLM's fp8 cache is uint8: the op converts by kv_cache_dtype, dividing by k/v scale
        k_store, v_store = k_store.view(torch.uint8), v_store.view(torch.uint8)
    kernel.write_kv(
        key,
        value,
        k_store,
        v_store,
        batch.slot_mapping(cache),
        kv_cache_dtype,
        scales.k,
        scales.v,
    )
    descales: Dict[str, torch.Tensor] = {}
    if fp8:  # FA3: per sequence and KV head, as vLLM expands them
        shape = (batch.seqused_k.shape[0], cache.k.shape[2])
        descales = dict(
            q_descale=scales.q.expand(shape),
            k_descale=scales.k.expand(shape),
            v_descale=scales.v.expand(shape),
        )
    kernel.varlen(
        q=query,
        k=cache.k,
        v=cache.v,
        max_seqlen_q=batch.max_seqlen_q,
        cu_seqlens_q=batch.cu_seqlens_q,
        max_seqlen_k=batch.max_seqlen_k,
        seqused_k=batch.seqused_k,
        softmax_scale=softmax_scale,
        causal=True,
        window_size=list(window_size),
        block_table=batch.block_table(cache, window_size[0]),
        out=out,
        fa_version=kernel.fa_version,
        **descales,
    )
