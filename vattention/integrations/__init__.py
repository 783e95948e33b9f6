"""Optional integrations with the frameworks that hold KV caches.

Nothing heavy is imported here: each submodule imports its framework when it is imported itself,
so ``import vattention`` works without transformers or flash-attn installed.

==========================================  ===============================  ==================
module                                      what it gives                    optional extra
==========================================  ===============================  ==================
``vattention.integrations.transformers``    ``VAttentionCache`` for          ``hf``
                                            ``model.generate()``
``vattention.integrations.flash_attn``      ``flash_attn_with_kvcache``      ``flash`` (GPU);
                                            (native CPU kernel), decode/     CPU: none
                                            prefill helpers
``vattention.integrations.original_api``    the original vAttention          none
                                            library's function API
                                            (``init_kvcache``, ``step``...)
==========================================  ===============================  ==================

Examples
--------
>>> from vattention.integrations import transformers as vhf   # doctest: +SKIP
>>> cache = vhf.VAttentionCache.from_model(model, max_batch_size=4,
...                                         max_seq_len=2048)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["transformers", "flash_attn", "original_api"]


def __getattr__(name: str) -> ModuleType:
    """Import ``vattention.integrations.<name>`` on first attribute access (PEP 562)."""
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
