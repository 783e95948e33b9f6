"""The plugin's CUDA path (vattention/integrations/vllm/flash.py) on the CPU, without vLLM.

No GPU and no CUDA build of vLLM exist here. What runs: the plugin's own code over a real
vattention ``KVCache`` on the host backend (the blocked views, the step's block tables and cache
slots, the K/V write and the one varlen call), with a torch stand-in for vLLM's
``flash_attn_varlen_func`` and ``reshape_and_cache_flash`` (tests/support/flash_stand_in.py),
checked against :func:`vattention.attention.reference_attention` over the same rows. Also the
kernel's selection (vllm.vllm_flash_attn, else flash-attn, else a refusal), with stand-in modules.
The plugin's classes around it (the FLASH_ATTN impl and metadata builder) run in the vLLM venv:
tests/support/vllm_flash_glue_check.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import subprocess
import sys
import types
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from vattention import BackendUnavailableError, KVCache, KVCacheConfig
from vattention.attention import reference_attention
from vattention.integrations.vllm import flash

from support.flash_stand_in import FP8, StandIn
from support.rounding import fp32_attention_bound, rounded_output_excess
from support.vllm_harness import MISSING, ROOT, VLLM_PYTHON
from support.vllm_steps import grow

LAYERS, KV_HEADS, HEADS, DIM, SLOTS, MAX_SEQ = 3, 2, 4, 32, 4, 192
LAYER = 1  # a middle layer: in the mega layout its view starts inside the token row
SCALE = DIM**-0.5


def make_cache(layout: str, dtype: torch.dtype, window: Optional[int], tokens_per_page: int):
    """A cache like the plugin's: one page per vLLM block of ``tokens_per_page`` tokens."""
    unit = KV_HEADS * DIM * torch.empty(0, dtype=dtype).element_size()
    unit *= LAYERS if layout == "mega" else 1
    return KVCache(
        KVCacheConfig(
            num_layers=LAYERS,
            num_kv_heads=KV_HEADS,
            head_dim=DIM,
            max_batch_size=SLOTS,
            max_seq_len=MAX_SEQ,
            dtype=dtype,
            device="cpu",
            page_size=tokens_per_page * unit,
            layout=layout,
            sliding_window=window,
        )
    )


def flash_kernel(stand_in: StandIn, fa_version: int) -> flash.CudaKernel:
    return flash.CudaKernel(
        "vllm.vllm_flash_attn",
        fa_version=fa_version,
        varlen=stand_in.flash_attn_varlen_func,
        write_kv=stand_in.reshape_and_cache_flash,
    )


# (slot index, new tokens) per step: prefill chunks, a chunk continuing past a window, decodes,
# rows in any slot order, a request arriving later
STEPS: List[List[Tuple[int, int]]] = [
    [(2, 40), (0, 70)],
    [(0, 1), (2, 50), (3, 5)],
    [(0, 1), (2, 1), (3, 1), (1, 33)],
    [(0, 1), (3, 1), (1, 1), (2, 59)],
    [(2, 1), (0, 1), (1, 1), (3, 1)],
]


