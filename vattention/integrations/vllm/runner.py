"""The model-runner side of the plugin: one ``KVCache`` per worker, one slot per request, vLLM's
block tables as the cache's page tables.

:class:`VAttentionRunnerMixin` goes in front of vLLM's CPU or GPU model runner and changes three
things:

* ``initialize_kv_cache_tensors``: instead of allocating vLLM's KV buffer it builds a
  :class:`vattention.KVCache` whose pages vLLM's block ids name (:mod:`.kv_layout`: one page index
  per vLLM block, every KV cache group its own table, the blocks vLLM would have allocated as the
  most it may hold; no page yet), gives every attention layer its dense K/V tensors
  (``layer.vattention_kv``), hands the attention metadata builders the step's batch, and binds
  empty placeholders where vLLM expects its buffer;
* ``_update_states`` (the start of every step): frees the slots of finished, aborted and
  preempted requests, applies the scheduler's word on memory (the blocks whose pages go, the
  page budget and headroom: scheduler.py, elastic.py; a lowered budget only after the release
  delay, release_delay.py), gives each new (or resumed) request a
  slot (the idle one whose row still maps its prefix-cache hits, if any: no map call for them),
  turns the step's block ids into table updates (a new or resumed request's whole table, its
  prefix-cache hits first; a running request's appended blocks), calls ``KVCache.step()`` with
  every scheduled request's length and table update, and ``prefetch()`` with its expected length
  after the next step;
* ``_zero_block_ids``: nothing to zero; kernels read a request only below its length.

vLLM's scheduler stays the admission authority (which request runs, which block it gets, which
hit it may use); the cache is the memory authority. With prefix caching a hit maps the cached
block's pages again, zero copy. ``step()`` cannot run out of pages unless the two accountings
disagree, which is reported as a bug rather than hidden.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from ... import KVCache, OutOfPagesError
from .flash import selected_kernel
from .kv_layout import kv_cache_dtype, kv_layout
from .plugin import layout_from_env
from .release_delay import DelayedBudget, release_delay
from .settings import ENV_STATS, LAYOUT_KEY
from .slots import RequestSlots
from .stats_writer import StatsWriter, stats_path

__all__ = ["VAttentionRunnerMixin", "BatchSlots"]

logger = logging.getLogger("vllm.vattention")

NULL_BLOCK = 0  # vLLM's null block id (a hole in a table; the cache's -1)


@dataclasses.dataclass
class BatchSlots:
    """Per row of this step's batch (vLLM's order): the request's slot and its cached tokens."""

    slots: List[int]
    past: List[int]


def _ids(block_ids) -> List[List[int]]:
    """vLLM's per-group block ids as the cache's (the null block is -1)."""
    return [[-1 if b == NULL_BLOCK else b for b in group] for group in block_ids]


def _hits(ids: List[List[int]], cached: int) -> Optional[List[List[int]]]:
    """A new table's leading cache hits per group, for ``KVCache.alloc(hits=...)`` (None: none)."""
    return [group[:cached] for group in ids] if cached > 0 else None


