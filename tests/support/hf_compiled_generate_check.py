"""transformers' compiled generate() over a VAttentionCache(compileable=True), checked against
eager DynamicCache: run by tests/test_integrations_transformers.py in a subprocess.

    python tests/support/hf_compiled_generate_check.py CASE FAMILY [LAYOUT]

CASE is ``inductor`` (the default backend, fullgraph, transformers' default ``dynamic=None``),
``buckets`` (dynamo alone, ``dynamic=False``: one graph per bucket), ``overread`` (views and
mask made one page longer than prepare_forward mapped: a control that must die of SIGSEGV),
``chunked`` (``buckets`` with the prefill in chunks of 4, which transformers compiles too: the
slots claimed first with ``early_initialization``) or ``gpu`` (the model and the cache on CUDA,
2 MB pages, transformers' default CompileConfig: inductor with CUDA graphs; tests/gpu runs it).
Each KVCache has ``max_seq_len`` 4096 with only the buckets mapped, so a graph that read or
copied a cache tensor past them would fault here; the subprocess keeps that from killing pytest.

Prints one JSON line: tokens equal, graphs compiled, graph breaks, buckets seen, bytes mapped
against the bytes of the pages of the last bucket, and whether every forward's views lay within
the mapped pages.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers
from torch._dynamo.utils import counters
from transformers import CompileConfig

from vattention.integrations.transformers import VAttentionCache

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    # a window longer than max_seq_len: no page is released, the views keep their shape
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"sliding_window": None},
    ),
}
PAGE = 4096  # fp32, 2 KV heads x 16: 128 bytes a token, 32 tokens a page
BUCKET = 16
PROMPT, NEW = 7, 40  # lengths 7..46: buckets 16, 32, 48


def tiny_model(family: str) -> torch.nn.Module:
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        **extra,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return model_cls(config).eval()


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 96, (2, PROMPT), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on row 1
    ids[1, :3] = 0
    return ids, mask


def run(case: str, family: str, layout: str = "layer") -> dict:
    torch.set_num_threads(1)
    device = "cuda" if case == "gpu" else "cpu"
    model = tiny_model(family).to(device)
    ids, mask = (t.to(device) for t in prompts())
    args = dict(attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    if case == "chunked":  # DynamicCache chunked alike (transformers 4.57's differs unchunked)
        args["prefill_chunk_size"] = 4
    expected = model.generate(ids, past_key_values=transformers.DynamicCache(), **args)
    if case == "gpu":
        compile_config = CompileConfig(fullgraph=True)  # mode="reduce-overhead": CUDA graphs
    elif case == "inductor":
        compile_config = CompileConfig(fullgraph=True, mode="default")
    else:
        compile_config = CompileConfig(fullgraph=True, backend="eager", mode=None, dynamic=False)
    compile_config._compile_all_devices = True  # transformers compiles on CUDA only by default
    cache = VAttentionCache.from_model(
        model,
        max_batch_size=2,
        max_seq_len=4096,
        page_size="2MB" if case == "gpu" else PAGE,
        layout=layout,
        compileable=True,
        bucket_tokens=BUCKET,
    )
    views: list[tuple[int, int]] = []  # (view length, fewest tokens mapped in a row)
    prepare = cache.prepare_forward

    def spy(query_length: int) -> int:
        view_len = prepare(query_length)
        if case == "overread" and cache.slots:
            view_len += cache.config.tokens_per_page  # one page past those mapped
            for layer in cache.layers:
                layer._view_len = view_len
        if cache.slots:
            mapped = min(cache.kv_cache.mapped_tokens(s) for s in cache.slots)
            views.append((view_len, mapped))
        return view_len

    cache.prepare_forward = spy
    counters.clear()
    if case == "chunked":
        cache.early_initialization(
            batch_size=2, num_heads=2, head_dim=16, dtype=torch.float32, device=device
        )
    with cache:
        got = model.generate(ids, past_key_values=cache, compile_config=compile_config, **args)
        cfg = cache.config
        # the pages that back the last bucket in each row, all tensors (KVCacheConfig's count)
        pages = len(cache.slots) * cfg.pages_for_tokens(cache.view_len)
        return {
            "case": case,
            "family": family,
            "layout": layout,
            "tokens_equal": bool(torch.equal(got, expected)),
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
            "buckets": sorted({v for v, _ in views}),
            "views_within_mapped": all(v <= m for v, m in views),
            "forwards": len(views),
            "bytes_mapped": cache.memory_bytes(),
            "bytes_of_bucket_pages": pages * cfg.page_bytes,
            "seq_len": cache.get_seq_length(),
        }


if __name__ == "__main__":
    print(json.dumps(run(*sys.argv[1:])), flush=True)
