"""A decode step over vattention caches under torch.compile(fullgraph=True), checked against eager.

Run by tests/test_compile.py in a subprocess (by path, with the repository on PYTHONPATH), so that a
compiled graph reading unmapped cache memory (SIGSEGV on the host backend) fails that test instead
of killing pytest. Each cache has max_seq_len 4096 but only the first W tokens of each slot mapped:
a compiled graph that copied or read a whole cache tensor would fault.

For each layout: two caches with the same inputs, one driven eagerly, one through the compiled
function; 12 decode steps with lengths growing and, half-way, a slot freed and another allocated.
Compiled once (fullgraph: no graph break), then torch.compiler.set_stance("fail_on_recompile"):
no recompilation. Outputs and cache contents must equal eager's.
"""

from __future__ import annotations

import pathlib
import sys

import torch
import torch.nn.functional as F

import vattention
from vattention.ops import append_kv

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: support.*

from support.rounding import fp32_attention_bound  # noqa: E402

W = 64  # the window every slot has mapped; the compiled step reads [0, W) of its slots


def decode(q, k, v, k_cache, v_cache, slots, lens):
    """Append this step's k/v at position lens[i] of slot slots[i], then attend over [0, lens]."""
    append_kv(k_cache, v_cache, k, v, slots, lens)
    kw = k_cache[slots, :W].transpose(1, 2)  # [B, H, W, D]
    vw = v_cache[slots, :W].transpose(1, 2)
    mask = (torch.arange(W) <= lens[:, None])[:, None, None, :]  # [B, 1, 1, W]
    return F.scaled_dot_product_attention(q, kw, vw, attn_mask=mask)


def run(layout: str) -> None:
    cfg = vattention.KVCacheConfig(
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        max_batch_size=4,
        max_seq_len=4096,
        dtype=torch.float32,
        page_size="64KB",
        layout=layout,
    )
    compiled = torch.compile(decode, fullgraph=True, dynamic=False)
    torch.manual_seed(0)
    with vattention.KVCache(cfg) as eager_cache, vattention.KVCache(cfg) as comp_cache:
        caches = (eager_cache, comp_cache)
        slots = [[c.alloc(), c.alloc()] for c in caches]
        for c, s in zip(caches, slots):
            c.step({x: W for x in s})
        lens = [3, 17]
        for it in range(12):
            if it == 6:  # a request ends, another starts in a different slot
                for c, s in zip(caches, slots):
                    new = c.alloc()
                    c.step({x: W for x in s + [new]})
                    c.free(s[0])
                    s[:] = [s[1], new]
                lens = [lens[1], 0]
            q = torch.randn(2, 2, 1, 64)
            k, v = torch.randn(2, 2, 64), torch.randn(2, 2, 64)
            outs = []
            for fn, c, s in ((decode, eager_cache, slots[0]), (compiled, comp_cache, slots[1])):
                c.step({x: W for x in s})  # maps nothing new: [0, W) is mapped
                for layer in range(cfg.num_layers):
                    kc, vc = c.layer(layer)
                    outs.append(fn(q, k, v, kc, vc, torch.tensor(s), torch.tensor(lens)))
                if fn is compiled and it == 0:
                    torch.compiler.set_stance("fail_on_recompile")
            # Inductor's kernels sum in other orders than eager's (their vector widths follow
            # the CPU's ISA): equal within fp32's rounding over W keys, derived, not fitted.
            rows = torch.tensor(slots[0])
            k_all = torch.stack([eager_cache.layer(i)[0][rows, :W] for i in range(cfg.num_layers)])
            v_all = torch.stack([eager_cache.layer(i)[1][rows, :W] for i in range(cfg.num_layers)])
            bound = fp32_attention_bound(q, k_all, v_all, W, q.shape[-1] ** -0.5)
            half = len(outs) // 2
            for e, o in zip(outs[:half], outs[half:]):
                assert (o - e).abs().max().item() <= bound, ((o - e).abs().max().item(), bound)
            lens = [n + 1 for n in lens]
        for layer in range(cfg.num_layers):
            for t in range(2):
                e_t, c_t = eager_cache.layer(layer)[t], comp_cache.layer(layer)[t]
                for se, sc, n in zip(slots[0], slots[1], lens):
                    assert torch.equal(e_t[se, :n], c_t[sc, :n]), (layout, layer, t)
    torch.compiler.set_stance("default")
    torch._dynamo.reset()
    print(f"{layout}: compiled decode equals eager; no graph break, no recompilation")


if __name__ == "__main__":
    for name in sys.argv[1:] or ["layer", "mega"]:
        run(name)
