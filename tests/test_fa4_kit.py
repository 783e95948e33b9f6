"""The GPU check's FlashAttention-4 measurements (benchmarks/gpu/fa4_measure.py and
bench_fa4_paged.py) on the CPU, against the torch stand-in of FA4 (support/fa4_stand_in.py):
the plumbing (caches with the tile rule, copies, paged pools, page tables, the comparisons and
the table), never a figure. What they measure is a GPU's to say (the flash-attn-4 part).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from support.fa4_stand_in import FA4StandIn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import bench_fa4_paged  # noqa: E402
import fa4_measure as m  # noqa: E402


@pytest.fixture
def fa4():
    return FA4StandIn().flash_attn_varlen_func


def test_fa4_over_the_cache_and_over_a_copy_agree_with_fp32_sdpa(fa4):
    cases = [
        ("layer", torch.bfloat16, 128, 4, "decode"),
        ("mega", torch.float16, 64, 1, "chunked prefill"),
    ]
    rows = list(m.accuracy(fa4, "cpu", cases, lens=[1, 130, 300]))
    assert [r["layout"] for r in rows] == ["layer", "mega"]
    for row in rows:
        assert "error" not in row, row
        assert row["equal"] and row["err_virtual"] == row["err_copy"] < 0.02, row


def test_nan_past_the_length_shows_only_without_the_tile_rule(fa4):
    with_rule = m.nan_past_the_length(fa4, "cpu", tile_rule=True)
    assert with_rule["finite"] and with_rule["equal"] and "error" not in with_rule
    without = m.nan_past_the_length(fa4, "cpu", tile_rule=False)
    assert without["finite"] is False and without["equal_to_copy"] is False
    assert "equal" not in without and "error" not in without  # shown, not failed


def test_a_mega_row_ending_before_a_page_boundary_maps_its_tile(fa4):
    row = m.mega_boundary(fa4, "cpu")
    assert row["tokens_per_page"] == 32 and row["length"] == 31
    assert row["mapped_tokens"] == 128 and row["finite"] and row["equal"], row


def test_time_over_the_cache_compares_equal_outputs(fa4):
    rows = list(
        m.time_virtual_vs_copy(
            fa4, "cpu", batch=2, context=256, rounds=2, phases=[("decode", 1), ("prefill", 16)]
        )
    )
    assert [r["phase"] for r in rows] == ["decode", "prefill"]
    assert all(r["equal"] and r["virtual_over_copy_median"] > 0 for r in rows), rows


def test_paged_pools_hold_the_rows_and_agree_with_the_virtual_cache(fa4):
    rows = list(
        m.paged_vs_virtual(
            fa4,
            "cpu",
            points=[(2, 200)],
            page_sizes=(16, 64),
            phases=[("decode", 1), ("prefill", 16)],
            rounds=2,
        )
    )
    assert [(r["page_size"], r["phase"]) for r in rows] == [
        (16, "decode"),
        (16, "prefill"),
        (64, "decode"),
        (64, "prefill"),
    ]
    assert all("error" not in r and r["max_abs_diff"] == 0.0 for r in rows), rows
    text = bench_fa4_paged.table(rows)
    assert text.count("\n") == 1 + len(rows) and "| llama3-8b | decode | 2 | 200 | 16 |" in text


def test_a_paged_pool_is_the_rows_in_shuffled_pages():
    k = torch.arange(2 * 40 * 1 * 8, dtype=torch.float32).view(2, 40, 1, 8)
    k_pool, v_pool, table = m.paged_pool(k, k.clone(), [40, 17], page_size=16)
    assert table.dtype == torch.int32 and tuple(table.shape) == (2, 3)
    used = table[0, :3].tolist() + table[1, :2].tolist()
    assert sorted(used) == list(range(5))  # every page once
    for row, n in ((0, 40), (1, 17)):
        pages = table[row, : -(-n // 16)].tolist()
        got = k_pool[pages].reshape(-1, 1, 8)[:n]
        assert torch.equal(got, k[row, :n])
    assert bool(k_pool[table[1, 1]][1:].eq(0).all())  # past row 1's 17 tokens: zeros


def test_the_plot_has_a_panel_per_shape_and_phase(tmp_path):
    rows = [
        dict(shape="s", phase=ph, batch=8, context=c, page_size=p, paged_over_virtual_median=1.0)
        for ph in ("decode", "prefill")
        for c in (1024, 4096)
        for p in (16, 64)
    ]
    out = tmp_path / "plot.png"
    bench_fa4_paged.plot(rows, out)
    assert out.stat().st_size > 1000


def test_the_bench_needs_a_gpu_and_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert bench_fa4_paged.main(["--quick"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
