"""vattention's CPU attention kernel against vLLM's CPU attention op on the calls a real engine
makes: the batches of one `bench vllm` workload, captured from the plugin, replayed through both
kernels on the same K/V values.

    .venv-vllm/bin/python benchmarks/bench_attention_replay.py capture long-context small calls.json
    .venv-vllm/bin/python benchmarks/bench_attention_replay.py replay calls.json

The model is a ``bench vllm`` size (``small``: fp32) or preset (``gqa4-bf16``, ``qwen2.5-0.5b``:
bf16, at their real depth); the replay runs in the model's dtype, and vLLM's op at the ISA its CPU
backend picks for it (``amx`` for bf16 on a CPU with AMX tiles, else ``vec``), as stock runs it.

``capture`` runs the plugin in this process at vLLM's defaults plus sizes (those of
``bench_vllm_breakdown.py``), warms it up with two passes of the workload, then records every
attention call of the first layer during a third pass: each request's query tokens and cached
tokens. ``replay`` gives both kernels caches of the model's shape for every layer (16 rows of 4096
tokens, random values; vLLM's op reads the same values from its own paged layout, 128-token
blocks written by its ``cpu_attn_reshape_and_cache``), then runs the recorded calls once per
layer: ours through ``flash_attn_with_kvcache``'s CPU path, appending the new K/V in the call;
vLLM's op as its CPU backend runs it, ``cpu_attn_reshape_and_cache`` then
``cpu_attention_with_kv_cache`` (scheduler metadata built beforehand, as vLLM's metadata builder
does once per step; KV splits on, vLLM's default). Calls with only decode rows and calls with a
prefill chunk are timed separately; both kernels are warmed up, then alternated (A B B A) over
``--rounds`` rounds, and the min (median) of each is printed. Outputs are compared first.

``--layout mega`` / ``--layout layer`` (repeatable; default ``plain``) give our kernel the K/V in a
vattention cache of that layout instead of plain tensors (same values, timed in the same
alternation): ``mega`` is what the vLLM plugin uses by default, one row holding every layer of a
token, so a layer's rows are a whole token's K apart. Their pages are 2 MB unless the layout says
otherwise (``layer:64KB``, ``mega:768KB``: the page the engine's log line names for the model).

The **rate** columns say how close each kernel runs to this machine's limits: for the decode
calls, the K/V bytes they must read (every row's cached and new tokens, K and V, once) per second,
next to the machine's streaming read (``src.sum()``) and copy (read + write bytes) rates over
1 GiB, measured in this process before and after the timing (they swing with the machine's
load); for the calls with a prefill chunk, FLOPs per second (QK and P.V: 4 per query head, key
and dimension, causal rows counting the keys they see), which compute bounds. With a pass
breakdown of stock vLLM (``bench_vllm_breakdown.py``) they bound the end-to-end ratio any
attention kernel could reach here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _vllm_engine import ROWS, build_engine, run_pass, use_engine  # noqa: E402
from bench_attention import vllm_isa, vllm_ops  # noqa: E402
from bench_attention_small import BLOCK, paged  # noqa: E402

from _timing import compare_min_median  # noqa: E402

TOKENS = 4096


def split_layout(value: str) -> tuple:
    """(layout, page size) of a ``--layout`` value; 2 MB pages where it names none."""
    layout, _, size = value.partition(":")
    return layout, size or "2MB"


def layout_arg(value: str) -> str:
    """``--layout``'s value: plain, mega or layer, optionally with a page size (layer:64KB)."""
    from vattention.config import parse_size

    layout, _, size = value.partition(":")
    if layout not in ("plain", "mega", "layer") or (size and layout == "plain"):
        raise argparse.ArgumentTypeError(f"{value!r}: plain, mega, layer, mega:SIZE or layer:SIZE")
    if size:
        try:
            parse_size(size, name="page size")
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{value!r}: {e}") from e
    return value


