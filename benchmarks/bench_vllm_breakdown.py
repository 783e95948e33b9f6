"""Where one vLLM engine's time goes, component by component, on one `bench vllm` workload.

One engine (stock vLLM, or vLLM with the vattention plugin) runs in this process, at vLLM's
defaults plus sizes (1 GiB of KV, 16 sequences, max_model_len 4096, the model's dtype). The model
is a `--model-size` (random Llama, fp32) or a `--model` preset (a real architecture's shape,
bf16). It is warmed up with two passes of the workload, then timed over three passes with new
token ids each (`--passes`; `--num-requests` as in `bench vllm`, 64 by default); the fastest pass is
printed with the wall time spent inside each wrapped method (the engine step, the runner's parts,
the attention forward, split into calls with a prefill chunk and decode-only calls, stock's K/V
cache write (a separate op; the plugin's forward appends K/V inside its kernel call), and for the
plugin `KVCache.step` / `KVCache.prefetch`). Nested entries are indented: their time is part of
the line above them. Run it once per engine, one after the other, on a quiet machine:

    .venv-vllm/bin/python benchmarks/bench_vllm_breakdown.py stock shared-prefix small
    .venv-vllm/bin/python benchmarks/bench_vllm_breakdown.py plugin shared-prefix small
    .venv-vllm/bin/python benchmarks/bench_vllm_breakdown.py plugin sharegpt qwen2.5-0.5b \
        --num-requests 16

`python -m vattention bench vllm` is the throughput comparison (both engines alive, alternated);
this script explains its ratios.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import tempfile
import time
from typing import Dict


def main(argv=None) -> int:
    from vattention.bench.model_presets import PRESETS
    from vattention.bench.vllm_bench import MODEL_SIZES, WORKLOADS, named_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engine", choices=("stock", "plugin"))
    p.add_argument("workload", choices=WORKLOADS)
    p.add_argument("model", choices=tuple(MODEL_SIZES) + tuple(PRESETS))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--passes", type=int, default=3)
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.passes < 1:
        p.error(f"--num-requests {args.num_requests} and --passes {args.passes} must be >= 1")
    if args.engine == "plugin":
        os.environ["VATTENTION_VLLM"] = "1"
    else:
        os.environ.pop("VATTENTION_VLLM", None)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

    from vattention.bench.vllm_bench import make_workload

    preset = named_model(args.model)
    model = preset.build(
        os.path.join(tempfile.gettempdir(), f"vattention-breakdown-{preset.family}-{args.model}"),
        max_positions=4096,
    )

    import vllm
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    spent: Dict[str, float] = collections.defaultdict(float)
    parent: Dict[str, str] = {}  # a nested entry's label -> the label whose time includes it
    shown: Dict[str, str] = {}  # a label -> the text printed for it, where they differ

    def timed(cls, name: str, label: str, within: str = "", kind=None) -> None:
        """Wraps cls.name to add its wall time to `label`, and to the nested entry that
        `kind(args, kwargs)` names, if any."""
        f = getattr(cls, name)
        if within:
            parent[label] = within

        @functools.wraps(f)
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                dt = time.perf_counter() - t
                spent[label] += dt
                sub = kind(a, k) if kind else None
                if sub:
                    spent[sub] += dt

        setattr(cls, name, wrapper)

    def timed_attention(cls, label: str) -> None:
        """Times the forward, and again by kind of call: with a prefill chunk, or decode only."""
        for kind in ("with a prefill chunk", "decode only"):
            parent[f"calls {kind} ({label})"] = label
            shown[f"calls {kind} ({label})"] = f"calls {kind}"

        def call_kind(a, k):  # forward(self, layer, q, k, v, kv_cache, attn_metadata, ...)
            md = k.get("attn_metadata", a[6] if len(a) > 6 else None)
            if md is None:  # vLLM's warm-up and profiling runs
                return None
            return (
                f"calls {'with a prefill chunk' if md.max_query_len > 1 else 'decode only'} "
                f"({label})"
            )

        timed(cls, "forward", label, kind=call_kind)

    timed(EngineCore, "step", "engine.step")
    timed(Scheduler, "schedule", "scheduler.schedule")
    timed(Scheduler, "update_from_output", "scheduler.update_from_output")
    timed(GPUModelRunner, "execute_model", "runner.execute_model")
    timed(GPUModelRunner, "_update_states", "runner._update_states (vLLM's)")
    timed(GPUModelRunner, "_prepare_inputs", "runner._prepare_inputs")
    timed(GPUModelRunner, "_build_attention_metadata", "runner._build_attention_metadata")
    timed(GPUModelRunner, "sample_tokens", "runner.sample_tokens")
    timed_attention(cpu_attn.CPUAttentionBackendImpl, "attention (stock CPU_ATTN)")
    # stock writes the new K/V in a separate op (its backend's forward_includes_kv_cache_update
    # is False); the plugin's forward appends them inside its kernel call
    timed(
        cpu_attn.CPUAttentionBackendImpl,
        "do_kv_cache_update",
        "K/V cache write (stock, outside its attention forward)",
    )
    if args.engine == "plugin":
        import vattention._C as native
        from vattention.cache import KVCache
        from vattention.integrations.vllm import attention, runner

        timed_attention(attention.VAttentionImpl, "attention (vattention)")
        timed(native, "flash_attn_with_kvcache", "the native kernel call", "attention (vattention)")
        plugin_states = "runner._update_states (the plugin's, vLLM's included)"
        timed(runner.VAttentionRunnerMixin, "_update_states", plugin_states)
        timed(KVCache, "step", "KVCache.step", plugin_states)
        timed(KVCache, "prefetch", "KVCache.prefetch", plugin_states)
        parent["runner._update_states (vLLM's)"] = plugin_states  # the plugin's calls super()

    llm = vllm.LLM(
        model=model,
        dtype=preset.dtype,
        max_model_len=4096,
        max_num_seqs=16,
        kv_cache_memory_bytes=1 << 30,
    )
    ns = argparse.Namespace(
        num_requests=args.num_requests, length_scale=0.5, max_model_len=4096, seed=0
    )

    def one_pass(round_: int):
        reqs = make_workload(args.workload, round_, ns)
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
        params = [vllm.SamplingParams(**r["sampling"]) for r in reqs]
        t = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t, sum(len(c.token_ids) for o in out for c in o.outputs)

    for warm in (100, 101):  # compilation, first pages, allocator: outside the timing
        one_pass(warm)
    best = None
    for round_ in range(args.passes):
        before = dict(spent)
        dt, tokens = one_pass(round_)
        if best is None or dt < best[0]:
            best = (dt, tokens, {k: v - before.get(k, 0.0) for k, v in spent.items()})
    dt, tokens, parts = best
    print(
        f"{args.engine}, {args.workload}, model {args.model} ({preset.dtype}): fastest of "
        f"{args.passes} passes "
        f"{dt * 1e3:.0f} ms, {tokens} tokens, {tokens / dt:.0f} tokens/s; load average "
        f"{os.getloadavg()[0]:.2f}"
    )

    def show(within: str, depth: int) -> None:
        for label in sorted(
            (k for k in parts if parent.get(k, "") == within), key=lambda k: -parts[k]
        ):
            text = shown.get(label, label)
            print(f"  {'  ' * depth}{text:{58 - 2 * depth}s} {parts[label] * 1e3:9.1f} ms")
            show(label, depth + 1)

    show("", 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
