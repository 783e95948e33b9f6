"""The plugin's CPU forward (``VAttentionImpl.forward``) on vLLM's real classes, run in the vLLM
venv: over a real vattention cache, with buffers exactly the step's size (vLLM's CPU runner) and
with buffers padded past it (where the forward slices them), against ``cpu_attention`` called on
the same step. Prints one JSON document.
"""

from __future__ import annotations

import json
import pathlib
import sys
from types import SimpleNamespace as NS

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: support.*

from vattention import KVCache, KVCacheConfig  # noqa: E402
from vattention.attention import cpu_attention  # noqa: E402
from vattention.integrations.vllm.attention import (  # noqa: E402
    VAttentionCPUMetadataBuilder,
    VAttentionImpl,
)

from support.vllm_steps import run_steps  # noqa: E402

HEADS, KV_HEADS, DIM, WINDOW, PAD = 4, 2, 32, 40, 3


def main() -> None:
    impl = VAttentionImpl(HEADS, DIM, DIM**-0.5, KV_HEADS, None, WINDOW, "auto")
    vllm_config = NS(cache_config=NS(enable_prefix_caching=False))
    builder = VAttentionCPUMetadataBuilder(
        NS(block_size=16), ["layer"], vllm_config, torch.device("cpu")
    )
    config = KVCacheConfig(
        num_layers=1,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        max_batch_size=3,
        max_seq_len=256,
        dtype=torch.float32,
        device="cpu",
    )
    torch.manual_seed(0)
    results = []
    with KVCache(config) as cache:
        slots = [cache.alloc() for _ in range(3)]
        layer = NS(vattention_kv=cache.layer(0))
        pads = (0, PAD)
        schedule = ([(2, 100), (0, 7)], [(1, 60), (0, 1), (2, 1)])
        for pad, step in zip(pads, run_steps(cache, builder, slots, schedule)):
            total, m = step.total, step.metadata
            q = torch.randn(total + pad, HEADS, DIM)
            k = torch.randn(total + pad, KV_HEADS, DIM)
            v = torch.randn(total + pad, KV_HEADS, DIM)
            out = torch.full((total + pad, HEADS * DIM), 7.0)  # vLLM's [tokens, heads x dim]
            impl.forward(layer, q, k, v, None, m, out)
            # the same step again, straight: it appends the same K/V at the same positions
            k_cache, v_cache = layer.vattention_kv
            want = cpu_attention(
                q[:total],
                k_cache,
                v_cache,
                k[:total],
                v[:total],
                cache_seqlens=torch.tensor(step.past, dtype=torch.int32),
                cache_batch_idx=torch.tensor(step.rows, dtype=torch.int32),
                cu_seqlens_q=step.starts,
                softmax_scale=DIM**-0.5,
                causal=True,
                window_size=(WINDOW - 1, 0),
            )
            results.append(
                dict(
                    pad=pad,
                    equal=bool(torch.equal(out[:total].view(total, HEADS, DIM), want)),
                    padding_untouched=bool((out[total:] == 7.0).all()),
                )
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
