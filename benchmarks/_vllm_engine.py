"""The engine the vLLM benchmark scripts run in their own process (bench_vllm_breakdown.py, and
bench_attention_replay.py's capture): vLLM's defaults plus sizes (1 GiB of KV, 16 sequences,
max_model_len 4096, the model's dtype), the model a ``bench vllm`` size or preset, driven pass by
pass with ``bench vllm``'s workloads."""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import List, Tuple

ROWS, MAX_MODEL_LEN, KV_BYTES = 16, 4096, 1 << 30


def use_engine(plugin: bool) -> None:
    """This process's environment for one engine: the plugin on or off, the engine in this
    process (``vllm_run.engine_in_this_process``). Call before vLLM builds an engine (the plugin
    is read when it does)."""
    from vattention.bench.vllm_run import engine_in_this_process

    if plugin:
        os.environ["VATTENTION_VLLM"] = "1"
    else:
        os.environ.pop("VATTENTION_VLLM", None)
    engine_in_this_process()


def build_engine(name: str):
    """``(llm, preset)``: model ``name`` (a size or a preset, random weights, built once under the
    temporary directory) in a vLLM engine of the scripts' sizes."""
    import vllm

    from vattention.bench.vllm_bench import named_model

    preset = named_model(name)
    path = preset.build(
        os.path.join(tempfile.gettempdir(), f"vattention-scripts-{preset.family}-{name}"),
        max_positions=MAX_MODEL_LEN,
    )
    llm = vllm.LLM(
        model=path,
        dtype=preset.dtype,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=ROWS,
        kv_cache_memory_bytes=KV_BYTES,
    )
    return llm, preset


def run_pass(
    llm, workload: str, round_: int, num_requests: int = 64
) -> Tuple[float, List[List[List[int]]]]:
    """Pass ``round_`` of ``workload`` (its token ids drawn for that round): the seconds
    ``generate()`` took and, per request and completion, the generated token ids."""
    from vattention.bench.vllm_bench import make_workload
    from vattention.bench.vllm_run import timed_generate

    ns = argparse.Namespace(
        num_requests=num_requests, length_scale=0.5, max_model_len=MAX_MODEL_LEN, seed=0
    )
    _, seconds, tokens = timed_generate(llm, make_workload(workload, round_, ns))
    return seconds, tokens
