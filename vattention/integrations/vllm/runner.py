"""The model-runner side of the plugin: one ``KVCache`` per worker, one slot per request.

:class:`VAttentionRunnerMixin` goes in front of vLLM's CPU or GPU model runner and changes three
things:

* ``initialize_kv_cache_tensors``: instead of allocating vLLM's flat KV buffer it builds a
  :class:`vattention.KVCache` from vLLM's KV config (:class:`.geometry.KVGeometry`), gives every
  attention layer its dense K/V tensors (``layer.vattention_kv``) and binds empty placeholders
  where vLLM expects its buffer;
* ``_update_states`` (the start of every step): frees the slots of finished, aborted and
  preempted requests, lets vLLM update its batch, gives a slot to each newly scheduled (or
  resumed) request, then calls ``KVCache.step()`` with every scheduled request's length after this
  step and ``prefetch()`` with its expected length after the next one;
* ``_zero_block_ids``: nothing to zero; kernels read a request only below its length.

vLLM's scheduler stays the admission authority: a page is one block of one tensor, and the pool's
budget is the blocks vLLM counted, so ``step()`` cannot run out of pages unless the two
accountings disagree, which is reported as a bug rather than hidden.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from typing import Dict, List, Optional

import torch

from ... import KVCache, KVCacheConfig, OutOfPagesError
from .geometry import KVGeometry
from .plugin import layout_from_env
from .settings import ENV_STATS
from .slots import RequestSlots
from .stats_writer import StatsWriter, stats_path

__all__ = ["VAttentionRunnerMixin", "BatchSlots", "current_batch"]

logger = logging.getLogger("vllm.vattention")

# One model runner per worker process (tensor-parallel ranks are processes of their own).
_runner: Optional[weakref.ReferenceType] = None


@dataclasses.dataclass
class BatchSlots:
    """Per row of this step's batch (vLLM's order): the request's slot and its cached tokens."""

    slots: List[int]
    past: List[int]


def current_batch() -> Optional[BatchSlots]:
    """The batch this process's runner placed for the step being built (None before any)."""
    runner = _runner() if _runner is not None else None
    return None if runner is None else runner._vattention_batch