class VAttentionRunnerMixin:
    """Mixed in front of ``GPUModelRunner`` / ``CPUModelRunner`` (see the module docstring)."""

    _vattention: Optional[KVCache] = None
    _vattention_batch: Optional[BatchSlots] = None
    _stats_writer: Optional[StatsWriter] = None
    _vattention_budget: Optional[DelayedBudget] = None
    if TYPE_CHECKING:
        # What the mixin uses of vLLM's model runner it goes in front of (vLLM ships no types).
        vllm_config: Any
        model_config: Any
        cache_config: Any
        compilation_config: Any
        device: torch.device
        max_num_reqs: int
        max_model_len: int
        kv_caches: List[torch.Tensor]
        input_batch: Any
        requests: Dict[str, Any]

    # ---- set-up -------------------------------------------------------------------------------
    def initialize_kv_cache_tensors(
        self, kv_cache_config, kernel_block_sizes, kv_cache_allocation_context=None
    ) -> Dict[str, torch.Tensor]:
        from vllm.v1.worker.utils import bind_kv_cache

        dtype = kv_cache_dtype(self.cache_config.cache_dtype, self.model_config.dtype)
        layout = self.vllm_config.additional_config.get(LAYOUT_KEY) or layout_from_env()
        kv = kv_layout(kv_cache_config, dtype, layout)
        self.close_vattention()  # vLLM sizes the KV cache twice with CUDA graphs (profiling)
        config = kv.cache_config(
            max_batch_size=self.max_num_reqs,
            # Rows of whole blocks: a row is padded to whole pages (blocks) anyway, and CUDA's
            # paged kernel reads the last slot's last block through a view of this tensor.
            max_seq_len=-(-self.max_model_len // kv.block_size) * kv.block_size,
            device="cpu" if self.device.type == "cpu" else f"cuda:{self.device.index or 0}",
            block_cache=bool(self.cache_config.enable_prefix_caching),
        )
        # No pages yet: the scheduler's elastic block pool (scheduler.py) says each step which
        # blocks keep pages and how many pages this worker may hold.
        delay = release_delay()
        cache = KVCache(config, memory_budget=kv.memory_budget(config))
        self._vattention = cache
        self._vattention_budget = DelayedBudget(cache.set_memory_budget, delay)
        self._vattention_slots = RequestSlots(self._vattention)
        self._vattention_block_size = kv.block_size
        self._vattention_block_bytes = kv.block_bytes()
        self._vattention_elastic: Dict[str, Any] = {}  # the last step's budget, headroom, figures
        self._vattention_preemptions = 0
        self._vattention_peak_mapped = 0
        self._vattention_peak_mappings = 0

        forward_context = self.compilation_config.static_forward_context
        placeholders = {}
        for index, name in enumerate(kv.layer_names):
            forward_context[name].vattention_kv = self._vattention.layer(index)
            placeholders[name] = torch.empty(0, dtype=dtype, device=self.device)
        bind_kv_cache(placeholders, forward_context, self.kv_caches)
        # The attention metadata builders read each step's slots from this runner (no global).
        for group in getattr(self, "attn_groups", ()):
            for attn_group in group:
                for builder in attn_group.metadata_builders:
                    if hasattr(builder, "batch_source"):
                        builder.batch_source = self.vattention_batch
        logger.info(
            "vattention KV cache: %d slots x %d tokens, layout %s, page %d bytes (%d tokens, one "
            "vLLM block), budget %d bytes (%d blocks, %s), %d layers in %d KV cache group(s), "
            "prefix caching %s",
            config.max_batch_size,
            config.max_seq_len,
            config.layout,
            config.page_bytes,
            kv.block_size,
            kv.memory_budget(config),
            kv.num_blocks,
            "created as vLLM's scheduler grants them",
            len(kv.layer_names),
            kv.num_groups,
            "on" if config.block_cache else "off",
        )
        self._start_stats_writer()
        return placeholders

    def vattention_batch(self) -> Optional[BatchSlots]:
        """The batch this runner placed for the step being built (None before any)."""
        return self._vattention_batch

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
    def _block_updates(self, scheduler_output, stream: Any) -> Dict[int, tuple]:
        """This step's table updates, {slot: (start, ids per group, cached)}."""
        slots, bs = self._vattention_slots, self._vattention_block_size
        if scheduler_output.kv_cache_block_copies:
            raise NotImplementedError(
                "vattention: vLLM asked for KV block copies (partial prefix-cache hits of hybrid "
                "state-space models), which the plugin does not serve"
            )
        updates = {}
        for new in scheduler_output.scheduled_new_reqs:
            ids = _ids(new.block_ids)
            hits = new.num_computed_tokens // bs
            slots.replace_table(new.req_id, len(ids[0]))
            updates[slots.slot_for(new.req_id, _hits(ids, hits), stream)] = (0, ids, hits)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids or ()
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is None:
                continue
            ids = _ids(new_ids)
            if req_id in resumed:  # its table is replaced, hits (recomputed prefix) first
                hits = cached.num_computed_tokens[i] // bs
                slot = slots.slot_for(req_id, _hits(ids, hits), stream)
                slots.replace_table(req_id, len(ids[0]))
                updates[slot] = (0, ids, hits)
                continue
            slot = slots.slot_for(req_id)
            if ids[0]:
                updates[slot] = (slots.table(req_id, len(ids[0])), ids, 0)
        return updates

    def _update_states(self, scheduler_output):
        cache = self._vattention
        # super(): vLLM's runner after this mixin in the MRO (mypy checks it against object)
        if cache is None:
            return super()._update_states(scheduler_output)  # type: ignore[misc]
        stream = self._engine_stream()
        preempted = scheduler_output.preempted_req_ids or set()
        self._vattention_preemptions += len(preempted)
        self._vattention_slots.release(scheduler_output.finished_req_ids | preempted, stream)
        elastic = getattr(scheduler_output, "vattention_elastic", None)
        if elastic is not None:
            self._apply_elastic(cache, elastic)
        updates = self._block_updates(scheduler_output, stream)
        result = super()._update_states(scheduler_output)  # type: ignore[misc]

        scheduled = scheduler_output.num_scheduled_tokens
        slots, past, lens, expected = [], [], {}, {}
        for req_id in self.input_batch.req_ids[: self.input_batch.num_reqs]:
            slot = self._vattention_slots.slot_for(req_id, stream=stream)
            state = self.requests[req_id]
            computed = state.num_computed_tokens
            length = computed + scheduled[req_id]
            slots.append(slot)
            past.append(computed)
            lens[slot] = length
            known = state.num_tokens  # prompt, plus the output a resumed request recomputes
            # next step: the next prefill chunk (up to the known tokens), else one more token
            nxt = min(known, length + scheduled[req_id]) if length < known else length + 1
            expected[slot] = min(self.max_model_len, nxt)
        try:
            cache.step(lens, blocks=updates or None, stream=stream)
        except OutOfPagesError as e:
            raise RuntimeError(
                "vattention: the page pool ran dry although vLLM's block accounting admitted "
                f"this batch ({e}); the two accountings disagree: please report this"
            ) from e
        if self._stats_writer is not None:  # observability on: one stats() call per step
            stats = cache.stats()
            self._vattention_peak_mapped = max(self._vattention_peak_mapped, stats["bytes_mapped"])
            self._vattention_peak_mappings = max(self._vattention_peak_mappings, stats["mappings"])
        cache.prefetch(expected)
        self._vattention_batch = BatchSlots(slots, past)
        return result

    def _apply_elastic(self, cache: KVCache, elastic: Any) -> None:
        """The scheduler's word on this step's memory (elastic.py), before the step maps
        anything: the released blocks' pages go, then the budget and headroom follow."""
        if elastic.release and cache.config.block_cache:
            cache.release_blocks(elastic.release)  # waits for the rows' free() fences only
        last = self._vattention_elastic
        budget = elastic.budget_blocks * self._vattention_block_bytes
        headroom = elastic.headroom_blocks * self._vattention_block_bytes
        assert self._vattention_budget is not None  # made with the cache
        self._vattention_budget.set(budget)  # a lowered budget applies after the release delay
        if headroom != last.get("headroom_target_bytes"):
            cache.set_headroom(headroom)
        self._vattention_elastic = {
            "budget_bytes": budget,
            "headroom_target_bytes": headroom,
            **elastic.figures,
        }

    def _zero_block_ids(self, block_ids) -> None:
        # vLLM zeroes reused blocks so that its kernels never mix stale data into a partial
        # block; vattention kernels read a request's row only below its length.
        return None

    # ---- observability and shutdown -----------------------------------------------------------
    def vattention_stats(self) -> Dict:
        """``KVCache.stats()`` plus ``max_active_slots`` and what vLLM itself allocated for KV."""
        cache = self._vattention
        assert cache is not None  # the stats writer runs only while the cache is open
        stats: Dict[str, Any] = dict(cache.stats())
        stats.update(
            max_active_slots=self._vattention_slots.peak,
            requests_served=self._vattention_slots.served,
            preemptions=self._vattention_preemptions,
            peak_bytes_mapped_at_step=self._vattention_peak_mapped,
            peak_mappings_at_step=self._vattention_peak_mappings,
            layout=cache.config.layout,
            block_size=self._vattention_block_size,
            attention_kernel=self._attention_kernel(),
            vllm_kv_buffer_bytes=sum(t.numel() * t.element_size() for t in self.kv_caches),
            elastic=dict(self._vattention_elastic),
        )
        budget = self._vattention_budget
        if budget is not None:  # what the cache holds to: the budget of the last delay_s
            stats["elastic"].update(
                applied_budget_bytes=budget.applied, release_delay_s=budget.delay_s
            )
        return stats

    def _engine_stream(self) -> Any:
        """Where vLLM queues this worker's model, for the cache's fences and zeroing: on CUDA
        vLLM's own stream (its worker makes a non-blocking stream current, which the legacy
        default stream does not wait for: ``vllm.utils.torch_utils.current_stream``, which makes
        it on first use as vLLM's runner would); None on the CPU (nothing is asynchronous)."""
        if self.device.type == "cpu":
            return None
        from vllm.utils.torch_utils import current_stream

        return current_stream()

    def _attention_kernel(self) -> str:
        """The kernel attention runs: the CPU one, or the CUDA choice of this process."""
        if self.device.type == "cpu":
            return "vattention cpu_attention"
        kernel = selected_kernel()
        return kernel.label if kernel is not None else "not chosen yet"

    def close_vattention(self) -> None:
        """Free every slot still held, write the final stats, close the cache. Idempotent.

        vLLM tells a worker about finished requests one step late, so after the last step the
        last batch's slots are still held: shutdown is where they are given back.
        """
        cache = self._vattention
        if cache is None:
            return
        if self._vattention_budget is not None:
            self._vattention_budget.close()  # no budget applied from now on
        held = self._vattention_slots.release_all(self._engine_stream())
        if self._stats_writer is not None:
            final = self.vattention_stats()
            final["slots_released_at_shutdown"] = held
            self._stats_writer.close(final)
            self._stats_writer = None
        self._vattention_budget = None
        self._vattention_batch = None
        self._vattention = None
        cache.close()