def capture(workload: str, name: str, out_path: str) -> int:
    use_engine(plugin=True)
    from vattention.integrations.vllm import attention

    calls, recording, first_layer = [], [False], []
    forward = attention.VAttentionImpl.forward

    def recorded(self, layer, *a, **k):
        m = a[4] if len(a) > 4 else k.get("attn_metadata")
        if m is not None:
            if not first_layer:
                first_layer.append(id(layer))
            if recording[0] and id(layer) == first_layer[0]:
                qs = m.query_start
                calls.append(
                    {"qlens": [qs[i + 1] - qs[i] for i in range(len(qs) - 1)], "past": list(m.past)}
                )
        return forward(self, layer, *a, **k)

    attention.VAttentionImpl.forward = recorded
    llm, preset = build_engine(name)
    shape = [
        preset.num_layers,
        preset.hidden_size,
        preset.num_heads,
        preset.num_kv_heads,
        preset.head_dim,
    ]
    for round_ in (100, 101, 0):  # two warm-up passes, then the recorded one
        recording[0] = round_ == 0
        run_pass(llm, workload, round_)
    with open(out_path, "w") as f:
        json.dump(
            {
                "workload": workload,
                "model_size": name,
                "model": shape,
                "dtype": preset.dtype,
                "calls": calls,
            },
            f,
        )
    print(f"{len(calls)} calls of the first layer recorded in {out_path}")
    return 0


