"""The measuring parts of the GPU check, each run by check.py in a process of its own:

    python benchmarks/gpu/parts.py NAME LOG [--emulated]

NAME is vmm, attention, flash-attn-4, prefetch, memory, generate or cpu-attention. Each appends
JSON lines to LOG as it goes (a part the check stops at its time limit still reports what it
measured): ``{"kind": "row", ...figures}``, ``{"kind": "note", "text": ...}``, or ``{"kind":
"skip", "why": ...}`` for a part with nothing to run on (flash-attn-4 without FA4). With
--emulated, the CUDA backend is the driver EMULATION (VATTENTION_LIBCUDA, set by check.py) and
torch is the CPU build: the emulated analogue runs, whose figures describe host memory and the
emulation, never a GPU. cpu-attention involves no GPU in either mode: its figures are this
machine's CPU's.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "benchmarks"), str(ROOT / "tests" / "cuda_emulator")]

MB = 1 << 20
GB = 1 << 30
# The per-call costs docs/cuda.md and the core's comments quote, measured on an A100 with 2 MB
# pages (microseconds); none is quoted for cuMemRelease.
A100_US = {"create": 193.0, "map": 1.45, "set_access": 36.0, "unmap": 25.6, "release": None}
# Llama-3-8B's KV shape: 32 layers, 8 KV heads of 128.
LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128)

Emit = Callable[..., None]


def vmm(emit: Emit, emulated: bool) -> None:
    """Per-call driver latency by page size, beside the A100 figures; then the throughput of
    step() mapping a batch's rows (pages pre-created, and created inside step())."""
    import vmm_calls
    from cudrv import Driver

    drv = Driver()
    emit(kind="note", text=f"ctypes call floor (cuCtxGetCurrent): {call_floor(drv):.2f} us/call")
    total = 32 if emulated else 512
    for row in vmm_calls.measure(page_sizes_mb=(2, 32), total_mb=total, drv=drv):
        if row["page_MB"] == 2:
            a100 = ("n/a" if v is None else f"{v:g}" for v in A100_US.values())
            row["A100_2MB_us"] = " / ".join(a100)
        emit(kind="row", **row)
    for row in mapping_throughput(total_bytes=(64 * MB if emulated else GB)):
        emit(kind="row", **row)


def call_floor(drv: Any) -> float:
    import vmm_calls

    return vmm_calls.call_floor_us(drv)


