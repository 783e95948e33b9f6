"""vLLM's scheduler with the plugin's elastic block pool, named by vLLM's ``scheduler_cls``.

The plugin sets ``scheduler_cls`` to :class:`VAttentionAsyncScheduler` where vLLM chose async
scheduling (its default) and to :class:`VAttentionScheduler` otherwise: vLLM's own classes, with
three additions:

* at construction, the scheduler's own ``BlockPool`` becomes an
  :class:`~.elastic.ElasticBlockPool` drawing on a ledger: the pool named by
  ``VATTENTION_VLLM_POOL`` (shared with other engines, :mod:`vattention.pool_ledger`), else one of
  its own whose budget is vLLM's KV memory;
* ``schedule()`` lets the pool grant while vLLM checks for free blocks, then attaches what the
  workers do with their memory this step (``scheduler_output.vattention_elastic``);
* ``update_from_output()`` tells the pool the step ran (the ledger may drop released pages).

vLLM stays the admission authority (which request runs, which block it gets); the ledger and the
workers' caches are the memory authority.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from ...config import parse_size
from ...pool_ledger import Ledger, ledger_from_env
from .elastic import ElasticBlockPool, ElasticPolicy, ElasticStep
from .kv_layout import kv_cache_dtype, kv_layout
from .plugin import layout_from_env
from .settings import (
    ENV_POOL,
    ENV_PREFIX_CACHE_BYTES,
    LAYOUT_KEY,
)

__all__ = [
    "VAttentionScheduler",
    "VAttentionAsyncScheduler",
    "elastic_policy",
    "ledger_for",
    "policy_for",
    "pool_device",
]

logger = logging.getLogger("vllm.vattention")

DEFAULT_CACHE_TOKENS = 16384  # kvcached's default is 16,000 tokens
DEFAULT_CACHE_FRACTION = 8  # ... but at most an eighth of the engine's own KV budget
HEADROOM_TOKENS = 1024  # pages created ahead: about one prefill chunk's blocks ...
HEADROOM_FRACTION = 32  # ... at most a 32nd of the budget


def engine_block_bytes(vllm_config: Any, kv_cache_config: Any) -> int:
    """One vLLM block's pages over every worker of the engine (the workers' caches are alike:
    tensor parallelism splits the heads)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    dtype = kv_cache_dtype(cache.cache_dtype, model.dtype)
    layout = vllm_config.additional_config.get(LAYOUT_KEY) or layout_from_env()
    per_worker = kv_layout(kv_cache_config, dtype, layout).block_bytes()
    return per_worker * vllm_config.parallel_config.world_size


