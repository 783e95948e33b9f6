# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

import torch

import vllm.envs as envs
from tests.v1.kv_connector.unit.utils import MockKVConfig
from vllm.config import (
    CacheConfig,
    DiffusionConfig,
    ECTransferConfig,
    KVTransferConfig,
    ModelConfig,
    MultiModalConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.config.model import RunnerOption
from vllm.config.scheduler import SchedulerPolicy
from vllm.multimodal.inputs import (
    MultiModalFeatureSpec,
    MultiModalKwargsItem,
    PlaceholderRange,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
)
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

EOS_TOKEN_ID = 50256


def mock_kv(matched_tokens: int, is_async: bool, num_defers_before_matching: int = 0):
    return MockKVConfig(
        matched_tokens=matched_tokens,
        is_async=is_async,
        num_defers_before_matching=num_defers_before_matching,
    )


def create_scheduler(
    model: str = "facebook/opt-125m",
    max_num_seqs: int = 16,
    max_num_active_seqs: int | None = None,
    max_num_batched_tokens: int = 8192,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = False,
    long_prefill_token_threshold: int = 0,
    long_prefill_token_threshold_adaptive: bool = False,
    disable_chunked_mm_input: bool = False,
    mm_encoder_only: bool = False,
    use_kv_connector: None | bool | str | MockKVConfig = None,
    kv_role: str = "kv_both",
    num_blocks: int = 10000,
    block_size: int = 16,
    max_model_len: int | None = None,
    num_speculative_tokens: int | None = None,
    speculative_method: str | None = None,
    parallel_drafting: bool = False,
    skip_tokenizer_init: bool = False,
    async_scheduling: bool = False,
    pipeline_parallel_size: int = 1,
    data_parallel_size: int = 1,
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = None,
    use_ec_connector: bool = False,
    ec_role: str | None = None,
    use_v2_model_runner: bool | None = None,
    kv_cache_spec: KVCacheSpec | None = None,
    runner: RunnerOption = "auto",
    per_request_spec_decode_metrics: str = "none",
    scheduling_policy: SchedulerPolicy = "fcfs",
    diffusion_canvas_length: int | None = None,
    scheduler_cls: type[Scheduler] | None = None,
) -> Scheduler | AsyncScheduler:
    """Create scheduler under test.

    Args:
      model: model under test
      max_num_seqs: max sequences to schedule
      max_num_batch_tokens: max num tokens to batch
      enable_prefix_caching: optionally force APC config
                             (True/False) or use default
                             (False)
      long_prefill_token_threshold: cap on prefill chunk size
      long_prefill_token_threshold_adaptive: floor the cap at a
                             fair share of the token budget

    Returns:
      {class}`Scheduler` instance

    """
    model_config = ModelConfig(
        model=model,
        trust_remote_code=True,
        dtype="float16",
        seed=42,
        skip_tokenizer_init=skip_tokenizer_init,
        # The scheduler reads model_config.max_model_len, not the
        # SchedulerConfig one, so both must agree.
        max_model_len=max_model_len,
        runner=runner,
    )
    if mm_encoder_only:
        model_config.multimodal_config.mm_encoder_only = True
    if use_ec_connector and ec_role == "ec_producer":
        model_config.multimodal_config = MultiModalConfig()
    if max_model_len is None:
        max_model_len = max_num_batched_tokens
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_active_seqs=max_num_active_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=(long_prefill_token_threshold_adaptive),
        disable_chunked_mm_input=disable_chunked_mm_input,
        enable_chunked_prefill=enable_chunked_prefill,
        async_scheduling=async_scheduling,
        is_encoder_decoder=model_config.is_encoder_decoder,
        # Ensure admission/preemption mechanics are deterministic
        watermark=0.0,
        policy=scheduling_policy,
    )
    # Cache config, optionally force APC
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
    )
    kv_transfer_config = None
    if isinstance(use_kv_connector, MockKVConfig):
        kv_transfer_config = KVTransferConfig(
            kv_connector="MockKVConnector",
            kv_role=kv_role,
            kv_connector_extra_config={
                "matched_tokens": use_kv_connector.matched_tokens,
                "is_async": use_kv_connector.is_async,
                "num_defers_before_matching": (
                    use_kv_connector.num_defers_before_matching
                ),
            },
        )
    elif isinstance(use_kv_connector, str):
        kv_transfer_config = KVTransferConfig(
            kv_connector=use_kv_connector,
            kv_role=kv_role,
        )
    elif use_kv_connector:
        kv_transfer_config = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role=kv_role,
            kv_connector_extra_config={"shared_storage_path": "local_storage"},
        )

    speculative_config: SpeculativeConfig | None = None
    if num_speculative_tokens is not None:
        spec_kwargs: dict = dict(
            model="ngram", num_speculative_tokens=num_speculative_tokens
        )
        if num_speculative_tokens_per_batch_size is not None:
            spec_kwargs["num_speculative_tokens_per_batch_size"] = (
                num_speculative_tokens_per_batch_size
            )
        if speculative_method is not None:
            spec_kwargs["method"] = speculative_method
            spec_kwargs["prompt_lookup_max"] = num_speculative_tokens
            spec_kwargs["prompt_lookup_min"] = 1
        speculative_config = SpeculativeConfig(**spec_kwargs)
        speculative_config.parallel_drafting = parallel_drafting

    ec_transfer_config = (
        ECTransferConfig(
            ec_connector="ECExampleConnector",
            ec_role=ec_role,
            ec_connector_extra_config={"shared_storage_path": "/tmp/ec_test"},
        )
        if use_ec_connector
        else None
    )

    diffusion_config: DiffusionConfig | None = None
    if diffusion_canvas_length is not None:
        # A diffusion checkpoint declares its canvas in the HF config.
        model_config.hf_config.canvas_length = diffusion_canvas_length
        diffusion_config = DiffusionConfig(canvas_length=diffusion_canvas_length)

    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        parallel_config=ParallelConfig(
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
        ),
        kv_transfer_config=kv_transfer_config,
        speculative_config=speculative_config,
        diffusion_config=diffusion_config,
        ec_transfer_config=ec_transfer_config,
        observability_config=ObservabilityConfig(
            per_request_spec_decode_metrics=per_request_spec_decode_metrics,
        ),
    )
    if kv_cache_spec is None:
        kv_cache_spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=1,
            dtype=torch.float32,
        )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,  # A large number of blocks to hold all requests
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], kv_cache_spec)],
    )
    cache_config.num_gpu_blocks = num_blocks
    register_all_kvcache_specs(vllm_config)
    if scheduler_cls is None:
        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=block_size,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )
    if use_v2_model_runner is None:
        use_v2_model_runner = envs.VLLM_USE_V2_MODEL_RUNNER is not False
    scheduler.use_v2_model_runner = use_v2_model_runner
    return scheduler


