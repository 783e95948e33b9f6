"""CpuAttentionPlan and CpuAttentionBatch (vattention/attention/plan.py): the CPU kernel prepared
once per layer and once per step gives what ``cpu_attention`` gives on the same arguments, bit for
bit (output and appended keys), on every variant of the kernel; takes its own entry only where it
covers the call (and says so: the generic call is patched to fail there); refuses what
``cpu_attention`` refuses, with the same errors, writing nothing; and holds its own copy of a
step's values."""

from __future__ import annotations

import pytest
import torch
from test_attention_kernel import FP8, make_caches

import vattention.attention.plan as plan_module
from vattention.attention import CpuAttentionBatch, CpuAttentionPlan, cpu_attention

CASES = [
    # dtype, cache dtype, group, kv_heads, d, window, mega
    (torch.float32, torch.float32, 1, 2, 64, (-1, -1), False),
    (torch.bfloat16, torch.bfloat16, 4, 4, 64, (-1, -1), False),
    (torch.bfloat16, torch.bfloat16, 8, 2, 128, (20, 0), True),
    (torch.float16, torch.float16, 2, 3, 80, (-1, -1), False),
    (torch.bfloat16, torch.float8_e4m3fn, 4, 2, 64, (-1, -1), False),
    (torch.float32, torch.float8_e5m2, 1, 1, 32, (7, 0), True),
]


def step_tensors(gen, lqs, heads, kv_heads, d, dtype, descale=(1.0, 1.0)):
    """A varlen step's q, new K and V as vLLM hands them: views of one fused qkv projection
    (token stride (heads + 2 kv_heads) d), not tensors of their own."""
    total = sum(lqs)
    qkv = torch.randn(total, (heads + 2 * kv_heads) * d, generator=gen)
    qkv[:, heads * d : (heads + kv_heads) * d] *= descale[0]
    qkv[:, (heads + kv_heads) * d :] *= descale[1]
    q, k, v = qkv.to(dtype).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return q.view(total, heads, d), k.view(total, kv_heads, d), v.view(total, kv_heads, d)


@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=lambda i: "{}-{}-g{}-kv{}-d{}".format(*CASES[i])
)
def test_layers_of_steps_match_cpu_attention_bit_for_bit(isa, threads, index, monkeypatch):
    """Two layers' plans over three steps sharing each step's batch (decodes, prefill chunks,
    prefix hints, rows in a shuffled order), against cpu_attention on copies of the caches: the
    same output and the same caches afterwards, bit for bit; the generic call never taken."""
    dtype, cache_dtype, group, kv_heads, d, window, mega = CASES[index]
    gen = torch.Generator().manual_seed(index)
    heads = kv_heads * group
    fp8 = cache_dtype in FP8
    descale = (0.75, 1.25) if fp8 else (1.0, 1.0)
    scales = dict(k_descale=descale[0], v_descale=descale[1]) if fp8 else {}
    layers = [
        make_caches(4, 300, kv_heads, d, cache_dtype, mega=mega, gen=gen, descale=descale)
        for _ in range(2)
    ]
    copies = [(kc.clone(), vc.clone()) for kc, vc in layers]
    plans = [
        CpuAttentionPlan(
            kc, vc, heads, dtype=dtype, causal=True, window_size=window, softmax_scale=0.3, **scales
        )
        for kc, vc in layers
    ]
    generic = plan_module.cpu_attention
    monkeypatch.setattr(plan_module, "cpu_attention", _refused)
    steps = [  # (query tokens, cached before, row) per request
        [(40, 0, 2), (1, 17, 0), (1, 90, 3)],
        [(1, 40, 2), (1, 18, 0), (33, 91, 3), (1, 5, 1)],
        [(1, 41, 2), (1, 19, 0)],
    ]
    for i, step in enumerate(steps):
        lqs = [lq for lq, _, _ in step]
        cu = torch.tensor([0, *torch.tensor(lqs).cumsum(0).tolist()], dtype=torch.int32)
        past = torch.tensor([p for _, p, _ in step], dtype=torch.int32)
        rows = torch.tensor([r for _, _, r in step], dtype=torch.int32)
        hint = {}
        if i == 1:  # rows 2 and 0 as one prefix group of 16 tokens (their first 16 made equal)
            for kc, vc in layers + copies:
                kc[0, :16], vc[0, :16] = kc[2, :16], vc[2, :16]
            hint = dict(
                prefix_groups=torch.tensor([0, 0, -1, -1], dtype=torch.int32),
                prefix_lens=torch.tensor([16, 16, 0, 0], dtype=torch.int32),
            )
        batch = CpuAttentionBatch(cu, past, rows, **hint)
        for (kc, vc), (kc2, vc2), plan in zip(layers, copies, plans):
            q, k, v = step_tensors(gen, lqs, heads, kv_heads, d, dtype, descale)
            out = torch.full((sum(lqs) + 2, heads * d), 7.0, dtype=dtype)
            got = plan(q, k, v, batch, out[: sum(lqs)].view(q.shape))
            want = generic(
                q,
                kc2,
                vc2,
                k,
                v,
                cache_seqlens=past,
                cache_batch_idx=rows,
                cu_seqlens_q=cu,
                causal=True,
                window_size=window,
                softmax_scale=0.3,
                **hint,
                **scales,
            )
            assert got.data_ptr() == out.data_ptr()
            assert torch.equal(got, want)
            assert torch.equal(out[sum(lqs) :], torch.full((2, heads * d), 7.0, dtype=dtype))
            for a, b in ((kc, kc2), (vc, vc2)):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _refused(*args, **kwargs):
    raise AssertionError("the plan took the generic call where its own entry covers the call")


