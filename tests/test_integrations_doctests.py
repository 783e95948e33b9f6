"""The docstring examples of the integration, benchmark, attention and core API modules run and
print what they claim."""

from __future__ import annotations

import doctest
import importlib

import pytest


@pytest.mark.parametrize(
    "module",
    [
        "vattention.integrations.original_api",
        "vattention.integrations.flash_attn",
        "vattention.integrations.transformers",
        "vattention.integrations.vllm.kv_layout",
        "vattention.integrations.vllm.prefix_hint",
        "vattention.integrations.vllm.plugin",
        "vattention.integrations.vllm.stats_writer",
        "vattention.integrations.vllm.slots",
        "vattention.bench.tiny_models",
        "vattention.bench.model_presets",
        "vattention.bench.vllm_bench",
        "vattention.bench.elastic_bench",
        "vattention.bench.workload",
        "vattention.bench.traces",
        "vattention.bench.progress",
        "vattention.bench.sizing",
        "vattention.bench.allocators",
        "vattention.bench.pools",
        "vattention.config",
        "vattention.cache",
        "vattention.cache_reads",
        "vattention.errors",
        "vattention.sharing",
        "vattention.swap",
        "vattention.backends",
        "vattention.streams",
        "vattention.pool_ledger",
        "vattention.attention",
        "vattention.attention.kernel",
        "vattention.attention.reference",
        "vattention.attention.fp8",
        "vattention.attention.arguments",
        "vattention.attention.variants",
    ],
)
def test_docstring_examples(module):
    if module.endswith("transformers"):
        pytest.importorskip("transformers")
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