class VAttentionRunnerMixin:
    """Mixed in front of ``GPUModelRunner`` / ``CPUModelRunner`` (see the module docstring)."""

    _vattention: Optional[KVCache] = None
    _vattention_batch: Optional[BatchSlots] = None
    _stats_writer: Optional[StatsWriter] = None

    # ---- set-up -------------------------------------------------------------------------------
    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes,
                                    kv_cache_allocation_context=None) -> Dict[str, torch.Tensor]:
        from vllm.v1.kv_cache_interface import AttentionSpec
        from vllm.v1.worker.utils import bind_kv_cache

        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
            raise NotImplementedError(
                "vattention's vLLM plugin serves models whose layers share one full-attention KV "
                f"cache spec; this model has {len(groups)} KV cache groups")
        spec, layer_names = groups[0].kv_cache_spec, list(groups[0].layer_names)
        geometry = KVGeometry(
            num_layers=len(layer_names), num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_size, element_bytes=spec.dtype.itemsize,
            block_size=spec.block_size, num_blocks=kv_cache_config.num_blocks,
            layout=layout_from_env())
        self.close_vattention()   # vLLM may size the KV cache more than once (profiling)
        config = KVCacheConfig(
            num_layers=geometry.num_layers, num_kv_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim, max_batch_size=self.max_num_reqs,
            max_seq_len=self.max_model_len, dtype=spec.dtype,
            device="cpu" if self.device.type == "cpu" else f"cuda:{self.device.index or 0}",
            page_size=geometry.page_bytes, layout=geometry.layout)
        self._vattention = KVCache(config, memory_budget=geometry.memory_budget)
        self._vattention_slots = RequestSlots(self._vattention)
        self._vattention_preemptions = 0
        self._vattention_peak_mapped = 0
        global _runner
        _runner = weakref.ref(self)

        forward_context = self.compilation_config.static_forward_context
        placeholders = {}
        for index, name in enumerate(layer_names):
            forward_context[name].vattention_kv = self._vattention.layer(index)
            placeholders[name] = torch.empty(0, dtype=spec.dtype, device=self.device)
        bind_kv_cache(placeholders, forward_context, self.kv_caches)
        logger.info(
            "vattention KV cache: %d slots x %d tokens, layout %s, page %d bytes (%d tokens, one "
            "vLLM block), budget %d bytes (%d blocks), %d layers", config.max_batch_size,
            config.max_seq_len, config.layout, config.page_bytes, geometry.block_size,
            geometry.memory_budget, geometry.num_blocks, geometry.num_layers)
        self._start_stats_writer()
        return placeholders

    def _start_stats_writer(self) -> None:
        base = os.environ.get(ENV_STATS)
        if not base:
            return
        parallel = self.vllm_config.parallel_config
        rank = getattr(parallel, "rank", 0)
        try:
            from vllm.distributed import get_world_group
            rank, world = get_world_group().rank, get_world_group().world_size
        except Exception:  # no distributed group in this process
            world = parallel.world_size
        self._stats_writer = StatsWriter(stats_path(base, rank, world), self.vattention_stats)

    # ---- per step -----------------------------------------------------------------------------
    def _update_states(self, scheduler_output):
        cache = self._vattention
        if cache is None:
            return super()._update_states(scheduler_output)
        preempted = scheduler_output.preempted_req_ids or set()
        self._vattention_preemptions += len(preempted)
        self._vattention_slots.release(scheduler_output.finished_req_ids | preempted)
        result = super()._update_states(scheduler_output)

        scheduled = scheduler_output.num_scheduled_tokens
        slots, past, lens, expected = [], [], {}, {}
        for req_id in self.input_batch.req_ids[:self.input_batch.num_reqs]:
            slot = self._vattention_slots.slot_for(req_id)
            state = self.requests[req_id]
            computed = state.num_computed_tokens
            length = computed + scheduled[req_id]
            slots.append(slot)
            past.append(computed)
            lens[slot] = length
            known = state.num_tokens     # prompt, plus the output a resumed request recomputes
            # next step: the next prefill chunk (up to the known tokens), else one more token
            nxt = min(known, length + scheduled[req_id]) if length < known else length + 1
            expected[slot] = min(self.max_model_len, nxt)
        try:
            cache.step(lens)
        except OutOfPagesError as e:
            raise RuntimeError(
                "vattention: the page pool ran dry although vLLM's block accounting admitted "
                f"this batch ({e}); the two accountings disagree: please report this") from e
        if self._stats_writer is not None:   # observability on: one stats() call per step
            self._vattention_peak_mapped = max(self._vattention_peak_mapped,
                                               cache.stats()["bytes_mapped"])
        cache.prefetch(expected)
        self._vattention_batch = BatchSlots(slots, past)
        return result

    def _zero_block_ids(self, block_ids) -> None:
        # vLLM zeroes reused blocks so that its kernels never mix stale data into a partial
        # block; vattention kernels read a request's row only below its length.
        return None

    # ---- observability and shutdown -----------------------------------------------------------
    def vattention_stats(self) -> Dict:
        """``KVCache.stats()`` plus ``max_active_slots`` and what vLLM itself allocated for KV."""
        stats = dict(self._vattention.stats())
        stats.update(max_active_slots=self._vattention_slots.peak,
                     requests_served=self._vattention_slots.served,
                     preemptions=self._vattention_preemptions,
                     peak_bytes_mapped_at_step=self._vattention_peak_mapped,
                     layout=self._vattention.config.layout,
                     vllm_kv_buffer_bytes=sum(t.numel() * t.element_size()
                                              for t in self.kv_caches))
        return stats

    def close_vattention(self) -> None:
        """Free every slot still held, write the final stats, close the cache. Idempotent.

        vLLM tells a worker about finished requests one step late, so after the last step the
        last batch's slots are still held: shutdown is where they are given back.
        """
        cache = self._vattention
        if cache is None:
            return
        held = self._vattention_slots.release_all()
        if self._stats_writer is not None:
            final = self.vattention_stats()
            final["slots_released_at_shutdown"] = held
            self._stats_writer.close(final)
            self._stats_writer = None
        self._vattention_batch = None
        self._vattention = None
        cache.close()
