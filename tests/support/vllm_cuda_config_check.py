"""vLLM's own CUDA-platform config code, run on this CPU machine against the plugin's config.

Run in the vLLM venv (``python vllm_cuda_config_check.py MODEL``); prints one JSON document.
vLLM's CPU build carries the CUDA platform's Python (``vllm/platforms/cuda.py``); only its
extension module is CUDA-only, and it is not needed to import the platform class, so it is stubbed.
What runs is vLLM's code, not a copy of it:

* ``VllmConfig.use_v2_model_runner``: what vLLM picks where Triton runs (its CUDA default), before
  and after the plugin's ``select_v1_runner``;
* ``CudaPlatform.check_and_update_config`` (the worker class), then the plugin's ``configure``
  (the vattention worker, FlashAttention, PIECEWISE CUDA graphs, the aligned block size);
* ``CudaPlatform.update_block_size_for_backend``, which every CUDA worker runs after loading the
  model: it must leave the aligned block size alone.

A real GPU's VMM granularity is 2 MB: the block size is aligned for that (this machine's cuda
backend, when built, only talks to the test emulation).
"""

from __future__ import annotations

import json
import os
import sys
import types

os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")

import vllm.config.vllm as vllm_config_module  # noqa: E402
import vllm.platforms.cuda as cuda_platform  # noqa: E402
from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.config.vllm import set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase  # noqa: E402

import vattention  # noqa: E402
from vattention.integrations.vllm import plugin  # noqa: E402
from vattention.integrations.vllm.attention import VAttentionFlashBackend  # noqa: E402

GPU_GRANULARITY = 2 << 20


class _Layer(AttentionLayerBase):
    """Stands in for a loaded attention layer: vLLM asks it for its backend."""

    def get_attn_backend(self):
        return VAttentionFlashBackend

    def get_kv_cache_spec(self, vllm_config):
        return None


def main(model: str) -> None:
    Cuda = cuda_platform.CudaPlatform
    out = {}
    config = EngineArgs(model=model, max_model_len=512, max_num_seqs=4).create_engine_config()
    # where Triton runs (any CUDA machine), vLLM picks its V2 runner unless told otherwise
    vllm_config_module.HAS_TRITON = True
    out["v2_by_default"] = bool(config.use_v2_model_runner)
    plugin.select_v1_runner()
    out["v2_with_plugin"] = bool(config.use_v2_model_runner)

    config.parallel_config.worker_cls = "auto"
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE  # CUDA's default
    Cuda.check_and_update_config(config)
    out["stock_worker"] = config.parallel_config.worker_cls
    vattention._C.backend_granularity = lambda device: GPU_GRANULARITY
    requested = config.cache_config.block_size
    plugin.configure(config, device_type="cuda")
    out.update(
        worker=config.parallel_config.worker_cls,
        attention_backend=str(config.attention_config.backend),
        cudagraph_mode=config.compilation_config.cudagraph_mode.name,
        requested_block_size=requested,
        block_size=config.cache_config.block_size,
        layout=config.additional_config.get("vattention_layout"),
    )
    for i in range(config.model_config.get_num_layers(config.parallel_config)):
        config.compilation_config.static_forward_context[f"model.layers.{i}.self_attn.attn"] = (
            _Layer()
        )
    with set_current_vllm_config(config):
        Cuda.update_block_size_for_backend(config)
    out["block_size_in_worker"] = config.cache_config.block_size
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