def _layer(gen=None, heads=4, kv_heads=2, d=16, rows=3, seq=32, dtype=torch.float32):
    gen = gen or torch.Generator().manual_seed(3)
    kc, vc = make_caches(rows, seq, kv_heads, d, dtype, gen=gen)
    return kc, vc, CpuAttentionPlan(kc, vc, heads, causal=True)


def _step(gen=None, lqs=(3, 1), heads=4, kv_heads=2, d=16, dtype=torch.float32):
    gen = gen or torch.Generator().manual_seed(4)
    return step_tensors(gen, list(lqs), heads, kv_heads, d, dtype)


def test_calls_it_does_not_cover_take_the_generic_call_with_the_same_result():
    """No new keys, q of another layout (last dimension strided), more query rows than the batch
    covers, a tensor subclass, an empty batch: cpu_attention's own conversions and result."""
    kc, vc, plan = _layer()
    q, k, v = _step()
    batch = CpuAttentionBatch([0, 3, 4], [5, 9], [2, 0])
    args = dict(
        cache_seqlens=batch.cache_seqlens,
        cache_batch_idx=batch.cache_batch_idx,
        cu_seqlens_q=batch.cu_seqlens_q,
        causal=True,
    )
    strided = torch.zeros(4, 4, 32)[..., ::2]
    strided.copy_(q)
    longer = torch.cat([q, torch.randn(2, 4, 16)])
    for call_q, call_k, call_v in (
        (q, None, None),
        (strided, k, v),
        (torch.nn.Parameter(q.clone(), requires_grad=False), k, v),
    ):
        kc2, vc2 = kc.clone(), vc.clone()
        want = cpu_attention(call_q, kc2, vc2, call_k, call_v, **args)
        got = plan(call_q, call_k, call_v, batch)
        assert torch.equal(got, want) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    kc2, vc2 = kc.clone(), vc.clone()
    want = cpu_attention(longer, kc2, vc2, None, None, **args)
    assert torch.equal(plan(longer, None, None, batch)[:4], want[:4])  # rows past the batch: unset
    empty = CpuAttentionBatch([0], [], [])
    out = plan(q[:0], k[:0], v[:0], empty)
    assert out.shape == (0, 4, 16)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(past=[30, 9]), ValueError, "exceed the cache length 32"),
        (dict(rows=[2, 2]), ValueError, "cache_batch_idx repeats row 2"),
        (dict(rows=[3, 0]), ValueError, r"cache_batch_idx\[0\] = 3 is outside the cache's 3 rows"),
        (dict(q_dtype=torch.bfloat16), TypeError, "dtype must be q's"),
        (dict(k_heads=1), ValueError, r"k must be \[total_q, kv_heads, head_dim\]"),
        (dict(out=torch.empty(4, 4, 8)), ValueError, "out must be a CPU tensor of q's shape"),
        (dict(q_rows=3), ValueError, r"cu_seqlens_q\[-1\] = 4 exceeds"),
    ],
)
def test_bad_calls_raise_what_cpu_attention_raises_and_write_nothing(change, error, match):
    """Values the kernel refuses (lengths past the cache, repeated or missing rows: its own entry
    raises them) and tensors that do not fit (the generic call's errors): typed, named, and the
    caches untouched."""
    kc, vc, plan = _layer()
    q, k, v = _step()
    if "q_dtype" in change:
        q = q.to(change["q_dtype"])
    if "k_heads" in change:
        k = k[:, :1]
    if "q_rows" in change:
        q, k, v = q[:3], k[:3], v[:3]
    batch = CpuAttentionBatch([0, 3, 4], change.get("past", [5, 9]), change.get("rows", [2, 0]))
    before = kc.clone(), vc.clone()
    with pytest.raises(error, match=match):
        plan(q, k, v, batch, change.get("out"))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_bad_plans_and_batches_raise_typed_errors():
    kc, vc, _ = _layer()
    with pytest.raises(ValueError, match=r"q heads \(3\) must be a multiple"):
        CpuAttentionPlan(kc, vc, 3)
    with pytest.raises(ValueError, match="num_heads must be >= 1, got 0"):
        CpuAttentionPlan(kc, vc, 0)
    with pytest.raises(TypeError, match="num_heads must be an int"):
        CpuAttentionPlan(kc, vc, True)
    with pytest.raises(TypeError, match="dtype must be float32, bfloat16 or float16"):
        CpuAttentionPlan(kc, vc, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"dtype \(the queries'\) is required with an fp8 cache"):
        CpuAttentionPlan(kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), 4)
    with pytest.raises(ValueError, match="k_descale applies to fp8 caches only"):
        CpuAttentionPlan(kc, vc, 4, k_descale=2.0)
    with pytest.raises(ValueError, match="window_size entries must be >= -1"):
        CpuAttentionPlan(kc, vc, 4, window_size=(-2, 0))
    with pytest.raises(ValueError, match="k_cache must be"):
        CpuAttentionPlan(kc[0], vc[0], 4)
    with pytest.raises(TypeError, match="v_cache must be a torch.Tensor"):
        CpuAttentionPlan(kc, None, 4)
    with pytest.raises(ValueError, match="k_cache must have a contiguous last dimension"):
        strided = torch.zeros(3, 32, 2, 32)[..., ::2]
        CpuAttentionPlan(strided, strided.clone(), 4)
    with pytest.raises(ValueError, match="cu_seqlens_q must hold n"):
        CpuAttentionBatch(torch.zeros(0, dtype=torch.int32), [])
    with pytest.raises(ValueError, match="cache_seqlens must be 1-D with 2 entries"):
        CpuAttentionBatch([0, 1, 2], [1])
    with pytest.raises(TypeError, match="cache_batch_idx must hold integers"):
        CpuAttentionBatch([0, 1, 2], [1, 1], torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="prefix_groups and prefix_lens must be given together"):
        CpuAttentionBatch([0, 1, 2], [1, 1], prefix_groups=[0, 0])
    with pytest.raises(TypeError, match="batch must be a CpuAttentionBatch"):
        _layer()[2](*_step(), batch=dict(cu_seqlens_q=[0, 3, 4]))


def test_a_batch_holds_its_own_copy_of_the_values():
    """The step's tensors changed (or freed) after the batch was built change nothing: the batch
    read them once, as the kernel's per-call checks then read its own copy."""
    kc, vc, plan = _layer()
    q, k, v = _step()
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    past = torch.tensor([5, 9], dtype=torch.int32)
    rows = torch.tensor([2, 0], dtype=torch.int32)
    batch = CpuAttentionBatch(cu, past, rows)
    kc2, vc2 = kc.clone(), vc.clone()
    want = cpu_attention(
        q,
        kc2,
        vc2,
        k,
        v,
        cache_seqlens=past.clone(),
        cache_batch_idx=rows.clone(),
        cu_seqlens_q=cu.clone(),
        causal=True,
    )
    past.fill_(30)  # past the cache: the batch would be refused if it read these
    rows.fill_(1)
    cu.zero_()
    del past, rows, cu
    assert torch.equal(plan(q, k, v, batch), want)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    one = CpuAttentionBatch([0, 3, 4], 5)  # one length for every request
    assert one.cache_seqlens.tolist() == [5, 5] and one.cache_batch_idx is None
