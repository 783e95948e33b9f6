"""FlashAttention-4 over the virtual cache (GPU only; skipped without flash-attn-4).

FA4's ``flash_attn_varlen_func`` with ``seqused_k`` over a cache's layer tensors, through
vattention's integration (its checks) and through FA4 directly, against fp32 SDPA per row: as
close as FA4 over a contiguous copy of the same K/V (bit-equal), for decode, prefill and chunked
prefill, GQA 1-8, head_dim 64 and 128, bf16 and fp16, layer and mega layouts; no NaN from past a
row's length; no fault at a mega page boundary. FA4 comes from the interpreter or from the GPU
check's wheel folder (GPU_CHECK_FA4_SITE). The measurements are benchmarks/gpu/fa4_measure.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))

LENS = [1, 127, 128, 300, 2049, 4096]  # tile edges, page edges (1024 tokens a 2 MB page here)


@pytest.fixture(scope="module")
def fa4():
    import fa4_measure

    fn, why = fa4_measure.load_fa4()
    if fn is None:
        pytest.skip(f"flash-attn-4 not installed ({why})")
    return fn


@pytest.mark.parametrize("layout", ["layer", "mega"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("phase", ["decode", "prefill", "chunked prefill"])
def test_fa4_over_the_cache_is_as_close_to_fp32_sdpa_as_over_a_copy(
    gpu, fa4, layout, dtype, head_dim, gqa, phase
):
    import fa4_measure
    import torch

    case = (layout, getattr(torch, dtype), head_dim, gqa, phase)
    (row,) = list(fa4_measure.accuracy(fa4, gpu, [case], LENS))
    assert "error" not in row, row
    assert row["err_virtual"] <= row["err_copy"], row
    assert row["equal"], row


def test_nan_past_the_length_never_reaches_the_output(gpu, fa4):
    import fa4_measure

    row = fa4_measure.nan_past_the_length(fa4, gpu, tile_rule=True)
    assert row["finite"] and row["equal"], row


def test_a_mega_row_ending_before_a_page_boundary_reads_mapped_pages(gpu, fa4):
    import fa4_measure

    row = fa4_measure.mega_boundary(fa4, gpu)
    assert row["mapped_tokens"] >= 128 and row["finite"] and row["equal"], row


@pytest.mark.parametrize("layout", ["layer", "mega"])
def test_attend_slots_through_the_integration_equals_fa4_over_a_copy(gpu, fa4, layout):
    import fa4_measure
    import torch

    from vattention.integrations import flash_attn4

    lens = [300, 5, 2049]
    cache, k, v = fa4_measure.filled_cache(gpu, layout, torch.bfloat16, lens, 8, 128)
    with cache:
        q = torch.randn(3, 32, 128, device=gpu, dtype=torch.bfloat16)
        slots = [2, 0, 1]  # requests in another order than their rows
        out = flash_attn4.attend_slots(
            q, k, v, seq_lens=[lens[s] for s in slots], slots=slots, kernel=fa4
        )
        # the same requests over a contiguous copy, FA4 called directly, rows in slot order
        kc, vc = fa4_measure.copy_rows(k, lens), fa4_measure.copy_rows(v, lens)
        order = [1, 2, 0]  # the query of slot s
        want, _ = fa4(
            q[order],
            kc,
            vc,
            cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=gpu),
            seqused_k=torch.tensor(lens, dtype=torch.int32, device=gpu),
            causal=True,
        )
        assert torch.equal(out, want[[2, 0, 1]])