def mapping_throughput(total_bytes: int) -> list[dict]:
    import torch

    import vattention

    rows = []
    slots, layers = 8, 8
    token_bytes = 2 * layers * 8 * 128 * 2  # K and V, bf16
    tokens = max(1024, total_bytes // (slots * token_bytes) // 1024 * 1024)
    for pre_created in (True, False):
        cfg = vattention.KVCacheConfig(
            num_layers=layers,
            num_kv_heads=8,
            head_dim=128,
            max_batch_size=slots,
            max_seq_len=tokens,
            dtype=torch.bfloat16,
            device="cuda:0",
            page_size="2MB",
        )
        with vattention.KVCache(cfg) as cache:
            rows_ = [cache.alloc() for _ in range(slots)]
            if pre_created:
                cache.reserve(cfg.pages_for_tokens(tokens) * slots * cfg.page_bytes)
            before = cache.stats()
            t0 = time.perf_counter()
            for n in range(512, tokens + 1, 512):
                cache.step({s: n for s in rows_})
            elapsed = time.perf_counter() - t0
            after = cache.stats()
        mapped = after["bytes_mapped"] - before["bytes_mapped"]
        rows.append(
            {
                "step() mapping": "pages pre-created" if pre_created else "pages created in step()",
                "GB": round(mapped / GB, 2),
                "map_calls": after["map_calls"] - before["map_calls"],
                "set_access_calls": after["set_access_calls"] - before["set_access_calls"],
                "GB_per_s": round(mapped / GB / elapsed, 2),
            }
        )
    return rows


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median milliseconds of one call on the GPU (CUDA events), after a warm-up."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _kernels(emit: Emit) -> dict[str, Callable]:
    """name -> fn(q, k, v) over [B, L, H, D] caches (as the cache holds them); only those here."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa_flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            )

    kernels: dict[str, Callable] = {"sdpa-flash": sdpa_flash}
    try:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention)
        kernels["flex_attention"] = lambda q, k, v: flex(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
    except Exception as e:  # an old torch, no Triton
        emit(kind="note", text=f"flex_attention unavailable: {type(e).__name__}: {e}"[:200])
    for name, module in (("flash-attn", "flash_attn"), ("vllm-flash-attn", "vllm.vllm_flash_attn")):
        try:
            fa = __import__(module, fromlist=["flash_attn_with_kvcache"]).flash_attn_with_kvcache
        except Exception as e:  # not installed (the usual case), or a broken install
            emit(kind="note", text=f"{name}: not run ({type(e).__name__}: {e})"[:200])
            continue
        kernels[name] = lambda q, k, v, fa=fa: fa(q, k, v, causal=True)
    return kernels


def attention(emit: Emit, emulated: bool) -> None:
    """Attention over the virtual cache against a contiguous copy of the same data: equal
    outputs (bit for bit) and the time ratio, decode and prefill, bf16."""
    if emulated:
        attention_emulated(emit)
        return
    import torch

    import vattention

    kernels = _kernels(emit)
    for batch, seq in ((8, 16384), (64, 4096)):
        if batch == 64:  # flex_attention compiles once per shape: one batch of it is enough
            kernels.pop("flex_attention", None)
        cfg = vattention.KVCacheConfig(
            num_layers=1,
            num_kv_heads=8,
            head_dim=128,
            max_batch_size=batch,
            max_seq_len=seq,
            dtype=torch.bfloat16,
            device="cuda:0",
            page_size="2MB",
        )
        with vattention.KVCache(cfg) as cache:
            cache.step({cache.alloc(): seq for _ in range(batch)})
            k, v = cache.layer(0)
            k.normal_()
            v.normal_()
            _compare(emit, kernels, k, v, batch, seq)
        torch.cuda.empty_cache()


def _compare(emit: Emit, kernels: dict[str, Callable], k: Any, v: Any, batch: int, seq: int):
    import torch

    # Same shape and strides in ordinary (cudaMalloc) memory: only the memory differs.
    kc, vc = k.clone(), v.clone()
    for phase, q_len in (("decode", 1), ("prefill", 512)):
        q = torch.randn(batch, q_len, 8, 128, device="cuda", dtype=torch.bfloat16)
        for name, fn in kernels.items():
            case = {"kernel": name, "phase": phase, "batch": batch, "context": seq}
            try:
                equal = torch.equal(fn(q, k, v), fn(q, kc, vc))
                t_virtual = _median_ms(lambda: fn(q, k, v), 20)
                t_contig = _median_ms(lambda: fn(q, kc, vc), 20)
            except Exception as e:  # one kernel's refusal must not lose the others
                emit(kind="row", **case, error=f"{type(e).__name__}: {e}"[:200])
                continue
            emit(
                kind="row",
                **case,
                equal=equal,
                contiguous_ms=round(t_contig, 4),
                virtual_over_contiguous=round(t_virtual / t_contig, 3),
            )


def attention_emulated(emit: Emit) -> None:
    """CPU SDPA over host_alias views of the emulated device memory against a contiguous copy:
    checks the plumbing (export, strides, mapped rows); its times are a CPU's."""
    import torch

    import vattention

    emit(kind="note", text="flex_attention, flash-attn, vLLM's FlashAttention: need a GPU")
    batch, seq = 4, 1024
    cfg = vattention.KVCacheConfig(
        num_layers=1,
        num_kv_heads=8,
        head_dim=64,
        max_batch_size=batch,
        max_seq_len=seq,
        dtype=torch.bfloat16,
        device="cuda:0",
        page_size="2MB",
    )
    with vattention.KVCache(cfg) as cache:
        cache.step({cache.alloc(): seq for _ in range(batch)})
        k, v = cache.host_alias(0)
        assert v is not None
        k.normal_()
        v.normal_()
        kc, vc = k.clone(), v.clone()

        def sdpa(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            )

        for phase, q_len in (("decode", 1), ("prefill", 64)):
            q = torch.randn(batch, q_len, 8, 64, dtype=torch.bfloat16)
            equal = torch.equal(sdpa(q, k, v), sdpa(q, kc, vc))
            t = {}
            for name, args in (("virtual", (q, k, v)), ("contiguous", (q, kc, vc))):
                t0 = time.perf_counter()
                for _ in range(5):
                    sdpa(*args)
                t[name] = (time.perf_counter() - t0) / 5
            emit(
                kind="row",
                kernel="sdpa (CPU, host_alias)",
                phase=phase,
                batch=batch,
                context=seq,
                equal=equal,
                virtual_over_contiguous=round(t["virtual"] / t["contiguous"], 3),
            )


def prefetch(emit: Emit, emulated: bool) -> None:
    """How long step() blocks per decode iteration with the prefetch thread mapping behind the
    model's work, over how long it blocks without: the blocking ratio (target <= 0.1); the same
    loop with lengths held fixed (step() maps nothing: its floor after the model's work); and
    step() with nothing to map called back to back over 8 and 64 rows (target <= 10 us)."""
    import bench_prefetch

    emit(kind="note", text="blocking_ratio: mean step() time with prefetch / without (target 0.1)")
    if emulated:
        compute, dims, slots, iterations, gap = _emulated_compute(emit)
    else:
        compute, dims, slots, iterations, gap = _gpu_compute(emit)
    emit(
        kind="note",
        text="floor_us: the same loop with lengths held fixed (step() maps nothing), mean / p99",
    )
    for layout in ("layer", "mega"):
        kw: dict[str, Any] = dict(
            iterations=iterations,
            gap_s=gap,
            slots=slots,
            device="cuda:0",
            dims=dims,
            lookahead_tokens=16,
            compute=compute,
        )
        base = bench_prefetch.run(layout, "2MB", False, **kw)
        pf = bench_prefetch.run(layout, "2MB", True, **kw)
        floor = bench_prefetch.run(layout, "2MB", False, floor=True, **kw)
        emit(
            kind="row",
            layout=layout,
            page="2MB",
            tokens_per_page=base["tokens_per_page"],
            no_prefetch_us=f"{base['mean'] * 1e6:.1f} / {base['p99'] * 1e6:.1f}",
            prefetch_us=f"{pf['mean'] * 1e6:.1f} / {pf['p99'] * 1e6:.1f}",
            blocking_ratio=round(pf["mean"] / base["mean"], 3),
            floor_us=f"{floor['mean'] * 1e6:.1f} / {floor['p99'] * 1e6:.1f}",
            calls_per_step_in_step=pf["step_calls"],
            calls_per_step_by_thread=pf["prefetch_calls"],
        )
    # The emulation spends a host file descriptor per page: 2 layers there (the plumbing only).
    step_dims = dict(num_layers=2, num_kv_heads=8, head_dim=128) if emulated else LLAMA3_8B
    for layout in ("layer", "mega"):
        for rows in (8, 64):
            emit(kind="row", **step_nothing_to_map(layout, rows, step_dims))


def step_nothing_to_map(layout: str, rows: int, dims: dict) -> dict:
    """step() over `rows` rows whose pages are all mapped, called back to back (a dict of
    lengths, as an engine passes them): min and median microseconds per call over 7 rounds of
    2000 calls, and the driver calls those steps made (0 expected)."""
    import torch

    import vattention

    from _timing import compare_min_median

    cfg = vattention.KVCacheConfig(
        **dims,
        max_batch_size=rows,
        max_seq_len=4096,
        dtype=torch.bfloat16,
        page_size="2MB",
        layout=layout,
        device="cuda:0",
    )
    with vattention.KVCache(cfg) as cache:
        lens = {cache.alloc(): 100 + i for i in range(rows)}
        cache.step(lens)
        before = cache.stats()
        t = compare_min_median({"step": lambda: cache.step(lens)}, calls=2000, rounds=7)
        after = cache.stats()
    low, median = t["step"]
    return dict(
        case="step() with nothing to map",
        layout=layout,
        rows=rows,
        step_us_min=round(low * 1e6, 2),
        step_us_median=round(median * 1e6, 2),
        driver_calls=after["step_driver_calls"] - before["step_driver_calls"],
    )


def _gpu_compute(emit: Emit):
    """A real kernel on the current stream between steps (torch.cuda._sleep spins the GPU for a
    number of its clock cycles, calibrated here to 2 ms), waited for as a decode loop waits for
    its logits: the prefetch thread's driver calls run while the GPU works."""
    import torch

    torch.cuda.init()
    probe = 50_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)  # warm-up
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    cycles = int(probe / start.elapsed_time(end) * 2.0)
    emit(kind="note", text=f"compute between steps: torch.cuda._sleep({cycles}) = ~2 ms of GPU")

    def compute() -> None:
        torch.cuda._sleep(cycles)
        torch.cuda.current_stream().synchronize()

    return compute, LLAMA3_8B, 64, 300, 0.002