_none_hash_initialized = False


def create_requests(
    num_requests: int,
    num_tokens: int = 10,
    mm_hashes_list: list[list[str]] | None = None,
    mm_positions: list[list[PlaceholderRange]] | None = None,
    ignore_eos: bool = False,
    max_tokens: int = 16,
    stop_token_ids: list[int] | None = None,
    prompt_logprobs: int | None = None,
    same_prompt: bool = False,
    block_size: int = 16,
    req_ids: list[str] | None = None,
) -> list[Request]:
    global _none_hash_initialized
    if not _none_hash_initialized:
        init_none_hash(sha256)
        _none_hash_initialized = True

    block_hasher = get_request_block_hasher(block_size, sha256)
    sampling_params = SamplingParams(
        ignore_eos=ignore_eos,
        max_tokens=max_tokens,
        stop_token_ids=stop_token_ids,
        prompt_logprobs=prompt_logprobs,
    )
    sampling_params.update_from_generation_config({}, EOS_TOKEN_ID)
    requests = []

    if mm_hashes_list is not None:
        # NOTE: allow manual input; some mm items can have the same identifier
        # no. of mm_hashes and mm_positions for each request should be identical
        assert mm_positions is not None, (
            "mm_positions must be provided when mm_hashes_list is provided"
        )
        assert len(mm_hashes_list) == len(mm_positions) == num_requests
        assert [len(h) for h in mm_hashes_list] == [len(p) for p in mm_positions]

        # Since same identifier would imply they are identical encoder output
        # Verify mm items with identical identifier are having mm_position.length
        seen_hashes: dict[str, int] = {}

    if req_ids:
        assert len(req_ids) == num_requests
    else:
        req_ids = [f"{i}" for i in range(num_requests)]

    for i in range(num_requests):
        mm_features = []

        for j, position in enumerate(
            mm_positions[i] if mm_positions is not None else []
        ):
            if mm_hashes_list is not None:
                identifier = mm_hashes_list[i][j]

                # Verify if position length is identical
                position_length = position.length
                if identifier in seen_hashes:
                    assert seen_hashes[identifier] == position_length, (
                        f"mm_hash '{identifier}' has inconsistent position lengths: "
                        f"previously {seen_hashes[identifier]}, now {position_length} "
                        f"at request {i}, position {j}"
                    )
                else:
                    seen_hashes[identifier] = position_length
            else:
                # Unique dummy hash for each mm item
                identifier = f"hash{i}_{j}"
            mm_feature = MultiModalFeatureSpec(
                data=MultiModalKwargsItem.dummy(),
                mm_position=position,
                identifier=identifier,
                modality="image",
            )
            mm_features.append(mm_feature)

        prompt_token_ids = [0] * num_tokens if same_prompt else [i] * num_tokens
        request = Request(
            request_id=req_ids[i],
            prompt_token_ids=prompt_token_ids,
            sampling_params=sampling_params,
            pooling_params=None,
            mm_features=mm_features if mm_features else None,
            block_hasher=block_hasher,
        )
        requests.append(request)
    return requests
