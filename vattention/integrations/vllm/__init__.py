"""vLLM v1 plugin: vLLM's KV cache lives in a vattention :class:`~vattention.KVCache`.

Installed with the package (entry point ``vllm.general_plugins``), it does nothing unless the
environment says ``VATTENTION_VLLM=1`` when vLLM starts; installing vattention never changes
vLLM's behaviour by surprise. Enabled, it makes unmodified ``vllm serve`` and ``vllm.LLM(...)``

* skip vLLM's flat KV buffer and hold every layer's K and V in one ``KVCache`` sized from vLLM's
  config (``max_num_seqs`` slots of ``max_model_len`` tokens, the KV memory vLLM would have
  allocated as the physical memory budget), with pages mapped as tokens arrive;
* give each request a slot when it is first scheduled and take it back when it finishes, is
  aborted or is preempted; call ``step()`` before every forward and ``prefetch()`` with the next
  iteration's lengths;
* run attention over the dense per-layer tensors (torch SDPA on the CPU; FlashAttention's
  ``flash_attn_with_kvcache`` with ``cache_batch_idx`` on CUDA).

vLLM's scheduler and KV cache manager stay the admission and preemption authority: a page holds
exactly one vLLM block of one tensor, so the pages a request holds are the blocks vLLM charged it
(see :mod:`vattention.integrations.vllm.geometry`). See ``docs/vllm.md``.

Environment
-----------
``VATTENTION_VLLM=1``
    Enable the plugin (read in every vLLM process).
``VATTENTION_VLLM_STATS=<path>``
    Each worker writes ``KVCache.stats()`` plus ``max_active_slots`` as JSON to ``<path>``
    (``<path>.rank<N>`` when the world size is > 1) every few seconds and at shutdown.
``VATTENTION_VLLM_LAYOUT=mega|layer``
    Cache layout (default ``mega``: two mappings per block instead of two per layer).
``VATTENTION_VLLM_ALLOW_UNTESTED=1``
    Run on a vLLM version other than the tested ones (at your own risk).
"""

from __future__ import annotations

import os

from .settings import ENV_ALLOW_UNTESTED, ENV_ENABLE, ENV_LAYOUT, ENV_STATS, TESTED_VLLM_VERSIONS

__all__ = ["register", "TESTED_VLLM_VERSIONS", "ENV_ENABLE", "ENV_STATS", "ENV_LAYOUT",
           "ENV_ALLOW_UNTESTED"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it once in every process it starts.

    A no-op unless ``VATTENTION_VLLM=1``. Raises :class:`vattention.ConfigError` on an untested
    vLLM version (so the engine fails at start-up, not mid-request).
    """
    if os.environ.get(ENV_ENABLE, "") != "1":
        return
    from .plugin import activate
    activate()
