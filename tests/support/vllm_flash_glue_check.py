"""The plugin's FLASH_ATTN classes around the paged call, run in the vLLM venv on the CPU.

Run with the vLLM venv's python; prints one JSON document. vLLM's CPU build has
``vllm/vllm_flash_attn`` as Python only (its import fails for want of the CUDA extensions), so a
stand-in module takes its place in ``sys.modules``, with the torch stand-ins of
tests/support/flash_stand_in.py, and vLLM's ``_custom_ops.reshape_and_cache_flash`` (a wrapper of a
CUDA op) is replaced the same way. What runs is the plugin's code on vLLM's real base classes:
``VAttentionFlashImpl`` (the kernel chosen once through ``select_cuda_kernel``, with vLLM's own
``get_flash_attn_version`` tried first; the layer checks; ``supports_quant_query_input``),
``VAttentionFlashMetadataBuilder.build`` (the step's ``FlashBatch``) and the impl's CUDA forward
over a real vattention cache, compared with the reference.
"""

from __future__ import annotations

import json
import logging
import pathlib
import sys
import types
from types import SimpleNamespace as NS

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: support.*

import vllm._custom_ops as vllm_ops  # noqa: E402

from vattention import KVCache, KVCacheConfig  # noqa: E402
from vattention.attention import reference_attention  # noqa: E402
from vattention.integrations.vllm.attention import (  # noqa: E402
    VAttentionFlashBackend,
    VAttentionFlashImpl,
    VAttentionFlashMetadataBuilder,
)
from vattention.integrations.vllm.runner import VAttentionRunnerMixin  # noqa: E402

from support.flash_stand_in import StandIn  # noqa: E402
from support.rounding import fp32_attention_bound, rounded_output_excess  # noqa: E402
from support.vllm_steps import run_steps  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK, WINDOW = 4, 2, 32, 32, 40


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    stand_in = StandIn()
    module = types.ModuleType("vllm.vllm_flash_attn")
    module.flash_attn_varlen_func = stand_in.flash_attn_varlen_func
    module.is_fa_version_supported = lambda version: version == 3
    sys.modules["vllm.vllm_flash_attn"] = module
    vllm_ops.reshape_and_cache_flash = stand_in.reshape_and_cache_flash
    log = Lines()
    logging.getLogger("vllm.vattention").addHandler(log)
    logging.getLogger("vllm.vattention").setLevel(logging.INFO)

    assert VAttentionFlashBackend.get_impl_cls() is VAttentionFlashImpl
    assert VAttentionFlashBackend.get_builder_cls() is VAttentionFlashMetadataBuilder
    impls = {
        dtype: VAttentionFlashImpl(HEADS, DIM, DIM**-0.5, KV_HEADS, None, WINDOW, dtype)
        for dtype in ("auto", "fp8")
    }
    impl = impls["auto"]
    builder = VAttentionFlashMetadataBuilder(
        NS(block_size=BLOCK), ["layer"], NS(), torch.device("cpu")
    )
    unit = KV_HEADS * DIM * 2
    config = KVCacheConfig(
        num_layers=2,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        max_batch_size=3,
        max_seq_len=256,
        dtype=torch.bfloat16,
        device="cpu",
        page_size=BLOCK * unit,
        layout="layer",
        sliding_window=WINDOW,
    )
    torch.manual_seed(0)  # reproducible inputs (the bound holds for any)
    errors, calls = [], 0
    with KVCache(config) as cache:
        slots = [cache.alloc() for _ in range(3)]
        layer = NS(
            vattention_kv=cache.layer(1), **{f"_{x}_scale": torch.tensor(1.0) for x in "qkv"}
        )
        schedule = ([(2, 100), (0, 7)], [(0, 1), (2, 1), (1, 60)])  # vLLM's order: decodes first
        for step in run_steps(cache, builder, slots, schedule):
            rows, past, new, m, total = step.rows, step.past, step.new, step.metadata, step.total
            q = torch.randn(total, HEADS, DIM, dtype=torch.bfloat16)
            k = torch.randn(total, KV_HEADS, DIM, dtype=torch.bfloat16)
            v = torch.randn(total, KV_HEADS, DIM, dtype=torch.bfloat16)
            out = torch.zeros(total, HEADS, DIM, dtype=torch.bfloat16)
            impl._forward_cuda(layer, q, k, v, m, out)  # the CUDA branch of forward()
            calls = len(stand_in.calls)
            k_cache, v_cache = layer.vattention_kv
            ref = reference_attention(
                q.float(),
                k_cache,
                v_cache,
                cache_seqlens=torch.tensor([p + n for p, n in zip(past, new)]),
                cache_batch_idx=torch.tensor(rows),
                cu_seqlens_q=step.starts,
                softmax_scale=DIM**-0.5,
                causal=True,
                window_size=(WINDOW - 1, 0),
            )
            # bf16's rounding of an fp32 output plus two fp32 evaluations' (derived, not fitted)
            spans = [(s, cache.window_start(s, 1), p + n) for s, p, n in zip(rows, past, new)]
            ks = torch.cat([k_cache[s, a:b].float() for s, a, b in spans])
            vs = torch.cat([v_cache[s, a:b].float() for s, a, b in spans])
            keys = max(b - a for _, a, b in spans)
            fp32 = fp32_attention_bound(q.float(), ks, vs, keys, DIM**-0.5)
            errors.append(rounded_output_excess(out, ref, torch.bfloat16, fp32))
    runner = NS(device=torch.device("cuda"))
    print(
        json.dumps(
            dict(
                kernel=impl.kernel.label,
                quantize_query={d: i.supports_quant_query_input for d, i in impls.items()},
                max_excess_over_rounding=max(errors),
                calls=calls,
                stats_kernel=VAttentionRunnerMixin._attention_kernel(runner),
                selection_lines=sum("CUDA attention through" in line for line in log.lines),
            )
        )
    )


if __name__ == "__main__":
    main()