def _emulated_compute(emit: Emit):
    """The emulation holds each entry point for the A100 cost; a host sleep stands in for the
    kernel (the emulated GPU runs nothing). Fewer layers and slots: each page is a host fd."""
    import emu
    from bench_prefetch_cuda_emulated import A100_LATENCY_US_PER_2MB

    em = emu.Emulator.load()
    em.set_device_memory_bytes(80 << 30)
    for entry, us in A100_LATENCY_US_PER_2MB.items():
        em.set_latency_ns(entry, round(us * 1000))
    emit(
        kind="note",
        text="A100 per-call latencies held by the emulation; a 2 ms host sleep stands in for "
        "the kernel; 8 layers x 32 KV heads x 128 (256 tokens a page), 8 slots, 100 steps",
    )
    return None, dict(num_layers=8, num_kv_heads=32, head_dim=128), 8, 100, 0.002


# Llama-3.2-1B's shape (random weights; the vocabulary of the first GPU run's model, 32000).
LLAMA32_1B = dict(
    num_hidden_layers=16,
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=8192,
    vocab_size=32000,
)


def generate(emit: Emit, emulated: bool) -> None:
    """transformers generate() with DynamicCache (eager), StaticCache (compiled by transformers),
    VAttentionCache eager and compiled: tokens/s of a second run, the first divergence of each
    row's tokens from DynamicCache's, KV bytes held, graphs compiled; then the host time of one
    decode step's update() calls, DynamicCache against VAttentionCache. On the emulation (CPU
    torch) a tiny Llama runs on the CPU with the host backend in fp32, the compiled rows by
    dynamo alone: the plumbing, not a figure."""
    import torch
    import transformers

    if emulated:
        shape = dict(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            vocab_size=256,
        )
        batch, prompt, new, dtype, device, page = 2, 32, 16, torch.float32, "cpu", "64KB"
        compile_config = transformers.CompileConfig(fullgraph=True, backend="eager", mode=None)
        compile_config._compile_all_devices = True  # transformers compiles on GPUs only
        emit(
            kind="note",
            text="CPU torch, host backend, a 2-layer Llama in fp32, batch 2, 32 + 16 tokens; "
            "compiled rows traced by dynamo alone (backend eager): the plumbing, not a figure",
        )
    else:
        shape, batch, prompt, new = LLAMA32_1B, 8, 1024, 256
        dtype, device, page, compile_config = torch.bfloat16, "cuda", "2MB", None
        emit(
            kind="note",
            text="Llama-3.2-1B shape (random weights, vocab 32000), bf16, batch 8, 1024 + 256 "
            "tokens, greedy; compiled: transformers' default CompileConfig (inductor, "
            "reduce-overhead); tokens/s of the second of two runs",
        )
    config = transformers.LlamaConfig(
        **shape,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device, dtype).eval()
    ids = torch.randint(1, shape["vocab_size"], (batch, prompt), device=device)
    runs = _generate_runs(model, batch, prompt + new, page, compile_config)
    reference = None
    for name, make_cache, kwargs in runs:
        row: dict[str, Any] = {"cache": name}
        try:
            result = _generate_twice(model, ids, new, make_cache, kwargs)
        except Exception as e:  # one cache's failure must not lose the others
            emit(kind="row", **row, error=f"{type(e).__name__}: {e}"[:300])
            continue
        tokens = result.pop("tokens")
        if reference is None:
            reference = tokens
        row["tokens_per_s"] = round(batch * new / result.pop("seconds"), 1)
        if name != "DynamicCache":
            row["first_divergence"] = _first_divergence(tokens, reference)
            if emulated:  # fp32 on one CPU: the same tokens or a bug
                row["equal"] = bool(torch.equal(tokens, reference))
        row.update(result)
        emit(kind="row", **row)
    _update_host_time(emit, emulated)