class Replay:
    """Both kernels' caches for every layer, filled with the same values."""

    def __init__(
        self,
        ops,
        layers: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        layouts=("plain",),
    ):
        self.ops, self.layers, self.heads = ops, layers, heads
        self.hkv, self.d, self.dtype = kv_heads, head_dim, dtype
        self.isa = vllm_isa(dtype, head_dim, BLOCK)  # what stock's CPU backend runs
        plain, self.theirs = [], []
        for _ in range(layers):
            k = torch.randn(ROWS, TOKENS, kv_heads, head_dim).to(dtype)
            v = torch.randn(ROWS, TOKENS, kv_heads, head_dim).to(dtype)
            plain.append((k, v))
            self.theirs.append(
                paged(ops, k.reshape(-1, kv_heads, head_dim), v.reshape(-1, kv_heads, head_dim))
            )
        self.table = torch.arange(ROWS * TOKENS // BLOCK, dtype=torch.int32).view(ROWS, -1)
        self.ours, self.caches = {}, []  # layout -> per layer (k, v); the vattention caches
        for layout in layouts:
            self.ours[layout] = plain if layout == "plain" else self._cache(layout, plain)

    def _cache(self, layout: str, values):
        """A vattention cache of this layout, every row mapped, holding `values`."""
        import vattention

        kind, page_size = split_layout(layout)
        cache = vattention.KVCache(
            vattention.KVCacheConfig(
                num_layers=self.layers,
                num_kv_heads=self.hkv,
                head_dim=self.d,
                max_batch_size=ROWS,
                max_seq_len=TOKENS,
                dtype=self.dtype,
                layout=kind,
                page_size=page_size,
            )
        )
        self.caches.append(cache)
        slots = [cache.alloc() for _ in range(ROWS)]
        if slots != list(range(ROWS)):  # the calls name rows 0..ROWS-1, as in the plain tensors
            raise SystemExit(f"a new cache handed out slots {slots}, not 0..{ROWS - 1}")
        cache.step({s: TOKENS for s in slots})
        tensors = []
        for layer, (k, v) in enumerate(values):
            kc, vc = cache.layer(layer)
            kc.copy_(k)
            vc.copy_(v)
            tensors.append((kc, vc))
        return tensors

    def close(self) -> None:
        for cache in self.caches:
            cache.close()

    def prepare(self, call):
        qlens, past = call["qlens"], call["past"]
        n, total = len(qlens), sum(qlens)
        cu = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
        past_t = torch.tensor(past, dtype=torch.int32)
        seq = past_t + torch.tensor(qlens, dtype=torch.int32)
        slots = torch.arange(n, dtype=torch.int32)
        slot_mapping = torch.cat(
            [torch.arange(i * TOKENS + past[i], i * TOKENS + past[i] + qlens[i]) for i in range(n)]
        )
        meta = self.ops.cpu_attn_get_scheduler_metadata(
            num_reqs=n,
            num_heads=self.heads,
            num_kv_heads=self.hkv,
            head_dim=self.d,
            seq_lens=seq,
            dtype=self.dtype,
            query_start_loc=cu,
            causal=True,
            sliding_window_size=-1,
            isa=self.isa,
            enable_kv_split=True,
        )
        return dict(
            q=torch.randn(total, self.heads, self.d).to(self.dtype),
            k=torch.randn(total, self.hkv, self.d).to(self.dtype),
            v=torch.randn(total, self.hkv, self.d).to(self.dtype),
            cu=cu,
            past=past_t,
            seq=seq,
            slots=slots,
            slot_mapping=slot_mapping,
            meta=meta,
            max_q=max(qlens),
        )

    def ours_fn(self, calls, layout: str = "plain", keep: bool = False):
        """A function running `calls` over every layer; it returns each call's outputs, layer by
        layer, where `keep`, else the last one."""
        from vattention.integrations import flash_attn as fa

        scale = self.d**-0.5

        def run():
            kept = []
            for c in calls:
                for k_cache, v_cache in self.ours[layout]:
                    out = fa.flash_attn_with_kvcache(
                        c["q"],
                        k_cache,
                        v_cache,
                        k=c["k"],
                        v=c["v"],
                        cache_seqlens=c["past"],
                        cache_batch_idx=c["slots"],
                        cu_seqlens_q=c["cu"],
                        max_seqlen_q=c["max_q"],
                        softmax_scale=scale,
                        causal=True,
                    )
                    if keep:
                        kept.append(out)
            return kept if keep else out

        return run

    def theirs_fn(self, calls, keep: bool = False):
        scale = self.d**-0.5

        def run():
            kept = []
            for c in calls:
                for kc, vc in self.theirs:
                    self.ops.cpu_attn_reshape_and_cache(
                        c["k"], c["v"], kc, vc, c["slot_mapping"], self.isa
                    )
                    out = torch.empty_like(c["q"])
                    self.ops.cpu_attention_with_kv_cache(
                        query=c["q"],
                        key_cache=kc,
                        value_cache=vc,
                        output=out,
                        query_start_loc=c["cu"],
                        seq_lens=c["seq"],
                        scale=scale,
                        causal=True,
                        alibi_slopes=None,
                        sliding_window=-1,
                        block_table=self.table,
                        softcap=0.0,
                        scheduler_metadata=c["meta"],
                        s_aux=None,
                    )
                    if keep:
                        kept.append(out)
            return kept if keep else out

        return run


def machine_rates(rounds: int = 5):
    """(read, copy) bytes/s of this machine over 1 GiB, same threads, best of `rounds`."""
    src = torch.ones(1 << 28)  # 1 GiB of float32: far beyond the caches
    dst = torch.zeros_like(src)
    read = copy = 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        src.sum()
        read = max(read, src.nbytes / (time.perf_counter() - t))
        t = time.perf_counter()
        dst.copy_(src)
        copy = max(copy, 2 * src.nbytes / (time.perf_counter() - t))
    return read, copy


def call_work(call, heads: int, kv_heads: int, head_dim: int, elem: int = 4):
    """(K/V bytes, FLOPs) of one layer's call: every row reads its cached and new K and V once;
    a query token of a causal row meets the keys up to its own position."""
    nbytes = flops = 0
    for q, past in zip(call["qlens"], call["past"]):
        nbytes += (past + q) * kv_heads * head_dim * elem * 2
        keys = q * past + q * (q + 1) // 2
        flops += 4 * heads * head_dim * keys
    return nbytes, flops


def replay(path: str, rounds: int, layouts=("plain",)) -> int:
    ops, why = vllm_ops()
    if ops is None:
        print(
            f"vLLM's CPU op is not available here ({why}): run with .venv-vllm/bin/python",
            file=sys.stderr,
        )
        return 2
    with open(path) as f:
        doc = json.load(f)
    layers, _, heads, kv_heads, head_dim = doc["model"]
    dtype = getattr(torch, doc.get("dtype", "float32"))
    torch.manual_seed(0)
    rep = Replay(ops, layers, heads, kv_heads, head_dim, dtype, layouts)
    try:
        return _replay(rep, doc, rounds, layouts)
    finally:
        rep.close()


def _replay(rep: Replay, doc, rounds: int, layouts) -> int:
    decode, prefill = "decode rows only", "with a prefill chunk"
    groups = {decode: [], prefill: []}
    work = {decode: 0.0, prefill: 0.0}  # decode: K/V bytes; prefill: FLOPs
    for call in doc["calls"]:
        name = decode if max(call["qlens"]) == 1 else prefill
        groups[name].append(rep.prepare(call))
        nbytes, flops = call_work(call, rep.heads, rep.hkv, rep.d, rep.dtype.itemsize)
        work[name] += rep.layers * (nbytes if name == decode else flops)

    def rate(name: str, seconds: float) -> str:
        per_s = work[name] / seconds / 1e9
        return f"{per_s:.1f} GB/s" if name == decode else f"{per_s:.0f} GFLOP/s"

    # same outputs on one call of each group, every layer; bf16 outputs differ by their
    # rounding (2^-8 relative) where the kernels sum in different orders
    tol = 1e-4 if rep.dtype == torch.float32 else 2e-2
    for calls in groups.values():
        if not calls:
            continue
        theirs = rep.theirs_fn(calls[:1], keep=True)()
        for layout in layouts:
            for layer, (a, b) in enumerate(
                zip(rep.ours_fn(calls[:1], layout, keep=True)(), theirs, strict=True)
            ):
                if not torch.allclose(a.float(), b.float(), atol=tol, rtol=tol):
                    raise SystemExit(
                        f"outputs differ ({layout}, layer {layer}): max |ours - vLLM| = "
                        f"{(a.float() - b.float()).abs().max():.3g}"
                    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {doc['workload']} "
        f"{doc['model_size']} (layers, hidden, heads, KV heads, d = {tuple(doc['model'])}; "
        f"{str(rep.dtype).removeprefix('torch.')}): vLLM's op with isa={rep.isa!r}; "
        f"{len(doc['calls'])} calls x {rep.layers} layers; load average "
        f"{os.getloadavg()[0]:.2f} at start\n"
    )
    read, copy = machine_rates()
    print(
        "| calls | count | our K/V | ours ms | vLLM op ms | ours / vLLM (min) | ours: rate | "
        "vLLM op: rate |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    totals = {layout: [0.0, 0.0] for layout in layouts}
    for name, calls in groups.items():
        if not calls:
            continue
        fns = {layout: rep.ours_fn(calls, layout) for layout in layouts}
        fns["vllm"] = rep.theirs_fn(calls)
        t = compare_min_median(fns, calls=1, rounds=rounds)
        vmin, vmed = t["vllm"]
        for layout in layouts:
            omin, omed = t[layout]
            totals[layout][0] += omin
            totals[layout][1] += vmin
            print(
                f"| {name} | {len(calls)} | {layout} | {omin * 1e3:.0f} ({omed * 1e3:.0f}) | "
                f"{vmin * 1e3:.0f} ({vmed * 1e3:.0f}) | {omin / vmin:.2f} | {rate(name, omin)} | "
                f"{rate(name, vmin)} |"
            )
    for layout, (ours, theirs) in totals.items():
        print(
            f"| all | {len(doc['calls'])} | {layout} | {ours * 1e3:.0f} | {theirs * 1e3:.0f} | "
            f"{ours / theirs:.2f} | | |"
        )
    read_end, copy_end = machine_rates()
    print(
        f"\nthis machine, same threads, 1 GiB: read {read / 1e9:.1f} GB/s before and "
        f"{read_end / 1e9:.1f} after; copy (read + write bytes) {copy / 1e9:.1f} and "
        f"{copy_end / 1e9:.1f}"
    )
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture", help="record the first layer's attention calls of one pass")
    c.add_argument("workload")
    c.add_argument("model", help="a bench vllm model size or preset")
    c.add_argument("out")
    r = sub.add_parser("replay", help="time both kernels on the recorded calls")
    r.add_argument("calls")
    r.add_argument("--rounds", type=int, default=4)
    r.add_argument(
        "--layout",
        action="append",
        type=layout_arg,
        help="our K/V: plain tensors (default) or a vattention cache of this layout, in 2 MB "
        "pages or those of LAYOUT:SIZE (layer:64KB: the plugin's pages for gqa4-bf16); "
        "repeatable, all timed in one alternation",
    )
    args = p.parse_args(argv)
    if args.cmd == "replay" and args.rounds < 2:  # alternation needs two rounds (A B, B A)
        p.error(f"--rounds {args.rounds} must be >= 2")
    if args.cmd == "capture":
        from vattention.bench.vllm_bench import WORKLOADS, named_model

        if args.workload not in WORKLOADS:
            p.error(f"workload {args.workload!r} is not one of {WORKLOADS}")
        try:
            named_model(args.model)
        except ValueError as e:
            p.error(str(e))
        return capture(args.workload, args.model, args.out)
    return replay(args.calls, args.rounds, tuple(dict.fromkeys(args.layout or ["plain"])))


if __name__ == "__main__":
    sys.exit(main())
