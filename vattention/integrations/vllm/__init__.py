"""vLLM v1 plugin: vLLM's KV cache lives in a vattention :class:`~vattention.KVCache`.

Installed with the package (entry point ``vllm.general_plugins``), it does nothing unless the
environment says ``VATTENTION_VLLM=1`` when vLLM starts; installing vattention never changes
vLLM's behaviour by surprise. Enabled, it makes unmodified ``vllm serve`` and ``vllm.LLM(...)``,
at vLLM's defaults (prefix caching on, its KV cache groups, ``--kv-cache-dtype``):

* skip vLLM's KV buffer and hold every layer's K and V in one ``KVCache`` sized from vLLM's config
  (``max_num_seqs`` slots of ``max_model_len`` tokens, the KV memory vLLM would have allocated as
  the most it may hold), whose pages vLLM's block ids name: a request's row maps its block
  table in order, a prefix-cache hit maps the cached block's pages again (zero copy), a sliding
  window's released blocks leave the row;
* run vLLM's scheduler with an elastic block pool (``scheduler_cls``): a block has pages only
  while it is in use or kept in a bounded prefix cache, and admission follows what memory (the
  engine's own, or a pool shared with other engines) can back;
* give each request a slot when it is first scheduled and take it back when it finishes, is
  aborted or is preempted; call ``step()`` with the step's lengths and block tables before every
  forward, ``prefetch()`` with the next step's lengths;
* run attention over the dense per-layer tensors in one call per layer for the whole batch
  (vattention's native kernel on the CPU; FlashAttention on CUDA).

vLLM's scheduler and KV cache manager stay the admission and preemption authority. See
``docs/vllm.md``.

Environment
-----------
``VATTENTION_VLLM=1``
    Enable the plugin (read in every vLLM process).
``VATTENTION_VLLM_STATS=<path>``
    Each worker writes ``KVCache.stats()`` plus ``max_active_slots`` as JSON to ``<path>``
    (``<path>.rank<N>`` when the world size is > 1) every few seconds and at shutdown.
``VATTENTION_VLLM_LAYOUT=auto|mega|layer``
    Cache layout (default ``auto``: ``layer`` for hybrid models; for models whose layers share
    one KV spec, ``mega`` on CUDA (two mappings per block instead of two per layer) and on the
    CPU ``layer`` where its mappings fit within half of the host backend's limit, else ``mega``).
``VATTENTION_VLLM_PREFIX_CACHE_BYTES=<size>``
    The most memory that free, cached blocks (vLLM's prefix cache) keep (default: 16,384 tokens'
    worth, at most an eighth of the engine's KV memory). Beyond it the least recently used lose
    their pages and leave vLLM's prefix-cache index in the same step.
``VATTENTION_VLLM_POOL=<name>``, ``VATTENTION_VLLM_POOL_BYTES=<size>``
    Engines (processes) naming the same pool draw on one KV budget on their device; the first
    engine's ``VATTENTION_VLLM_POOL_BYTES`` sets it. ``python -m vattention pool`` lists pools.
``VATTENTION_VLLM_ALLOW_UNTESTED=1``
    Run on a vLLM version other than the supported ones (at your own risk).
"""

from __future__ import annotations

import os

from .settings import ENV_ALLOW_UNTESTED, ENV_ENABLE, ENV_LAYOUT, ENV_STATS, TESTED_VLLM_VERSIONS

__all__ = [
    "register",
    "TESTED_VLLM_VERSIONS",
    "ENV_ENABLE",
    "ENV_STATS",
    "ENV_LAYOUT",
    "ENV_ALLOW_UNTESTED",
]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it once in every process it starts.

    A no-op unless ``VATTENTION_VLLM=1``. Raises :class:`vattention.ConfigError` on an untested
    vLLM version (so the engine fails at start-up, not mid-request).
    """
    if os.environ.get(ENV_ENABLE, "") != "1":
        return
    from .plugin import activate

    activate()
