"""CUDA graphs and torch.compile over the virtual cache (GPU only; never run yet on hardware).

Contiguous virtual tensors keep their addresses, so a decode step (append k/v with the
compile-safe op, attention over a window of the cache) is captured once and replayed while pages
are mapped underneath: for slots allocated after capture, and for lengths growing into pages
mapped after capture. The rule (docs/compile.md): every position a captured kernel reads or
writes must be mapped before replay; ``step()`` does that.

The capture runs in torch's default GLOBAL mode, which forbids VMM calls from other threads while
it lasts, so one capture is made while the prefetch thread is mapping pages: the thread must not
break it. Under ``torch.compile(mode="reduce-overhead")`` the cache tensors are inputs the step
mutates (``append_kv``): inductor takes CUDA graphs only over mutated inputs whose address is
static, so they are marked with ``torch._dynamo.mark_static_address`` (their addresses never
change: that is the point of the virtual cache); otherwise it skips graphs, or would copy the
whole (mostly unmapped) cache into a graph-owned buffer on every call.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import vattention
from vattention.ops import append_kv

pytestmark = pytest.mark.gpu

# The window the captured step reads: 2 pages per tensor (32 KV heads x 128 fp16 = 8 KB per
# token, 256 tokens per 2 MB page).
W = 512


def decode(q, k, v, k_cache, v_cache, slots, lens):
    append_kv(k_cache, v_cache, k, v, slots, lens)
    kw = k_cache[slots, :W].transpose(1, 2)
    vw = v_cache[slots, :W].transpose(1, 2)
    mask = (torch.arange(W, device=q.device) <= lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q, kw, vw, attn_mask=mask)


def reference(q, k_cache, v_cache, slots, lens):
    """Eager attention over what the cache holds after the append."""
    kw = k_cache[slots, :W].transpose(1, 2)
    vw = v_cache[slots, :W].transpose(1, 2)
    mask = (torch.arange(W, device=q.device) <= lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q, kw, vw, attn_mask=mask)


def make_cache(device):
    cfg = vattention.KVCacheConfig(
        num_layers=1,
        num_kv_heads=32,
        head_dim=128,
        max_batch_size=8,
        max_seq_len=8192,
        dtype=torch.float16,
        device=device,
        page_size="2MB",
    )
    return vattention.KVCache(cfg)


def test_captured_decode_replays_over_pages_mapped_after_capture(gpu):
    with make_cache(gpu) as cache:
        kc, vc = cache.layer(0)
        slots = [cache.alloc(), cache.alloc()]
        cache.step({s: W for s in slots})  # the warm-up runs eagerly over the whole window
        static = dict(
            q=torch.randn(2, 32, 1, 128, device=gpu, dtype=torch.float16),
            k=torch.randn(2, 32, 128, device=gpu, dtype=torch.float16),
            v=torch.randn(2, 32, 128, device=gpu, dtype=torch.float16),
            slots=torch.tensor(slots, device=gpu),
            lens=torch.tensor([3, 10], device=gpu),
        )
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                decode(
                    static["q"], static["k"], static["v"], kc, vc, static["slots"], static["lens"]
                )
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode(
                static["q"], static["k"], static["v"], kc, vc, static["slots"], static["lens"]
            )
        # After capture: a new request in a new slot, its 2 pages per tensor mapped now, then the
        # same graph replayed over them (the rule: mapped before replay, by step()).
        late = cache.alloc()
        cache.step({late: W})
        for it, (batch, lens) in enumerate(
            [
                (slots, [4, 11]),
                (slots, [300, 12]),
                ([slots[0], late], [301, 0]),
                ([slots[0], late], [302, 1]),
            ]
        ):
            static["slots"].copy_(torch.tensor(batch, device=gpu))
            static["lens"].copy_(torch.tensor(lens, device=gpu))
            for key in ("q", "k", "v"):
                static[key].normal_()
            graph.replay()
            torch.cuda.synchronize()
            for i, (s, n) in enumerate(zip(batch, lens)):
                assert torch.equal(kc[s, n], static["k"][i]), (it, s, n)
                assert torch.equal(vc[s, n], static["v"][i]), (it, s, n)
            want = reference(static["q"], kc, vc, static["slots"], static["lens"])
            torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)


def test_compiled_decode_with_cuda_graphs_equals_eager(gpu, record_property):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with make_cache(gpu) as cache:
        kc, vc = cache.layer(0)
        for t in (kc, vc):  # static: mutated in place, never moved (see the module's docstring)
            torch._dynamo.mark_static_address(t)
        slots = [cache.alloc(), cache.alloc()]
        cache.step({s: W for s in slots})
        compiled = torch.compile(decode, fullgraph=True, dynamic=False, mode="reduce-overhead")
        lens = [3, 40]
        for it in range(8):
            if it == 4:
                new = cache.alloc()
                cache.step({new: W})
                slots = [slots[1], new]
                lens = [lens[1], 0]
            q = torch.randn(2, 32, 1, 128, device=gpu, dtype=torch.float16)
            k = torch.randn(2, 32, 128, device=gpu, dtype=torch.float16)
            v = torch.randn(2, 32, 128, device=gpu, dtype=torch.float16)
            s_t, l_t = torch.tensor(slots, device=gpu), torch.tensor(lens, device=gpu)
            out = compiled(q, k, v, kc, vc, s_t, l_t).clone()
            if it == 0:
                torch.compiler.set_stance("fail_on_recompile")
            torch.cuda.synchronize()
            torch.testing.assert_close(out, reference(q, kc, vc, s_t, l_t), rtol=2e-3, atol=2e-3)
            lens = [n + 1 for n in lens]
        torch.compiler.set_stance("default")
    inductor = counters["inductor"]
    record_property("cudagraph_skips", inductor["cudagraph_skips"])
    record_property("graphs_recorded_inputs", inductor["cudagraph_recorded_non_static_inputs"])
    assert inductor["cudagraph_skips"] == 0, "inductor ran the step without CUDA graphs"


def test_capture_while_the_prefetch_thread_maps(gpu, record_property):
    """A capture in GLOBAL mode (torch's default) while the prefetch thread creates and maps
    pages for every slot; then the graph replays over a slot mapped after it."""
    with make_cache(gpu) as cache:
        kc, vc = cache.layer(0)
        slots = [cache.alloc(), cache.alloc()]
        cache.step({s: W for s in slots})
        static = dict(
            q=torch.randn(2, 32, 1, 128, device=gpu, dtype=torch.float16),
            k=torch.randn(2, 32, 128, device=gpu, dtype=torch.float16),
            v=torch.randn(2, 32, 128, device=gpu, dtype=torch.float16),
            slots=torch.tensor(slots, device=gpu),
            lens=torch.tensor([3, 10], device=gpu),
        )

        def step():
            s = static
            return decode(s["q"], s["k"], s["v"], kc, vc, s["slots"], s["lens"])

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        # Work for the thread: every slot's whole row (32 pages a row and tensor, 512 in all,
        # each created and mapped): far longer than the capture below.
        rows = slots + [cache.alloc() for _ in range(6)]
        before = cache.stats()["prefetch_driver_calls"]
        cache.prefetch({s: cache.config.max_seq_len for s in rows}, lookahead_tokens=0)
        deadline = time.monotonic() + 5
        while cache.stats()["prefetch_driver_calls"] == before:  # the thread is at work
            assert time.monotonic() < deadline, "the prefetch thread made no driver call"
            time.sleep(0.001)
        at_start = cache.stats()["prefetch_driver_calls"]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # capture_error_mode="global"
            out = step()
            time.sleep(0.05)  # the capture stays open while the thread works
        during = cache.stats()["prefetch_driver_calls"] - at_start
        cache.wait()  # re-raises a driver error of the prefetch thread
        record_property("prefetch_calls_during_capture", during)
        assert during > 0, "the prefetch thread made no driver call during the capture"
        late = rows[-1]
        cache.step({s: W for s in rows})
        static["slots"].copy_(torch.tensor([slots[0], late], device=gpu))
        static["lens"].copy_(torch.tensor([4, 0], device=gpu))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kc[late, 0], static["k"][1])
        want = reference(static["q"], kc, vc, static["slots"], static["lens"])
        torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)
