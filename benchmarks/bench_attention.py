"""CPU torch SDPA over the virtual cache vs over ordinary tensors of the same shape and strides.

The ordinary tensors are allocated with torch.empty_strided using exactly the cache tensors' shape
and strides, so the only difference is where the memory comes from (mapped on demand from memfd
pages vs the torch allocator). Target: ratio 1.00 +- 0.03. A third column shows a packed
[B, H, S, D] copy for reference: that difference is layout, not virtual memory.

    python benchmarks/bench_attention.py
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import vattention  # noqa: E402

from _timing import compare  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s), float32, 8 KV heads x 128\n")
    print("| layout | page | pattern | virtual ms | same-strides ms | ratio | packed BHSD ms |")
    print("|---|---|---|---:|---:|---:|---:|")
    for layout in ("layer", "mega"):
        for page in ("64KB", "2MB"):
            cfg = vattention.KVCacheConfig(num_layers=2, num_kv_heads=8, head_dim=128,
                                           max_batch_size=8, max_seq_len=4096,
                                           dtype=torch.float32, page_size=page, layout=layout)
            with vattention.KVCache(cfg) as cache:
                lens = {cache.alloc(): n for n in (4096, 3000, 2048, 1500, 1024, 777, 512, 300)}
                cache.step(lens)
                k, v = cache.layer(1)
                k_ref = torch.empty_strided(k.shape, k.stride(), dtype=k.dtype)
                v_ref = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)
                for slot, n in lens.items():
                    k[slot, :n] = torch.randn(n, 8, 128)
                    v[slot, :n] = torch.randn(n, 8, 128)
                    k_ref[slot, :n] = k[slot, :n]
                    v_ref[slot, :n] = v[slot, :n]
                packed = {s: (k[s, :n].transpose(0, 1).contiguous().unsqueeze(0),
                              v[s, :n].transpose(0, 1).contiguous().unsqueeze(0))
                          for s, n in lens.items()}
                q1 = torch.randn(1, 8, 1, 128)
                qp = torch.randn(1, 8, 1024, 128)

                def view(t, s, n):
                    return t[s, :n].transpose(0, 1).unsqueeze(0)

                def decode(kc, vc):
                    return [F.scaled_dot_product_attention(q1, view(kc, s, n), view(vc, s, n))
                            for s, n in lens.items()]

                def decode_packed():
                    return [F.scaled_dot_product_attention(q1, *packed[s]) for s in lens]

                slot0 = next(iter(lens))

                def prefill(kc, vc):
                    return F.scaled_dot_product_attention(qp, view(kc, slot0, 1024),
                                                          view(vc, slot0, 1024), is_causal=True)

                def prefill_packed():
                    kp, vp = packed[slot0]
                    return F.scaled_dot_product_attention(qp, kp[:, :, :1024], vp[:, :, :1024],
                                                          is_causal=True)

                assert all(torch.equal(a, b) for a, b in zip(decode(k, v), decode(k_ref, v_ref)))
                assert torch.equal(prefill(k, v), prefill(k_ref, v_ref))
                for pattern, fv, fr, fp in (
                        ("decode 8 slots", lambda: decode(k, v), lambda: decode(k_ref, v_ref),
                         decode_packed),
                        ("prefill 1024", lambda: prefill(k, v), lambda: prefill(k_ref, v_ref),
                         prefill_packed)):
                    t = compare({"virtual": fv, "ref": fr, "packed": fp}, calls=args.calls)
                    print(f"| {layout} | {page} | {pattern} | {t['virtual'] * 1e3:.2f} | "
                          f"{t['ref'] * 1e3:.2f} | {t['virtual'] / t['ref']:.3f} | "
                          f"{t['packed'] * 1e3:.2f} |")


if __name__ == "__main__":
    main()