def _generate_runs(model: Any, batch: int, max_len: int, page: str, compile_config: Any):
    """(name, cache factory, extra generate kwargs) per cache."""
    import transformers

    from vattention.integrations.transformers import VAttentionCache

    def vattention(compileable: bool, layout: str = "layer"):
        def make() -> Any:
            return VAttentionCache.from_model(
                model,
                max_batch_size=batch,
                max_seq_len=max_len,
                page_size=page,
                layout=layout,
                compileable=compileable,
            )

        return make

    compiled = {"compile_config": compile_config} if compile_config is not None else {}
    # DynamicCache first (the reference), then the rows this part is for; a part cut by the
    # budget keeps the rows finished before. The mega layout last: its 2 MB pages hold all
    # layers of 128 tokens (Llama-3.2-1B, bf16), where a layer-layout page holds one layer of
    # 2048, so it holds a 1280-token bucket in StaticCache's bytes (layer: 512 MiB, mega 320).
    return [
        ("DynamicCache", transformers.DynamicCache, {}),
        ("VAttentionCache (eager)", vattention(False), {}),
        ("VAttentionCache (compiled)", vattention(True), compiled),
        (
            "StaticCache (compiled)",
            lambda: transformers.StaticCache(config=model.config, max_cache_len=max_len),
            compiled,
        ),
        ("VAttentionCache (compiled, mega)", vattention(True, "mega"), compiled),
    ]


