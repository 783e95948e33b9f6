"""The plugin's environment variables and the vLLM versions it is tested with."""

ENV_ENABLE = "VATTENTION_VLLM"                          # "1": the plugin is on
ENV_STATS = "VATTENTION_VLLM_STATS"                     # path of each worker's stats JSON
ENV_LAYOUT = "VATTENTION_VLLM_LAYOUT"                   # "mega" (default) or "layer"
ENV_ALLOW_UNTESTED = "VATTENTION_VLLM_ALLOW_UNTESTED"   # "1": run on an untested vLLM

TESTED_VLLM_VERSIONS = ("0.32.0",)
