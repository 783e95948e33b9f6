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
the line above them, and the runner's time outside attention and the K/V write (the model's
matmuls, norms and the rest) is a line of its own.

``both`` keeps the two engines alive side by side, in processes of their own, and times their
passes alternated (A B B A, ``--rounds`` times), so that a machine whose speed drifts slows both
alike; it prints each part's min (median) over the passes for each engine and their ratio, and
compares the engines' generated tokens pass by pass (both get the same requests in a round):
where they differ it names the first difference and, in an fp32 model, exits 1 (as ``bench vllm``
does). A single engine's passes run back to back, in this process:

    .venv-vllm/bin/python benchmarks/bench_vllm_breakdown.py both long-context gqa4-bf16
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
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from typing import Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _vllm_engine import build_engine, run_pass, use_engine  # noqa: E402

OUTSIDE = "runner.execute_model outside attention and the K/V write"
KV_WRITE = "K/V cache write (stock, outside its attention forward)"
ATTENTION = {"stock": "vLLM's CPU_ATTN backend", "plugin": "vattention's"}


def main(argv=None) -> int:
    from vattention.bench.model_presets import PRESETS
    from vattention.bench.vllm_bench import MODEL_SIZES, WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engine", choices=("stock", "plugin", "both"))
    p.add_argument("workload", choices=WORKLOADS)
    p.add_argument("model", choices=tuple(MODEL_SIZES) + tuple(PRESETS))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--passes", type=int, default=3, help="one engine: timed passes")
    p.add_argument("--rounds", type=int, default=2, help="both: rounds of A B B A")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # a child of both
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.passes < 1 or args.rounds < 1:
        p.error(
            f"--num-requests {args.num_requests}, --passes {args.passes} and --rounds "
            f"{args.rounds} must be >= 1"
        )
    if args.engine == "both":
        return compare(args)
    if args.serve:
        return serve(args)
    one_pass, labels = engine(args)
    best = None
    for round_ in range(args.passes):
        dt, tokens, parts = one_pass(round_)
        if best is None or dt < best[0]:
            best = (dt, tokens, parts)
    assert best is not None  # --passes >= 1
    dt, tokens, parts = best
    from vattention.bench.vllm_run import generated_tokens

    generated = generated_tokens(tokens)
    print(
        f"{args.engine}, {args.workload}, model {args.model}: fastest of {args.passes} passes "
        f"{dt * 1e3:.0f} ms, {generated} tokens, {generated / dt:.0f} tokens/s; load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    print(f"  attention: {ATTENTION[args.engine]}")
    for depth, label in labels(parts):
        print(f"  {'  ' * depth}{label:{58 - 2 * depth}s} {parts[label] * 1e3:9.1f} ms")
    return 0


def engine(args) -> Tuple[Callable, Callable]:
    """The engine of ``args`` in this process, its parts timed, warmed up: ``(one_pass, labels)``.
    ``one_pass(round_)`` runs the workload's pass ``round_`` and returns (seconds, the generated
    token ids per request and completion, {part: seconds}); ``labels(parts)`` lists (depth, part)
    in print order."""
    use_engine(plugin=args.engine == "plugin")

    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    spent: Dict[str, float] = collections.defaultdict(float)
    parent: Dict[str, str] = {OUTSIDE: "runner.execute_model"}  # a nested part -> its parent

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

    attention, kv_write = "attention", KV_WRITE

    def timed_attention(cls) -> None:
        """Times the forward, and again by kind of call: with a prefill chunk, or decode only."""
        for kind in ("with a prefill chunk", "decode only"):
            parent[f"calls {kind}"] = attention

        def call_kind(a, k):  # forward(self, layer, q, k, v, kv_cache, attn_metadata, ...)
            md = k.get("attn_metadata", a[6] if len(a) > 6 else None)
            if md is None:  # vLLM's warm-up and profiling runs
                return None
            return f"calls {'with a prefill chunk' if md.max_query_len > 1 else 'decode only'}"

        timed(cls, "forward", attention, kind=call_kind)

    timed(EngineCore, "step", "engine.step")
    timed(Scheduler, "schedule", "scheduler.schedule")
    timed(Scheduler, "update_from_output", "scheduler.update_from_output")
    timed(GPUModelRunner, "execute_model", "runner.execute_model")
    timed(GPUModelRunner, "_update_states", "runner._update_states (vLLM's)")
    timed(GPUModelRunner, "_prepare_inputs", "runner._prepare_inputs")
    timed(GPUModelRunner, "_build_attention_metadata", "runner._build_attention_metadata")
    timed(GPUModelRunner, "sample_tokens", "runner.sample_tokens")
    if args.engine == "stock":
        timed_attention(cpu_attn.CPUAttentionBackendImpl)
        # stock writes the new K/V in a separate op (its backend's
        # forward_includes_kv_cache_update is False); the plugin's forward appends them inside
        # its kernel call
        timed(cpu_attn.CPUAttentionBackendImpl, "do_kv_cache_update", kv_write)
    else:
        import vattention._C as native
        from vattention.cache import KVCache
        from vattention.integrations.vllm import attention as plugin_attention, runner

        timed_attention(plugin_attention.VAttentionImpl)
        timed(native, "flash_attn_with_kvcache", "the native kernel call", attention)
        # the forward's call through each layer's CpuAttentionPlan: the function the plan binds
        # to its layer (_C.prepare_attention), timed as the plan gets it
        prepare = native.prepare_attention

        def prepare_timed(*a, **k):
            bound = types.SimpleNamespace(run=prepare(*a, **k))
            timed(bound, "run", "the native kernel call", attention)
            return bound.run

        native.prepare_attention = prepare_timed
        plugin_states = "runner._update_states (the plugin's, vLLM's included)"
        timed(runner.VAttentionRunnerMixin, "_update_states", plugin_states)
        timed(KVCache, "step", "KVCache.step", plugin_states)
        timed(KVCache, "prefetch", "KVCache.prefetch", plugin_states)
        parent["runner._update_states (vLLM's)"] = plugin_states  # the plugin's calls super()

    llm, _ = build_engine(args.model)

    def one_pass(round_: int):
        before = dict(spent)
        dt, tokens = run_pass(llm, args.workload, round_, args.num_requests)
        parts = {k: v - before.get(k, 0.0) for k, v in spent.items()}
        parts[OUTSIDE] = (
            parts.get("runner.execute_model", 0.0)
            - parts.get(attention, 0.0)
            - parts.get(kv_write, 0.0)
        )
        return dt, tokens, parts

    def labels(parts: Dict[str, float]) -> List[Tuple[int, str]]:
        """(depth, part): the top-level parts by time, each followed by its nested ones."""
        out: List[Tuple[int, str]] = []

        def walk(within: str, depth: int) -> None:
            for label in sorted(
                (k for k in parts if parent.get(k, "") == within), key=lambda k: -parts[k]
            ):
                out.append((depth, label))
                walk(label, depth + 1)

        walk("", 0)
        return out

    for warm in (100, 101):  # compilation, first pages, allocator: outside the timing
        one_pass(warm)
    return one_pass, labels


def serve(args) -> int:
    """A child of ``both``: the engine, then one pass per stdin line (its round), each answered
    with one JSON line on the real stdout."""
    from vattention.bench.vllm_run import answer_channel

    answer = answer_channel()
    one_pass, labels = engine(args)
    print(json.dumps({"ready": True}), file=answer, flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        dt, tokens, parts = one_pass(command["round"])
        print(
            json.dumps(
                {
                    "round": command["round"],
                    "seconds": dt,
                    "tokens": tokens,
                    "parts": parts,
                    "labels": labels(parts),
                }
            ),
            file=answer,
            flush=True,
        )
    return 0


def compare(args) -> int:
    """``both``: the two engines side by side, passes alternated A B B A; each part's min
    (median) per engine, and plugin / stock of the mins; then their tokens compared (the exit
    status: :func:`tokens_line`)."""
    logs = tempfile.mkdtemp(prefix="vattention-breakdown-")
    procs: Dict[str, subprocess.Popen] = {}
    for name in ("stock", "plugin"):
        cmd = [sys.executable, os.path.abspath(__file__), name, args.workload, args.model]
        cmd += ["--num-requests", str(args.num_requests), "--serve"]
        env = {k: v for k, v in os.environ.items() if k != "VATTENTION_VLLM"}
        with open(os.path.join(logs, f"{name}.log"), "w") as log:
            procs[name] = subprocess.Popen(
                cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )

    def answer(name: str) -> dict:
        out = procs[name].stdout
        assert out is not None  # a pipe
        line = out.readline()
        if not line:
            raise SystemExit(f"the {name} engine exited; its log: {logs}/{name}.log")
        return json.loads(line)

    def send(name: str, command: dict) -> None:
        stdin = procs[name].stdin
        assert stdin is not None  # a pipe
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()

    try:
        for name in procs:  # both load and warm up at once; the timing starts when both are ready
            answer(name)
        load = os.getloadavg()[0]
        runs: Dict[str, List[dict]] = {"stock": [], "plugin": []}
        for round_ in range(args.rounds):
            for i, name in enumerate(("stock", "plugin", "plugin", "stock")):
                send(name, {"round": 2 * round_ + i // 2})
                runs[name].append(answer(name))
        for name, proc in procs.items():
            send(name, {"quit": True})
            proc.wait(timeout=300)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    passes = len(runs["stock"])
    print(
        f"{args.workload}, model {args.model}: {passes} passes per engine, A B B A; load "
        f"average {load:.2f} before, {os.getloadavg()[0]:.2f} after; logs in {logs}\n"
    )
    print("| part | stock ms | plugin ms | plugin / stock |")
    print("|---|---:|---:|---:|")

    def cell(values: List[float]) -> str:
        return f"{min(values) * 1e3:.0f} ({statistics.median(values) * 1e3:.0f})" if values else ""

    def row(text: str, stock: List[float], plugin: List[float]) -> None:
        ratio = f"{min(plugin) / min(stock):.2f}" if stock and plugin and min(stock) > 0 else ""
        print(f"| {text} | {cell(stock)} | {cell(plugin)} | {ratio} |")

    row("pass", [r["seconds"] for r in runs["stock"]], [r["seconds"] for r in runs["plugin"]])
    # the plugin's parts in its order (a superset but for stock's K/V write), then stock's others
    order = runs["plugin"][0]["labels"]
    seen = {label for _, label in order}
    order += [(depth, label) for depth, label in runs["stock"][0]["labels"] if label not in seen]
    for depth, label in order:
        row(
            "&nbsp;" * 4 * depth + label,
            [r["parts"][label] for r in runs["stock"] if label in r["parts"]],
            [r["parts"][label] for r in runs["plugin"] if label in r["parts"]],
        )
    line, status = tokens_line(runs, args.model)
    print(f"\n{line}")
    return status


def tokens_line(runs: Dict[str, List[dict]], model: str) -> Tuple[str, int]:
    """The engines' generated tokens compared pass by pass (``runs[engine][i]``: the answers of
    pass i, the same round for both): a line saying how many requests matched and where they
    first differed, and the exit status, 1 where they differed in an fp32 model (bf16 greedy
    picks tie and flip: reported only, as in ``bench vllm``)."""
    from vattention.bench.vllm_bench import STRICT_TOKEN_DTYPES, TokenTally, named_model
    from vattention.bench.vllm_run import generated_tokens

    tally = TokenTally()
    for stock, plugin in zip(runs["stock"], runs["plugin"]):
        assert stock["round"] == plugin["round"]  # A B B A gives both the same rounds in order
        tally.add(stock["round"], stock["tokens"], plugin["tokens"])
    first = (
        ""
        if tally.first is None
        else f"; first difference: round {tally.first['pass']}, request "
        f"{tally.first['request']}, token {tally.first['token']}"
    )
    generated = {name: sorted({generated_tokens(r["tokens"]) for r in runs[name]}) for name in runs}
    dtype = named_model(model).dtype
    strict = dtype in STRICT_TOKEN_DTYPES
    line = (
        f"tokens: {tally.same} of {tally.total} requests identical{first} ({dtype}: "
        f"{'a difference fails the run' if strict else 'reported only'}); generated tokens per "
        f"pass: stock {generated['stock']}, plugin {generated['plugin']}"
    )
    return line, 1 if strict and tally.same < tally.total else 0


if __name__ == "__main__":
    sys.exit(main())
