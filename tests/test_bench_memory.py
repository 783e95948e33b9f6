"""Invariants of the memory benchmark: small seeded workloads, fast runs.

The vattention rows run against the real host-backend cache when the core is built, and
always against ``FakeKVCache`` (a pure-Python double with the same page arithmetic).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from vattention.bench import cli
from vattention.bench.allocators import (
    ALL_ALLOCATORS,
    BASELINES,
    VATTENTION_VARIANTS,
    BlockAllocator,
    StaticAllocator,
    make_allocator,
)
from vattention.bench.memory import run_memory_benchmark, simulate
from vattention.bench.workload import (
    MODELS,
    ModelShape,
    Workload,
    default_max_seq_len,
    load_workload,
)

from support.fake_kvcache import FakeKVCache

SMALL = ModelShape("small", num_layers=4, num_kv_heads=2, head_dim=64)  # 2 KB per token
MiB = 1 << 20


def _real_core_available() -> bool:
    try:
        import vattention

        return hasattr(vattention, "KVCache")
    except Exception:
        return False


FACTORIES = ["fake"] + (["real"] if _real_core_available() else [])


def _factory(kind):
    return FakeKVCache if kind == "fake" else None


def _workload(n=40, seed=0, max_prefill=3000, max_decode=600) -> Workload:
    rng = np.random.default_rng(seed)
    prefill = rng.integers(1, max_prefill, size=n)
    decode = rng.integers(0, max_decode, size=n)
    return Workload("synthetic", prefill, decode, False, n)


def _run(workload, allocators, factory="fake", budget=32 * MiB, max_batch_size=64, **kw):
    return run_memory_benchmark(
        workload,
        SMALL,
        budget_bytes=budget,
        max_seq_len=default_max_seq_len(workload),
        max_batch_size=max_batch_size,
        allocators=allocators,
        cache_factory=_factory(factory),
        check=True,
        progress=False,
        **kw,
    )


@pytest.mark.parametrize("factory", FACTORIES)
def test_every_request_finishes_and_token_accounting_matches_trace(factory):
    workload = _workload()
    report = _run(workload, ALL_ALLOCATORS, factory)
    for name, result in report.results.items():
        assert result.finished == workload.num_requests, name
        assert result.prefill_tokens == int(workload.prefill_tokens.sum()), name
        assert result.decode_tokens == int(workload.decode_tokens.sum()), name
        # Each step every running request holds its tokens; a request is resident for
        # decode + 1 steps per admission, so steps are at least the longest output.
        assert result.steps >= int(workload.decode_tokens.max()) + 1, name


@pytest.mark.parametrize("factory", FACTORIES)
def test_static_max_never_beats_oracle_and_oracle_never_beats_ideal(factory):
    report = _run(_workload(seed=1), ALL_ALLOCATORS, factory)
    m = report.metrics
    assert m["static-max"]["concurrency_mean"] <= m["static-oracle"]["concurrency_mean"]
    assert m["static-oracle"]["concurrency_mean"] <= m["ideal"]["concurrency_mean"]
    assert m["static-max"]["steps"] >= m["static-oracle"]["steps"] >= m["ideal"]["steps"]
    assert m["static-max"]["preemptions"] == m["static-oracle"]["preemptions"] == 0
    for name, metrics in m.items():
        assert 0 < metrics["efficiency_mean"] <= 1, name
        assert 0 < metrics["efficiency_peak"] <= 1, name
        assert metrics["held_bytes_max"] <= report.meta["budget_bytes"], name
    assert m["ideal"]["efficiency_mean"] == m["ideal"]["efficiency_peak"] == 1.0


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize("name", VATTENTION_VARIANTS)
def test_vattention_physical_bytes_are_whole_mapped_pages(factory, name):
    """check=True asserts bytes_mapped == pages_mapped * page_bytes after every step."""
    report = _run(_workload(n=20, seed=2), [name], factory)
    result = report.results[name]
    page_bytes = (2 * MiB) if name.endswith("2MB") else 64 * 1024
    assert np.all(result.held_bytes % page_bytes == 0)
    assert np.all(result.mapped_bytes % page_bytes == 0)
    assert np.all(result.held_bytes >= result.live_tokens * SMALL.bytes_per_token)
    assert np.all(result.mapped_bytes >= result.held_bytes)
    metrics = report.metrics[name]
    assert metrics["map_calls"] > 0
    assert metrics["map_calls_per_step"] == metrics["map_calls"] / metrics["steps"]


@pytest.mark.parametrize("factory", FACTORIES)
def test_preemption_by_recompute_under_a_tight_budget(factory):
    # Short prompts, long outputs, a budget of ~1.5 longest requests: growth must preempt.
    workload = _workload(n=12, seed=3, max_prefill=400, max_decode=3000)
    longest = int(workload.total_tokens.max())
    budget = -(-longest * SMALL.bytes_per_token * 3 // 2 // (2 * MiB)) * 2 * MiB + 4 * MiB
    report = _run(workload, ["paged-16", "ideal", "vattention-mega-2MB"], factory, budget=budget)
    for name, result in report.results.items():
        assert result.finished == workload.num_requests, name
        assert result.decode_tokens == int(workload.decode_tokens.sum()), name
        assert result.preemptions > 0, name
        assert result.recomputed_tokens > 0, name


def test_ideal_allocator_exact_schedule():
    # Budget of 10 tokens: request 0 (4+3 -> 7 tokens) runs alone; request 1 (5+0) must wait
    # until request 0 frees its memory because 7 + 5 > 10 once 0 has grown past 5.
    bpt = SMALL.bytes_per_token
    workload = Workload("toy", np.array([4, 5]), np.array([3, 0]), False, 2)
    alloc = BlockAllocator("ideal", 10 * bpt, bpt, block_tokens=1)
    result = simulate(alloc, workload, max_batch_size=8, check=True)
    # step 1: r0 prefill (4), r1 admitted too (4+5=9 <= 10) and finishes (decode 0)
    # steps 2-4: r0 decodes 5, 6, 7 tokens, finishing at step 4
    assert result.concurrency.tolist() == [2, 1, 1, 1]
    assert result.live_tokens.tolist() == [9, 5, 6, 7]
    assert result.preemptions == 0


def test_youngest_request_is_preempted_and_requeued_at_front():
    bpt = SMALL.bytes_per_token
    workload = Workload("toy", np.array([4, 4]), np.array([3, 3]), False, 2)
    alloc = BlockAllocator("ideal", 9 * bpt, bpt, block_tokens=1)
    result = simulate(alloc, workload, max_batch_size=8, check=True)
    # step 1: both prefill (4 + 4). step 2: growing both needs 10 > 9: preempt r1 (youngest),
    # r0 grows to 5, r1 re-admitted with its 4 prompt tokens (5 + 4 = 9). step 3: 6 + 5 > 9:
    # r1 preempted again; r0 grows to 6 and r1 does not fit. step 4: r0 reaches 7, finishes.
    # steps 5-8: r1 alone, 4 -> 7 tokens.
    assert result.preemptions == 2
    assert result.recomputed_tokens == 8
    assert result.concurrency.tolist() == [2, 2, 1, 1, 1, 1, 1, 1]
    assert result.live_tokens.tolist() == [8, 9, 6, 7, 4, 5, 6, 7]
    assert result.decode_tokens == 6
    assert result.prefill_tokens == 8


def test_block_allocator_grow_is_transactional():
    alloc = BlockAllocator("paged-16", 4 * 16, 1, block_tokens=16)
    assert alloc.admit(0, 16, 64) and alloc.admit(1, 32, 64)
    assert alloc.held_bytes() == 48
    assert not alloc.grow({0: 33, 1: 33})  # needs 2 more blocks, 1 free
    assert alloc.held_bytes() == 48
    assert alloc.grow({0: 17, 1: 32})
    assert alloc.held_bytes() == 64


def test_static_allocators_reserve_up_front():
    smax = StaticAllocator("static-max", 100, 1, reserve="max", max_seq_len=40)
    oracle = StaticAllocator("static-oracle", 100, 1, reserve="oracle", max_seq_len=40)
    assert [smax.admit(i, 5, 30) for i in range(3)] == [True, True, False]
    assert [oracle.admit(i, 5, 30) for i in range(4)] == [True, True, True, False]
    with pytest.raises(ValueError):
        oracle.grow({0: 31})


def test_allocator_that_cannot_hold_the_longest_request_is_a_failed_row():
    # 5010 tokens: ideal needs 10 MB; layer-2MB needs 8 tensors x 1 page x 2 MB = 16 MB.
    workload = Workload("toy", np.array([5000]), np.array([10]), False, 1)
    report = _run(workload, ["ideal", "vattention-layer-2MB"], budget=12 * MiB)
    assert report.metrics["ideal"]["finished"] == 1
    assert report.metrics["vattention-layer-2MB"] == {
        "error": f"the longest request (5010 tokens) needs {16 * MiB} bytes alone, over the "
        f"budget of {12 * MiB} bytes"
    }


def test_unknown_allocator_name():
    with pytest.raises(ValueError, match="paged-16"):
        make_allocator("paged-8", SMALL, budget_bytes=MiB, max_seq_len=64, max_batch_size=2)


def test_load_workload_is_seeded_and_flags_replacement(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(
        "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"
        "10,5,15,2\n20,1,21,20\n30,3,33,10\n"
    )
    a = load_workload(str(path), 3, seed=7)
    assert not a.sampled_with_replacement
    assert sorted(a.prefill_tokens.tolist()) == [10, 20, 30]
    assert sorted(a.total_tokens.tolist()) == [15, 21, 33]
    b = load_workload(str(path), 10, seed=7)
    c = load_workload(str(path), 10, seed=7)
    assert b.sampled_with_replacement and b.num_requests == 10
    assert b.prefill_tokens.tolist() == c.prefill_tokens.tolist()
    assert default_max_seq_len(a) == 1024


def test_cli_writes_table_json_and_files(tmp_path, capsys):
    path = tmp_path / "t.csv"
    rng = np.random.default_rng(0)
    rows = "\n".join(
        f"{p},{d},{p + d},1" for p, d in zip(rng.integers(1, 2000, 30), rng.integers(1, 300, 30))
    )
    path.write_text("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n" + rows)
    out, json_path = tmp_path / "out", tmp_path / "m.json"
    status = cli.main(
        [
            "memory",
            "--trace",
            str(path),
            "--num-requests",
            "30",
            "--dims",
            "4,2,64",
            "--budget",
            "16MB",
            "--allocators",
            ",".join(BASELINES),
            "--out",
            str(out),
            "--json",
            str(json_path),
            "--quiet",
            "--no-plots",
        ]
    )
    assert status == 0
    table = capsys.readouterr().out
    assert "| paged-16 (block arithmetic, not vLLM) |" in table
    data = json.loads(json_path.read_text())
    assert list(data) == list(BASELINES)
    for metrics in data.values():
        for key in (
            "efficiency_mean",
            "efficiency_peak",
            "concurrency_mean",
            "concurrency_max",
            "preemptions",
            "steps",
        ):
            assert key in metrics
    assert (out / "memory_t_custom-4x2x64-bfloat16.md").read_text().strip() == table.strip()
    saved = json.loads((out / "memory_t_custom-4x2x64-bfloat16.json").read_text())
    assert saved["allocators"] == data and saved["meta"]["num_requests"] == 30


def test_cli_rejects_bad_budget(capsys):
    with pytest.raises(SystemExit):
        cli.main(["memory", "--budget", "lots"])


def test_plots_are_skipped_without_matplotlib(tmp_path, monkeypatch):
    from vattention.bench import report as report_mod

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    bench = _run(_workload(n=5), ["ideal"])
    assert report_mod.write_plots(bench, str(tmp_path / "x")) == []
    paths = report_mod.write_report(bench, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == [
        "memory_synthetic_small.md",
        "memory_synthetic_small.json",
    ]


def test_plots_are_written_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    from vattention.bench.report import write_plots

    bench = _run(_workload(n=5), ["static-max", "ideal"])
    paths = write_plots(bench, str(tmp_path / "p"))
    assert [os.path.basename(p) for p in paths] == ["p_efficiency.png", "p_concurrency.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_progress_fallback_without_tqdm(monkeypatch, capsys):
    from vattention.bench.progress import Progress

    monkeypatch.setitem(sys.modules, "tqdm", None)
    with Progress(4, "ideal") as bar:
        for _ in range(4):
            bar.update(1)
    err = capsys.readouterr().err
    assert "ideal" in err and "100% (4/4)" in err


def test_driver_error_becomes_a_failed_row_and_other_rows_still_run():
    from vattention.bench.report import markdown_table
    from vattention.errors import DriverError

    class FailingCache(FakeKVCache):
        def step(self, lengths):
            if sum(self.pages) > 2:
                raise DriverError(
                    "mmap(MAP_FIXED|MAP_SHARED page) failed: Cannot allocate memory (errno 12)"
                )
            super().step(lengths)

    report = run_memory_benchmark(
        _workload(n=10),
        SMALL,
        budget_bytes=32 * MiB,
        max_seq_len=4096,
        max_batch_size=8,
        allocators=["vattention-mega-64KB", "ideal"],
        cache_factory=FailingCache,
        progress=False,
    )
    assert "max_map_count" in report.metrics["vattention-mega-64KB"]["error"]
    assert report.metrics["ideal"]["finished"] == 10
    assert list(report.results) == ["ideal"]
    assert "| vattention-mega-64KB | failed: mmap" in markdown_table(report)


@pytest.mark.skipif("real" not in FACTORIES, reason="needs the built core")
def test_cli_packaged_trace_all_allocators_real(tmp_path, capsys):
    json_path = tmp_path / "m.json"
    status = cli.main(
        [
            "memory",
            "--trace",
            "sharegpt",
            "--num-requests",
            "40",
            "--dims",
            "8,2,64",
            "--budget",
            "256MB",
            "--max-batch-size",
            "32",
            "--out",
            str(tmp_path),
            "--json",
            str(json_path),
            "--quiet",
            "--no-plots",
            "--check",
        ]
    )
    assert status == 0
    data = json.loads(json_path.read_text())
    assert list(data) == list(ALL_ALLOCATORS)
    for name in VATTENTION_VARIANTS:
        assert data[name]["finished"] == 40
        assert data[name]["map_calls_per_step"] > 0
        assert 0 < data[name]["efficiency_mean"] <= data["ideal"]["efficiency_mean"] == 1.0
    assert data["static-max"]["concurrency_mean"] <= data["ideal"]["concurrency_mean"]


def test_cli_all_rows_failed_exits_1(tmp_path, capsys):
    status = cli.main(
        [
            "memory",
            "--trace",
            "sharegpt",
            "--num-requests",
            "5",
            "--budget",
            "1MB",
            "--allocators",
            "ideal,paged-16",
            "--out",
            str(tmp_path),
            "--quiet",
            "--no-plots",
        ]
    )
    assert status == 1
    assert "2 of 2 allocators failed" in capsys.readouterr().err


def test_host_mapping_limit_is_checked_up_front():
    from vattention.bench.sizing import host_mapping_problem

    if not os.path.exists("/proc/sys/vm/max_map_count"):
        pytest.skip("not Linux")
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    model = ModelShape("m", 32, 8, 128)
    over = (limit + 10) * 64 * 1024  # more 64 KB pages than the process may map
    assert "vm.max_map_count" in host_mapping_problem("vattention-mega-64KB", model, over)
    assert host_mapping_problem("vattention-mega-2MB", model, over) is None
    assert host_mapping_problem("vattention-mega-64KB", model, 1 << 30) is None
    assert host_mapping_problem("paged-16", model, over) is None


@pytest.mark.skipif("real" not in FACTORIES, reason="needs the built core")
def test_eager_reclaim_maps_only_what_running_requests_hold():
    report = run_memory_benchmark(
        _workload(n=20, seed=4),
        SMALL,
        budget_bytes=32 * MiB,
        max_seq_len=4096,
        max_batch_size=16,
        allocators=["vattention-mega-64KB"],
        check=True,
        progress=False,
        reclaim="eager",
    )
    result = report.results["vattention-mega-64KB"]
    assert report.meta["reclaim"] == "eager"
    assert result.finished == 20
    assert np.array_equal(result.mapped_bytes, result.held_bytes)


# ---- sliding-window and fp8 rows ----------------------------------------------------------------
SMALL_WINDOW = ModelShape(
    "small-window",
    num_layers=4,
    num_kv_heads=2,
    head_dim=64,
    dtype="float16",
    window=256,
    window_layers=3,
)


def test_window_block_allocator_frees_blocks_before_the_window_once_decoding():
    from vattention.bench.allocators import WindowBlockAllocator

    a = WindowBlockAllocator("paged-16", 4 << 20, SMALL_WINDOW, block_tokens=16)
    win, full = SMALL_WINDOW.windowed_bytes_per_token, 512  # K and V: 512 bytes per layer
    assert (win, SMALL_WINDOW.bytes_per_token - win) == (3 * 512, full)
    assert a.admit(0, 1000, 2000) and a.held_bytes() == 1008 * (win + full)  # prefill: all
    assert a.grow({0: 1001})
    freed = (1001 - 256) // 16 * 16  # whole blocks
    assert a.held_bytes() == 1008 * full + (1008 - freed) * win
    assert SMALL_WINDOW.kv_bytes(1001) == 1001 * full + 256 * win
    assert SMALL_WINDOW.sliding_window() == (256, 256, 256, None)


@pytest.mark.skipif("real" not in FACTORIES, reason="needs the built core")
def test_window_rows_release_pages_and_hold_less_than_without_release():
    names = [
        "paged-16",
        "ideal",
        "vattention-layer-64KB",
        "vattention-layer-64KB-norelease",
        "vattention-mega-64KB",
    ]
    workload = _workload(n=24, seed=5, max_prefill=1500, max_decode=1500)
    report = run_memory_benchmark(
        workload,
        SMALL_WINDOW,
        budget_bytes=24 * MiB,
        max_seq_len=default_max_seq_len(workload),
        max_batch_size=16,
        allocators=names,
        check=True,
        progress=False,
    )
    m = report.metrics
    assert "per-layer windows need layout='layer'" in m["vattention-mega-64KB"]["error"]
    for name in names[:4]:
        assert report.results[name].finished == 24, name
    release, keep = m["vattention-layer-64KB"], m["vattention-layer-64KB-norelease"]
    assert release["efficiency_mean"] > keep["efficiency_mean"]
    assert release["concurrency_mean"] >= keep["concurrency_mean"]
    assert release["held_bytes_max"] <= keep["held_bytes_max"]
    # Live bytes count only the window on windowed layers: the same series for every row.
    live = report.results["ideal"].live_bytes
    assert live is not None and report.meta["window"] == 256


@pytest.mark.skipif("real" not in FACTORIES, reason="needs the built core")
def test_fp8_row_holds_half_the_bytes_per_token():
    fp8 = ModelShape("small-fp8", num_layers=4, num_kv_heads=2, head_dim=64, dtype="float8_e4m3fn")
    assert fp8.bytes_per_token * 2 == ModelShape("s", 4, 2, 64, "float16").bytes_per_token
    report = run_memory_benchmark(
        _workload(n=10, seed=6),
        fp8,
        budget_bytes=16 * MiB,
        max_seq_len=4096,
        max_batch_size=16,
        allocators=["ideal", "vattention-layer-64KB"],
        check=True,
        progress=False,
    )
    assert report.results["vattention-layer-64KB"].finished == 10
    assert report.meta["dtype"] == "float8_e4m3fn"


# ---- per-layer shapes ---------------------------------------------------------------------------
# Gemma-4-like: 3 windowed layers of 2 x 64, one full-attention layer of 2 x 128 (fp16).
SMALL_HYBRID = ModelShape(
    "small-hybrid",
    num_layers=4,
    num_kv_heads=2,
    head_dim=64,
    dtype="float16",
    window=256,
    window_layers=3,
    full_head_dim=128,
)


def test_model_shape_counts_each_layers_own_bytes():
    from vattention.bench.sizing import min_bytes_for_request, page_geometry

    assert SMALL_HYBRID.layer_shapes() == ((2, 64),) * 3 + ((2, 128),)
    assert SMALL_HYBRID.bytes_per_token == 2 * (3 * 256 + 512)
    assert SMALL_HYBRID.windowed_bytes_per_token == 2 * 3 * 256
    assert SMALL_HYBRID.padded().layer_shapes() == ((2, 128),) * 4
    # A 64 KB page index: 256 tokens, 1 page in a windowed layer's tensors, 2 in the full one's.
    assert page_geometry(SMALL_HYBRID, "layer", "64KB") == (2 * (3 + 2), 256, 64 << 10)
    assert min_bytes_for_request("vattention-layer-64KB", SMALL_HYBRID, 1, 4096) == 10 * (64 << 10)
    assert min_bytes_for_request("vattention-layer-64KB-padded", SMALL_HYBRID, 1, 4096) == 2 * 4 * (
        64 << 10
    )  # 512 bytes a token everywhere: 128 tokens per page
    gemma4 = MODELS["gemma4-defaults"]
    assert gemma4.bytes_per_token == 2 * 2 * (25 * 4 * 256 + 5 * 4 * 512)


@pytest.mark.skipif("real" not in FACTORIES, reason="needs the built core")
def test_per_layer_rows_hold_each_layers_bytes_and_beat_padding():
    names = [
        "ideal",
        "vattention-layer-64KB",
        "vattention-layer-64KB-padded",
        "vattention-mega-64KB",
    ]
    workload = _workload(n=24, seed=7, max_prefill=1500, max_decode=1500)
    report = run_memory_benchmark(
        workload,
        SMALL_HYBRID,
        budget_bytes=24 * MiB,
        max_seq_len=default_max_seq_len(workload),
        max_batch_size=16,
        allocators=names,
        check=True,
        progress=False,
    )
    m = report.metrics
    assert "per-layer shapes need layout='layer'" in m["vattention-mega-64KB"]["error"]
    for name in names[:3]:
        assert report.results[name].finished == 24, name
    exact, padded = m["vattention-layer-64KB"], m["vattention-layer-64KB-padded"]
    assert exact["efficiency_mean"] > padded["efficiency_mean"]
    assert exact["concurrency_mean"] > padded["concurrency_mean"]
    assert report.meta["full_head_dim"] == 128