def run_steps(
    layout: str,
    cache_dtype: str,
    window: Optional[int],
    *,
    tokens_per_page: int,
    block_size: int,
    fa_version: int,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Dict[str, list]:
    """Every step through :func:`flash.paged_attention`; checks each step's output and writes
    against the reference over the same rows, and that the kernel read only mapped blocks."""
    torch.manual_seed(0)
    dtype = FP8[cache_dtype] if cache_dtype != "auto" else torch.bfloat16
    seen: Dict[str, list] = {"tables": [], "holes": []}
    with make_cache(layout, dtype, window, tokens_per_page) as cache:
        slots = [cache.alloc() for _ in range(SLOTS)]
        k_cache, v_cache = cache.layer(LAYER)
        blocks = flash.blocked_cache(k_cache, v_cache, block_size)

        def readable(block: int) -> None:  # a tile load: the whole block must be mapped
            slot, j = divmod(block, blocks.blocks_per_row)
            lo, hi = j * block_size, (j + 1) * block_size
            start = cache.window_start(slot, LAYER)
            assert start <= lo and hi <= cache.mapped_tokens(slot), (slot, lo, hi, start)

        stand_in = StandIn(on_block_read=readable)
        kernel = flash_kernel(stand_in, fa_version)
        scales = flash.QKVScales(*(torch.tensor(x) for x in (q_scale, k_scale, v_scale)))
        window_size = (-1, -1) if window is None else (window - 1, 0)
        for rows, past, new in grow(cache, slots, STEPS):
            starts = [0] + torch.tensor(new).cumsum(0).tolist()
            ints = dict(dtype=torch.int32)
            batch = flash.FlashBatch.build(
                cu_seqlens_q=torch.tensor(starts, **ints),
                slots=torch.tensor(rows, **ints),
                past=torch.tensor(past, **ints),
                query_lens=new,
                past_lens=past,
                block_size=block_size,
            )
            total = starts[-1]
            q = torch.randn(total, HEADS, DIM, dtype=torch.bfloat16)
            k = torch.randn(total, KV_HEADS, DIM, dtype=torch.bfloat16)
            v = torch.randn(total, KV_HEADS, DIM, dtype=torch.bfloat16)
            if cache_dtype != "auto":  # vLLM's layer quantizes the queries for FA3 (per tensor)
                q = (q.float() / q_scale).to(torch.float8_e4m3fn)
            out = torch.full((total, HEADS, DIM), float("nan"), dtype=torch.bfloat16)
            flash.paged_attention(
                kernel,
                q,
                k,
                v,
                blocks,
                batch,
                out,
                softmax_scale=SCALE,
                window_size=window_size,
                kv_cache_dtype=cache_dtype,
                scales=scales,
            )
            # the new K/V are in the rows (as vLLM's op stores them)
            for row, (s, p, n) in enumerate(zip(rows, past, new)):
                a, b = starts[row], starts[row + 1]
                for written, src, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
                    got = written[s, p : p + n]
                    if cache_dtype == "auto":
                        assert torch.equal(got, src[a:b])
                    else:
                        top = torch.finfo(dtype).max
                        want = (src[a:b].float() / scale).clamp(-top, top).to(dtype)
                        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            q_ref = q.float() * q_scale if cache_dtype != "auto" else q.float()
            ref = reference_attention(
                q_ref,
                k_cache,
                v_cache,
                cache_seqlens=torch.tensor([p + n for p, n in zip(past, new)]),
                cache_batch_idx=torch.tensor(rows),
                cu_seqlens_q=torch.tensor(starts),
                softmax_scale=SCALE,
                causal=True,
                window_size=window_size,
                k_descale=k_scale if cache_dtype != "auto" else None,
                v_descale=v_scale if cache_dtype != "auto" else None,
            )
            # the stand-in's fp32 output rounded once to bf16, against the fp32 reference:
            # within bf16's rounding plus the two fp32 evaluations' (derived, not fitted)
            # (the rows' keys read from their window start on: the heads are unmapped)
            spans = [(s, cache.window_start(s, LAYER), p + n) for s, p, n in zip(rows, past, new)]
            ks = torch.cat([k_cache[s, a:b].float() for s, a, b in spans])
            vs = torch.cat([v_cache[s, a:b].float() for s, a, b in spans])
            descale = (k_scale, v_scale) if cache_dtype != "auto" else (1.0, 1.0)
            keys = max(b - a for _, a, b in spans)
            fp32 = fp32_attention_bound(q_ref, ks * descale[0], vs * descale[1], keys, SCALE)
            excess = rounded_output_excess(out, ref, torch.bfloat16, fp32)
            assert excess <= 0, f"beyond bf16's rounding by {excess:.3g}"
            call = stand_in.calls[-1]
            assert call["fa_version"] == fa_version
            assert call["descales"] == (cache_dtype != "auto")
            assert call["max_seqlen_q"] == max(new)
            seen["tables"].append(call["block_table"].tolist())
            if window is not None:  # without the redirect, the table would name released pages
                plain = batch.block_table(blocks, -1).tolist()
                for i, s in enumerate(rows):
                    start = cache.window_start(s, LAYER)
                    used = plain[i][: math.ceil((past[i] + new[i]) / block_size)]
                    seen["holes"] += [
                        b for b in used if (b % blocks.blocks_per_row) * block_size < start
                    ]
    return seen


@pytest.mark.parametrize("layout", ["layer", "mega"])
@pytest.mark.parametrize("window", [None, 24])
def test_one_varlen_call_over_the_blocked_rows_matches_the_reference(layout, window):
    seen = run_steps(layout, "auto", window, tokens_per_page=32, block_size=32, fa_version=2)
    # one table row per request, blocks of its own slot's row (slot * blocks_per_row + j)
    assert [len(t) for t in seen["tables"]] == [len(step) for step in STEPS]
    if window is not None:  # the window released pages that the kernel was steered off
        assert seen["holes"]


def test_blocks_smaller_than_a_page_and_fa3():
    run_steps("layer", "auto", 24, tokens_per_page=32, block_size=16, fa_version=3)


@pytest.mark.parametrize("layout", ["layer", "mega"])
def test_fp8_cache_is_written_scaled_and_read_with_descales(layout):
    run_steps(
        layout,
        "fp8_e4m3",
        24,
        tokens_per_page=64,
        block_size=64,
        fa_version=3,
        q_scale=0.5,
        k_scale=0.25,
        v_scale=2.0,
    )


def test_block_table_and_slots_of_a_small_batch():
    # slot 3 decodes at 40 (window 16: keys from 40 - 15), slot 1 prefills 20 tokens from 5
    batch = flash.FlashBatch.build(
        cu_seqlens_q=torch.tensor([0, 1, 21], dtype=torch.int32),
        slots=torch.tensor([3, 1], dtype=torch.int32),
        past=torch.tensor([40, 5], dtype=torch.int32),
        query_lens=[1, 20],
        past_lens=[40, 5],
        block_size=16,
    )
    cache = flash.BlockedCache(
        k=torch.empty(0), v=torch.empty(0), block_size=16, blocks_per_row=4, dense_k=torch.empty(0)
    )
    assert batch.seqused_k.tolist() == [41, 25] and batch.max_seqlen_k == 41
    assert batch.token_slots.tolist() == [3] + [1] * 20
    assert batch.token_positions.tolist() == [40] + list(range(5, 25))
    assert batch.slot_mapping(cache).tolist() == [3 * 64 + 40] + [64 + p for p in range(5, 25)]
    assert batch.block_table(cache, -1).tolist() == [[12, 13, 14], [4, 5, 6]]
    # first key read: 40 - 15 = 25 for slot 3 (block 0 wholly before it: its last block instead);
    # slot 1's first query at 5 reads from 0
    assert batch.block_table(cache, 15).tolist() == [[14, 13, 14], [4, 5, 6]]
    assert batch.block_table(cache, 15).dtype == torch.int32


@pytest.mark.parametrize("layout", ["layer", "mega"])
def test_blocked_view_is_the_cache_memory_with_its_strides(layout):
    with make_cache(layout, torch.bfloat16, None, 32) as cache:
        k, v = cache.layer(LAYER)
        view = flash.blocked_cache(k, v, 16)
        assert view.k.data_ptr() == k.data_ptr() and view.v.data_ptr() == v.data_ptr()
        assert view.blocks_per_row * 16 * k.stride(1) == k.stride(0)
        assert view.k.shape == (SLOTS * MAX_SEQ // 16, 16, KV_HEADS, DIM)
        assert view.k.stride()[1:] == k.stride()[1:]
        slot = cache.alloc()
        cache.step({slot: MAX_SEQ})
        k[slot].copy_(torch.randn(MAX_SEQ, KV_HEADS, DIM))
        j = 5
        block = view.k[slot * view.blocks_per_row + j]
        assert torch.equal(block, k[slot, j * 16 : (j + 1) * 16])


def test_blocked_view_refuses_rows_that_are_not_whole_blocks():
    unit = KV_HEADS * DIM * 2
    cfg = dict(num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, max_batch_size=2, device="cpu")
    with KVCache(
        KVCacheConfig(**cfg, max_seq_len=100, dtype=torch.bfloat16, page_size=32 * unit)
    ) as c:
        k, v = c.layer(0)
        with pytest.raises(ValueError, match="rows of 100 tokens"):
            flash.blocked_cache(k, v, 32)
        with pytest.raises(ValueError, match="multiple of 16"):
            flash.blocked_cache(k, v, 20)


def test_layer_blocks_are_made_once_per_cache():
    with make_cache("layer", torch.bfloat16, None, 32) as cache:
        layer = types.SimpleNamespace(vattention_kv=cache.layer(0))
        first = flash.layer_blocks(layer, 32)
        assert flash.layer_blocks(layer, 32) is first
        layer.vattention_kv = cache.layer(1)  # a rebuilt cache: new views
        assert flash.layer_blocks(layer, 32).dense_k is cache.layer(1)[0]


# ---- choosing the kernel -------------------------------------------------------------------------
@pytest.fixture
def fresh(monkeypatch):
    """No vLLM, no flash-attn, no choice made: each test installs the modules it wants."""
    flash.reset_selection()
    for name in ("vllm", "vllm.vllm_flash_attn", "vllm._custom_ops", "flash_attn"):
        monkeypatch.setitem(sys.modules, name, None)
    yield monkeypatch
    flash.reset_selection()


def install_vllm_flash_attn(monkeypatch, supported=(2, 3)) -> StandIn:
    stand_in = StandIn()
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []  # a package with nothing else: fa_utils does not import
    vfa = types.ModuleType("vllm.vllm_flash_attn")
    vfa.flash_attn_varlen_func = stand_in.flash_attn_varlen_func
    vfa.is_fa_version_supported = lambda version: version in supported
    ops = types.ModuleType("vllm._custom_ops")
    ops.reshape_and_cache_flash = stand_in.reshape_and_cache_flash
    for module in (vllm, vfa, ops):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return stand_in


def install_flash_attn(monkeypatch, varlen: bool) -> None:
    module = types.ModuleType("flash_attn")
    if varlen:

        def flash_attn_with_kvcache(q, k_cache, v_cache, cu_seqlens_q=None):  # FA3's
            raise AssertionError("not called here")
    else:

        def flash_attn_with_kvcache(q, k_cache, v_cache):  # type: ignore[misc]
            raise AssertionError("not called here")

    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", module)


def test_vllm_flash_attn_is_chosen_when_it_imports_and_logged_once(fresh, caplog):
    stand_in = install_vllm_flash_attn(fresh)
    install_flash_attn(fresh, varlen=True)  # present too: vLLM's own build wins
    caplog.set_level(logging.INFO, logger="vllm.vattention")
    kernel = flash.select_cuda_kernel()
    assert flash.select_cuda_kernel() is kernel is flash.selected_kernel()
    assert kernel.paged and kernel.package == "vllm.vllm_flash_attn" and kernel.fa_version == 3
    assert kernel.varlen == stand_in.flash_attn_varlen_func
    assert kernel.write_kv == stand_in.reshape_and_cache_flash
    assert kernel.label == "vllm.vllm_flash_attn (FA3)"
    lines = [r.getMessage() for r in caplog.records if "CUDA attention" in r.getMessage()]
    assert lines == [
        "vattention: CUDA attention through vllm.vllm_flash_attn.flash_attn_varlen_func "
        "(FlashAttention 3), one call per layer over the dense rows seen as blocks"
    ]


def test_fa2_where_fa3_does_not_run(fresh):
    install_vllm_flash_attn(fresh, supported=(2,))
    assert flash.select_cuda_kernel().fa_version == 2


@pytest.mark.parametrize("varlen", [True, False])
def test_flash_attn_is_the_fallback(fresh, caplog, varlen):
    install_flash_attn(fresh, varlen)
    caplog.set_level(logging.INFO, logger="vllm.vattention")
    kernel = flash.select_cuda_kernel()
    assert not kernel.paged and kernel.package == "flash_attn" and kernel.kvcache_varlen == varlen
    assert "flash-attn is the fallback" in caplog.text
    assert "flash_attn.flash_attn_with_kvcache" in caplog.text
    kernel.check_layer(512, "fp8_e5m2")  # today's behaviour: flash-attn's own errors
    assert not kernel.quantizes_query("fp8")


def test_vllm_flash_attn_without_a_usable_version_falls_back(fresh):
    install_vllm_flash_attn(fresh, supported=())
    install_flash_attn(fresh, varlen=False)
    assert flash.select_cuda_kernel().package == "flash_attn"


def test_neither_is_refused_naming_both(fresh):
    with pytest.raises(BackendUnavailableError) as refused:
        flash.select_cuda_kernel()
    message = str(refused.value)
    assert "vllm.vllm_flash_attn" in message and "flash-attn" in message
    assert "unset VATTENTION_VLLM" in message
    assert flash.selected_kernel() is None


def test_layers_vllms_flash_attention_cannot_run_are_refused():
    fa3 = flash.CudaKernel("vllm.vllm_flash_attn", fa_version=3, varlen=print, write_kv=print)
    fa2 = dataclasses.replace(fa3, fa_version=2)
    fa3.check_layer(128, "auto")
    fa3.check_layer(256, "fp8")
    assert fa3.quantizes_query("fp8") and fa3.quantizes_query("fp8_e4m3")
    assert not fa3.quantizes_query("auto")
    with pytest.raises(NotImplementedError, match="head sizes that are multiples of 8 up to 256"):
        fa3.check_layer(320, "auto")
    with pytest.raises(NotImplementedError, match="--kv-cache-dtype auto"):
        fa2.check_layer(128, "fp8")
    with pytest.raises(NotImplementedError, match="'fp8_e5m2'"):
        fa3.check_layer(128, "fp8_e5m2")


# ---- the plugin's classes around it, in the vLLM venv -------------------------------------------
def test_flash_impl_and_builder_drive_the_paged_call_in_vllm():
    assert VLLM_PYTHON.exists(), MISSING
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "tests" / "support" / "vllm_flash_glue_check.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kernel"] == "vllm.vllm_flash_attn (FA3)"
    assert result["quantize_query"] == {"auto": False, "fp8": True}
    assert result["max_excess_over_rounding"] <= 0  # within bf16's rounding (support/rounding.py)
    assert result["stats_kernel"] == "vllm.vllm_flash_attn (FA3)"
    assert result["calls"] == 2 and result["selection_lines"] == 1