def elastic_policy(
    block_bytes: int,
    num_blocks: int,
    block_size: int,
    step_blocks: int,
    cache_bytes: Optional[int] = None,
) -> ElasticPolicy:
    """The policy of an engine of ``num_blocks`` blocks (the null block left out) of
    ``block_size`` tokens and ``block_bytes`` bytes: the prefix-cache cap (``cache_bytes``, by
    default :data:`DEFAULT_CACHE_TOKENS` tokens but at most 1/:data:`DEFAULT_CACHE_FRACTION` of
    the blocks), the headroom (:data:`HEADROOM_TOKENS`, at most 1/:data:`HEADROOM_FRACTION`, at
    least one block) and the most blocks one ``schedule()`` may hand out.

    >>> elastic_policy(block_bytes=1000, num_blocks=800, block_size=16, step_blocks=64)
    ElasticPolicy(block_bytes=1000, cache_cap_blocks=100, headroom_blocks=25, step_blocks=64)
    """
    bb = block_bytes
    if cache_bytes is None:
        cache_bytes = min(
            DEFAULT_CACHE_TOKENS * bb // block_size, num_blocks * bb // DEFAULT_CACHE_FRACTION
        )
    headroom = max(1, min(-(-HEADROOM_TOKENS // block_size), num_blocks // HEADROOM_FRACTION))
    return ElasticPolicy(
        block_bytes=bb,
        cache_cap_blocks=cache_bytes // bb,
        headroom_blocks=headroom,
        step_blocks=min(num_blocks, step_blocks),
    )


def policy_for(vllm_config: Any, kv_cache_config: Any, block_size: int) -> ElasticPolicy:
    """The cap, headroom and per-step grant of this engine, from its config and the env."""
    bb = engine_block_bytes(vllm_config, kv_cache_config)
    num_blocks = int(kv_cache_config.num_blocks) - 1  # vLLM's null block holds no pages
    raw = os.environ.get(ENV_PREFIX_CACHE_BYTES)
    cap_bytes = None if raw is None else parse_size(raw, name=ENV_PREFIX_CACHE_BYTES)
    sched = vllm_config.scheduler_config
    # What one schedule() may hand out: every scheduled token in new blocks, plus one partial
    # block per request; and a whole request where vLLM checks the full sequence.
    step = max(
        -(-sched.max_num_batched_tokens // block_size) + sched.max_num_seqs,
        -(-vllm_config.model_config.max_model_len // block_size),
    )
    return elastic_policy(bb, num_blocks, block_size, step, cap_bytes)


def ledger_for(vllm_config: Any, policy: ElasticPolicy, num_blocks: int) -> Ledger:
    """The pool named by ``VATTENTION_VLLM_POOL`` (joined), else this engine's own budget."""
    model = vllm_config.model_config.served_model_name or vllm_config.model_config.model
    if isinstance(model, (list, tuple)):
        model = model[0]
    return ledger_from_env(
        device=pool_device(vllm_config.device_config.device_type),
        model=str(model),
        max_bytes=num_blocks * policy.block_bytes,
    )


def pool_device(device_type: str) -> str:
    """The device engines of one pool must share: ``cpu``, or ``cuda:N`` with N the first of
    ``CUDA_VISIBLE_DEVICES`` (the physical GPU an engine's device 0 is), else 0."""
    if device_type != "cuda":
        return str(device_type)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return f"cuda:{visible or 0}"


class _ElasticScheduling:
    """What both scheduler classes add to vLLM's (see the module docstring); in front of vLLM's
    ``Scheduler`` or ``AsyncScheduler`` in the MRO, so ``super()`` is vLLM's."""

    kv_cache_manager: Any
    vllm_config: Any
    kv_cache_config: Any
    block_size: int
    _elastic: Optional[ElasticBlockPool] = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._install_elastic_pool()

    def _install_elastic_pool(self) -> None:
        policy = policy_for(self.vllm_config, self.kv_cache_config, self.block_size)
        num_blocks = int(self.kv_cache_config.num_blocks) - 1
        ledger = ledger_for(self.vllm_config, policy, num_blocks)
        try:
            self._elastic = ElasticBlockPool.install(
                self.kv_cache_manager.block_pool, ledger, policy
            )
        except BaseException:
            ledger.close()
            raise
        pool = os.environ.get(ENV_POOL)
        logger.info(
            "vattention: elastic KV memory from %s; a block's pages %d bytes; prefix cache kept "
            "up to %d blocks (%d bytes, %s), %d blocks created ahead",
            f"pool {pool!r} of {ledger.budget_bytes} bytes"
            if pool
            else f"this engine's own {ledger.budget_bytes} bytes",
            policy.block_bytes,
            policy.cache_cap_blocks,
            policy.cache_cap_blocks * policy.block_bytes,
            ENV_PREFIX_CACHE_BYTES if os.environ.get(ENV_PREFIX_CACHE_BYTES) else "the default",
            policy.headroom_blocks,
        )

    def schedule(self, *args, **kwargs):
        pool = self._elastic
        if pool is None:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        pool.begin_schedule()
        try:
            output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            pool.abandon_schedule()
            raise
        output.vattention_elastic = pool.settle()
        return output

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )
        if self._elastic is not None:
            step: Optional[ElasticStep] = getattr(scheduler_output, "vattention_elastic", None)
            self._elastic.step_done(step)
        return outputs

    def shutdown(self) -> None:
        try:
            super().shutdown()  # type: ignore[misc]
        finally:
            if self._elastic is not None:
                self._elastic.close()


class VAttentionScheduler(_ElasticScheduling, Scheduler):
    """vLLM's ``Scheduler`` with the elastic block pool."""


class VAttentionAsyncScheduler(_ElasticScheduling, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (its default) with the elastic block pool."""