def _generate_twice(model: Any, ids: Any, new: int, make_cache: Callable, kwargs: dict) -> dict:
    """Two generate() calls (the first compiles and warms up), the second timed. A DynamicCache
    is made anew for each, as generate() makes its own; the others are reset and used again, as a
    server keeps one (a StaticCache's tensors and a VAttentionCache's pages stay allocated)."""
    import torch
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    skips = counters["inductor"]["cudagraph_skips"]
    cache = make_cache()
    fresh = type(cache).__name__ == "DynamicCache"
    try:
        for attempt in range(2):
            if attempt:
                if fresh:
                    cache = make_cache()
                else:
                    cache.reset()
            args = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
            _sync()
            t0 = time.perf_counter()
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), past_key_values=cache, **args, **kwargs
            )
            _sync()
            seconds = time.perf_counter() - t0
        result = {
            "seconds": seconds,
            "tokens": out[:, ids.shape[1] :].cpu(),
            "kv_bytes_held": _kv_bytes(cache),
            "graphs_compiled": counters["stats"]["unique_graphs"] - graphs,
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips,
        }
        if getattr(cache, "compileable", False):
            result["view_len"] = cache.view_len
        return result
    finally:
        if hasattr(cache, "close"):
            cache.close()


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _kv_bytes(cache: Any) -> int:
    """Bytes of K/V the cache holds: mapped pages for a VAttentionCache, its tensors otherwise."""
    if hasattr(cache, "memory_bytes"):
        return int(cache.memory_bytes())
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            total += 0 if t is None else t.numel() * t.element_size()
    return total


def _first_divergence(tokens: Any, reference: Any) -> str:
    """Per row, the index of the first generated token that differs from the reference's, or
    "-" where none does."""
    out = []
    for row, ref in zip(tokens.tolist(), reference.tolist()):
        diff = next((i for i, (a, b) in enumerate(zip(row, ref)) if a != b), None)
        out.append("-" if diff is None else str(diff))
    return " ".join(out)


def _update_host_time(emit: Emit, emulated: bool) -> None:
    """One decode step's update() calls, DynamicCache against VAttentionCache (eager), timed on
    the host without synchronising: the host time a GPU step pays for the cache."""
    import bench_hf_update

    shape = "dispatch" if emulated else "llama-1b"
    device = "cpu" if emulated else "cuda"
    for row in bench_hf_update.measure(shape, rounds=4, steps=20, device=device, quiet=True):
        emit(kind="row", **row)


# The CPU kernel's decode cases, most telling first: the shape its target is stated on (GQA 4 in
# bf16 over 4k-token rows, >= 0.8 of a streaming copy), then GQA 1 in fp32.
CPU_DECODE_CASES = (("bfloat16", 4), ("float32", 1))
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_line() -> str:
    """This machine's CPU as /proc/cpuinfo names it, the flags the kernel dispatches on, the
    cores this process may use and the load average."""
    from vattention.bench.machine import cpu_flags, cpu_name

    flags = cpu_flags()
    have = " ".join(x for x in CPU_FLAGS if x in flags) or "none of " + "/".join(CPU_FLAGS)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"CPU: {cpu_name()}; {len(os.sched_getaffinity(0))} cores usable; {have}; load {load}"


def cpu_attention(emit: Emit, emulated: bool) -> None:
    """The CPU attention kernel on this machine's own CPU (on the GPU machine: the GPU's host),
    no GPU involved in either mode: decode over a vattention cache, its K/V read rate against a
    streaming copy of as many bytes (bench_attention.py's figure), output checked against torch
    SDPA per row; and a bf16 prefill chunk (the amx variant's tiles where the CPU has them)
    against torch SDPA's time, output checked against it. All cores, 2 threads (the project's CPU
    machines), then AVX2 on all cores. On the emulation a small shape checks the plumbing only."""
    import torch
    from bench_attention import N, S, measure_decode, measure_prefill

    from vattention import _C
    from vattention.attention import kernel_variants
    from vattention.integrations import flash_attn as fa

    emit(kind="note", text=cpu_line())
    variants = [v.name for v in kernel_variants() if v.runnable]
    refused = [f"{v.name} ({v.why_not()})" for v in kernel_variants() if v.compiled and v.refused]
    _C.set_attention_kernel_isa("")
    best = fa.kernel_isa()
    emit(
        kind="note",
        text=f"kernel variants this build runs on this CPU: {', '.join(variants)} "
        f"(default {best}; the check's build has the ISA variants on 8+ cores)"
        + (f"; refused by the OS: {', '.join(refused)}" if refused else ""),
    )
    cores = len(os.sched_getaffinity(0))
    if emulated:
        plan, shape, rounds = [(2, best)], dict(rows=2, tokens=512), 1
        prefill = (32, 8, 64, 128, 128)  # heads, KV heads, d, chunk, cached before
        emit(kind="note", text="2 rows x 512 tokens, one round: the plumbing, not a figure")
    else:
        # the default ISA on all cores and on 2 threads, then AVX2 on all cores (its figure is
        # printed beside the wider ISA's, with no target of its own)
        plan = [(cores, best), (2, best)] + [(cores, "avx2")] * (best != "avx2")
        plan = list(dict.fromkeys(plan))
        shape, rounds = dict(rows=N, tokens=S), 6
        prefill = (32, 8, 128, 512, 1536)
    try:
        for threads, isa in plan:
            if not _C.set_attention_kernel_isa(isa):
                emit(kind="note", text=f"kernel ISA {isa}: not in this build or not on this CPU")
                continue
            torch.set_num_threads(threads)
            for dtype, group in CPU_DECODE_CASES:
                case = {"isa": fa.kernel_isa(), "threads": threads, "dtype": dtype, "gqa": group}
                try:
                    (r,) = measure_decode(
                        getattr(torch, dtype), (group,), rounds=rounds, calls=2, full=False, **shape
                    )
                except Exception as e:  # a wrong output fails this part, after the other cases
                    emit(kind="row", **case, error=f"{type(e).__name__}: {e}"[:300])
                    continue
                emit(
                    kind="row",
                    **case,
                    rows_x_tokens=f"{shape['rows']} x {shape['tokens']}",
                    kernel_ms=round(r["t"]["kernel"][0] * 1e3, 3),
                    kv_GBps=round(r["kv"] / 1e9, 1),
                    copy_GBps=round(r["copy"] / 1e9, 1),
                    kv_over_copy=round(r["kv"] / r["copy"], 2),
                    kv_over_read=round(r["kv"] / r["read"], 2),
                )
            heads, hkv, d, chunk, past = prefill
            case = {"isa": fa.kernel_isa(), "threads": threads, "dtype": "bfloat16"}
            case["gqa"] = heads // hkv
            case.update(prefill=f"{heads} / {hkv} x {d}, {chunk} after {past}")
            try:
                t, flops = measure_prefill(
                    torch.bfloat16, heads, hkv, d, chunk, past, rounds=rounds
                )
            except Exception as e:
                emit(kind="row", **case, error=f"{type(e).__name__}: {e}"[:300])
                continue
            emit(
                kind="row",
                **case,
                kernel_ms=round(t["kernel"][0] * 1e3, 3),
                sdpa_ms=round(t["sdpa"][0] * 1e3, 3),
                kernel_speed_over_sdpa=round(t["sdpa"][0] / t["kernel"][0], 2),
                kernel_GFLOPs=round(flops / t["kernel"][0] / 1e9),
            )
    finally:
        _C.set_attention_kernel_isa("")


# The flash-attn-4 part's accuracy cases, most telling first: (layout, dtype, head_dim, GQA group,
# phase). tests/gpu/test_gpu_fa4.py runs the whole matrix (the gpu-tests part).
FA4_CASES = (
    ("layer", "bfloat16", 128, 4, "decode"),
    ("mega", "bfloat16", 128, 4, "decode"),
    ("layer", "bfloat16", 128, 4, "prefill"),
    ("mega", "bfloat16", 128, 4, "chunked prefill"),
    ("layer", "float16", 64, 1, "decode"),
    ("mega", "float16", 64, 8, "prefill"),
)


def flash_attn_4(emit: Emit, emulated: bool) -> None:
    """FlashAttention-4 over the virtual cache (fa4_measure.py): its output against fp32 SDPA as
    close as over a contiguous copy, no NaN from past a row's length, no fault at a mega page
    boundary, its time over the cache against a copy, and a short table of FA4 with a page_table
    against FA4 over the cache. Without a GPU or without FA4 it says so and measures nothing."""
    if emulated:
        emit(kind="skip", why="needs a GPU")
        return
    # FA4 compiles each kernel on first use: keep them on disk for a second run of the check.
    out = Path(os.environ.get("GPU_CHECK_OUT") or ROOT / "gpu-check")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(out / "fa4-kernels"))
    import fa4_measure as m

    fa4, version = m.load_fa4()
    if fa4 is None:
        emit(kind="skip", why=f"flash-attn-4 not installed ({version})")
        return
    import torch

    from vattention.integrations.flash_attn4 import FA4_VERSION, fa4_key_tile

    major, minor = torch.cuda.get_device_capability(0)
    arch = major * 10 + minor
    emit(
        kind="note",
        text=f"flash-attn-4 {version} on sm_{arch}: key tile {fa4_key_tile(128, arch=arch)} at "
        f"head_dim 128, {fa4_key_tile(64, arch=arch)} at 64; caches with kv_tile_tokens=128",
    )
    if version != FA4_VERSION:  # the tiles the integration checks with are read from that one
        emit(kind="note", text=f"the key tiles are flash-attn-4 {FA4_VERSION}'s, not {version}'s")
    device = "cuda:0"
    cases = [(lay, getattr(torch, dt), hd, g, ph) for lay, dt, hd, g, ph in FA4_CASES]
    for row in m.accuracy(fa4, device, cases, lens=[1, 300, 2049, 4096]):
        if "error" not in row and row["err_virtual"] > row["err_copy"]:
            row["error"] = "further from fp32 SDPA over the cache than over a copy"
        emit(kind="row", **row)
    for rule in (True, False):
        try:
            emit(kind="row", **m.nan_past_the_length(fa4, device, tile_rule=rule))
        except Exception as e:
            emit(kind="row", check="NaN planted past the length", error=f"{type(e).__name__}: {e}")
    emit(kind="note", text="kv_tile_tokens=0: FA4 called directly (the integration refuses it)")
    try:
        emit(kind="row", **m.mega_boundary(fa4, device))
    except Exception as e:
        emit(kind="row", check="mega boundary", error=f"{type(e).__name__}: {e}"[:300])
    for row in m.time_virtual_vs_copy(fa4, device, batch=8, context=16384):
        emit(kind="row", **row)
    emit(
        kind="note",
        text="page_table vs the virtual cache: python benchmarks/gpu/"
        "bench_fa4_paged.py for the whole table (batch 1-64, 1k-32k, 8B and 70B shapes)",
    )
    for row in m.paged_vs_virtual(fa4, device, points=[(8, 4096), (32, 16384)]):
        emit(kind="row", **row)


def memory(emit: Emit, emulated: bool) -> None:
    """The driver's free memory against the cache's own figures (memory_part.py)."""
    import memory_part

    memory_part.memory(emit, emulated)


PARTS = {
    "vmm": vmm,
    "attention": attention,
    "flash-attn-4": flash_attn_4,
    "prefetch": prefetch,
    "memory": memory,
    "generate": generate,
    "cpu-attention": cpu_attention,
}


def main(argv: list[str]) -> int:
    name, log = argv[1], Path(argv[2])
    emulated = "--emulated" in argv[3:]

    def emit(**line: Any) -> None:
        with log.open("a") as f:
            f.write(json.dumps(line, default=str) + "\n")

    PARTS[name](emit, emulated)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
