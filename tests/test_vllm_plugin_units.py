"""The vLLM plugin's parts that need no vLLM: KV layout and block sizes, version check, switch,
stats file.

(The plugin itself runs end to end in tests/test_integrations_vllm.py, in the vLLM venv.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace as NS

import pytest
import torch
from hypothesis import given, strategies as st

import vattention
from vattention.integrations.vllm import kv_layout, plugin
from vattention.integrations.vllm.release_delay import DelayedBudget, release_delay
from vattention.integrations.vllm.stats_writer import StatsWriter, stats_path


@given(
    block=st.integers(1, 1024),
    heads=st.integers(1, 16),
    dim=st.sampled_from([16, 32, 64, 80, 96, 128, 256]),
    dtype=st.sampled_from([torch.uint8, torch.bfloat16, torch.float32]),
    layers=st.integers(1, 64),
    layout=st.sampled_from(kv_layout.LAYOUTS),
    gran=st.sampled_from([4096, 65536, 2 << 20]),
)
def test_aligned_block_is_the_smallest_page_aligned_multiple(
    block, heads, dim, dtype, layers, layout, gran
):
    unit = kv_layout.model_unit_bytes(layout, layers, heads, dim, dtype)
    aligned = kv_layout.aligned_block_size(block, unit, gran)
    assert aligned % block == 0 and (aligned * unit) % gran == 0
    assert all((m * unit) % gran for m in range(block, aligned, block))


@given(
    block=st.sampled_from([16, 32, 128, 256]), huge=st.sampled_from([0, 2 << 20]), data=st.data()
)
def test_huge_block_is_at_most_twice_the_block_and_only_for_whole_huge_pages(block, huge, data):
    # token sizes of any kind, and odd multiples of 2 MB / (f x block): a block f times as large
    # is the first of whole huge pages (f = 2: taken; f = 4: too coarse)
    unit = data.draw(
        st.one_of(
            st.integers(1, 1 << 16).map(lambda u: u * 16),
            *(
                st.integers(0, 63).map(lambda k, f=f: (2 * k + 1) * (2 << 20) // (f * block))
                for f in (2, 4)
            ),
        )
    )
    chosen = kv_layout.huge_block_size(block, unit, huge)

    def whole(b):
        return huge and (b * unit) % huge == 0

    if whole(block) or not whole(2 * block):  # nothing to gain, or 2x is not enough
        assert chosen == block
    else:
        assert chosen == 2 * block


def _spec(window=None, heads=2, dim=32, block=128):
    return NS(block_size=block, num_kv_heads=heads, head_size=dim, sliding_window=window)


def _kv(*groups, num_blocks=10):
    return NS(
        num_blocks=num_blocks,
        kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=names) for spec, names in groups],
    )


@pytest.mark.parametrize("layout, pages_per_block", [("mega", 2), ("layer", 6)])
def test_a_cache_with_vllms_budget_holds_exactly_its_blocks(layout, pages_per_block):
    kv = kv_layout.kv_layout(_kv((_spec(), ["a", "b", "c"])), torch.float32, layout)
    cfg = kv.cache_config(max_batch_size=4, max_seq_len=1280, device="cpu", block_cache=False)
    assert cfg.tokens_per_page == kv.block_size == 128
    assert cfg.pages_per_index == pages_per_block
    vllm_block_bytes = 2 * 3 * 128 * 2 * 32 * 4  # K,V x layers x tokens x H x D x fp32
    assert kv.memory_budget(cfg) == 10 * vllm_block_bytes
    with vattention.KVCache(cfg, memory_budget=kv.memory_budget(cfg)) as cache:
        s = [cache.alloc() for _ in range(3)]
        # vLLM's ids are [0, num_blocks), 0 its null block: 9 real blocks, 2 + 2 + 5 here
        cache.step(
            {s[0]: 129, s[1]: 256, s[2]: 640},
            blocks={s[0]: (0, [1, 2], 0), s[1]: (0, [3, 4], 0), s[2]: (0, [5, 6, 7, 8, 9], 0)},
        )
        assert cache.stats()["pages_mapped"] == 9 * pages_per_block
        spare = cache.capacity()  # the budget's last block: the null block's share
        assert spare.pages_free + spare.pages_creatable == pages_per_block


def test_hybrid_groups_become_layer_groups_with_their_windows():
    kv = kv_layout.kv_layout(
        _kv((_spec(), ["l1", "l3"]), (_spec(64), ["l0", "l2"])), torch.bfloat16, "auto"
    )
    assert kv.layout == "layer" and kv.layer_names == ("l1", "l3", "l0", "l2")
    assert kv.layer_groups == (0, 0, 1, 1) and kv.windows == (None, None, 64, 64)
    cfg = kv.cache_config(max_batch_size=2, max_seq_len=512, device="cpu", block_cache=True)
    assert cfg.num_groups == 2 and cfg.geometry.group_width == 4
    assert cfg.layer_windows == (0, 0, 64, 64) and cfg.block_cache


def test_what_one_cache_cannot_hold_is_refused_naming_it():
    with pytest.raises(vattention.ConfigError, match="VATTENTION_VLLM_LAYOUT=layer"):
        kv_layout.kv_layout(_kv((_spec(), ["a"]), (_spec(64), ["b"])), torch.float32, "mega")
    with pytest.raises(vattention.ConfigError, match=r"block sizes \[16, 32\]"):
        kv_layout.kv_layout(
            _kv((_spec(block=16), ["a"]), (_spec(block=32), ["b"])), torch.float32, "auto"
        )
    with pytest.raises(vattention.ConfigError, match="group 0 is a MambaSpec"):
        kv_layout.kv_layout(
            NS(
                num_blocks=4,
                kv_cache_groups=[NS(kv_cache_spec=type("MambaSpec", (), {})(), layer_names=["m"])],
            ),
            torch.float32,
            "auto",
        )


def test_kv_cache_dtypes():
    assert kv_layout.kv_cache_dtype("auto", torch.float16) == torch.float16
    assert kv_layout.kv_cache_dtype("fp8_e5m2", torch.float16) == torch.float8_e5m2
    with pytest.raises(vattention.ConfigError, match="kv_cache_dtype='int8'"):
        kv_layout.kv_cache_dtype("int8", torch.float16)


def test_untested_version_is_refused_unless_overridden(monkeypatch):
    monkeypatch.delenv(vattention.integrations.vllm.ENV_ALLOW_UNTESTED, raising=False)
    plugin.check_version("0.32.0+cpu")
    plugin.check_version("0.33.0")
    with pytest.raises(
        vattention.ConfigError,
        match=r"tested with vLLM 0\.32\.0, 0\.33\.0, not "
        r"0\.31\.2",
    ):
        plugin.check_version("0.31.2")
    monkeypatch.setenv("VATTENTION_VLLM_ALLOW_UNTESTED", "1")
    plugin.check_version("0.31.2")


def test_layout_env_is_checked(monkeypatch):
    monkeypatch.setenv("VATTENTION_VLLM_LAYOUT", "paged")
    with pytest.raises(vattention.ConfigError, match="VATTENTION_VLLM_LAYOUT='paged'"):
        plugin.layout_from_env()
    monkeypatch.delenv("VATTENTION_VLLM_LAYOUT")
    assert plugin.layout_from_env() == "auto"


@pytest.mark.parametrize("layout", ["mega", "layer"])
def test_a_blocks_bytes_are_its_pages_in_every_tensor_of_its_group(layout):
    kv = kv_layout.kv_layout(_kv((_spec(), ["a", "b", "c"])), torch.float32, layout)
    cfg = kv.cache_config(max_batch_size=4, max_seq_len=1280, device="cpu", block_cache=True)
    assert (
        kv.block_bytes() * kv.num_blocks == kv.memory_budget(cfg) == 10 * 2 * 3 * 128 * 2 * 32 * 4
    )


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_elastic_scheduler_is_named_by_vllms_own_setting(async_scheduling):
    config = NS(scheduler_cls=None, async_scheduling=async_scheduling)
    plugin._elastic_scheduler(config)
    assert config.scheduler_cls == (
        plugin.ASYNC_SCHEDULER if async_scheduling else plugin.SCHEDULER
    )
    plugin._elastic_scheduler(config)  # a config checked twice keeps it
    assert config.scheduler_cls.startswith("vattention.integrations.vllm.scheduler.")
    custom = NS(scheduler_cls="mine.Scheduler", async_scheduling=async_scheduling)
    with pytest.raises(vattention.ConfigError, match=r"custom scheduler class \(mine.Scheduler\)"):
        plugin._elastic_scheduler(custom)
    assert custom.scheduler_cls == "mine.Scheduler"


def test_memory_settings_are_checked_at_start_up(monkeypatch):
    for name in ("VATTENTION_VLLM_POOL", "VATTENTION_VLLM_POOL_BYTES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VATTENTION_VLLM_PREFIX_CACHE_BYTES", "lots")
    with pytest.raises(vattention.ConfigError, match="VATTENTION_VLLM_PREFIX_CACHE_BYTES"):
        plugin._check_memory_settings()
    monkeypatch.setenv("VATTENTION_VLLM_PREFIX_CACHE_BYTES", "64MiB")
    plugin._check_memory_settings()
    monkeypatch.setenv("VATTENTION_VLLM_POOL", "shared")
    with pytest.raises(vattention.ConfigError, match="needs VATTENTION_VLLM_POOL_BYTES"):
        plugin._check_memory_settings()
    monkeypatch.setenv("VATTENTION_VLLM_POOL_BYTES", "-3")
    with pytest.raises(vattention.ConfigError, match="VATTENTION_VLLM_POOL_BYTES"):
        plugin._check_memory_settings()
    monkeypatch.setenv("VATTENTION_VLLM_POOL_BYTES", "8GiB")
    plugin._check_memory_settings()
    monkeypatch.setenv("VATTENTION_VLLM_RELEASE_DELAY", "1")  # a pool releases at once
    with pytest.raises(vattention.ConfigError, match="VATTENTION_VLLM_RELEASE_DELAY='1' with"):
        plugin._check_memory_settings()
    monkeypatch.delenv("VATTENTION_VLLM_POOL")
    plugin._check_memory_settings()
    for bad in ("soon", "-1", "nan", "inf", "3601"):
        monkeypatch.setenv("VATTENTION_VLLM_RELEASE_DELAY", bad)
        with pytest.raises(vattention.ConfigError, match=r"in \[0, 3600\]"):
            plugin._check_memory_settings()


def test_release_delay_defaults():
    assert release_delay({}) == 10.0
    assert release_delay({"VATTENTION_VLLM_POOL": "chat"}) == 0.0
    pool = {"VATTENTION_VLLM_POOL": "chat"}
    assert release_delay({**pool, "VATTENTION_VLLM_RELEASE_DELAY": "0"}) == 0
    assert release_delay({"VATTENTION_VLLM_RELEASE_DELAY": "0.25"}) == 0.25


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_delayed_budget_rises_at_once_and_falls_after_the_delay():
    clock, applied = _Clock(), []
    budget = DelayedBudget(applied.append, 2.0, clock=clock)
    try:
        budget.set(10)
        budget.set(30)  # a burst: raised at once
        assert applied == [10, 30]
        clock.now += 1.0
        budget.set(20)  # lowered: 30 was set within the last 2 s
        clock.now += 0.5
        budget.set(5)
        assert applied == [10, 30] and budget.applied == 30
        clock.now += 0.5  # 30 leaves the window at the next look: 20 (set 1 s ago) is the most
        budget.set(5)
        assert applied == [10, 30, 20]
        clock.now += 1.5  # 20 (and the first 5) left it too
        budget.set(5)
        assert applied == [10, 30, 20, 5]
        budget.set(40)
        clock.now += 0.1
        budget.set(8)  # a lowering undone within the delay never reaches apply
        budget.set(40)
        assert applied == [10, 30, 20, 5, 40]
    finally:
        budget.close()


def test_an_idle_worker_gets_its_lowered_budget_from_the_thread():
    applied = []
    budget = DelayedBudget(applied.append, 0.2)
    try:
        budget.set(100)
        budget.set(10)  # the last step's: no later step comes to apply it
        assert applied == [100]
        deadline = time.monotonic() + 10
        while applied[-1] != 10 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert applied == [100, 10]
    finally:
        budget.close()
    budget.set(1)  # closed: nothing more is applied
    assert applied == [100, 10]


def test_a_failed_delayed_apply_is_retried_by_the_next_step():
    applied, fail, failed = [], [True], threading.Event()

    def apply(b):
        if fail[0] and b == 10:
            failed.set()
            raise RuntimeError("the cache is closing")
        applied.append(b)

    budget = DelayedBudget(apply, 0.05)
    try:
        budget.set(100)
        budget.set(10)
        # the thread tried (and failed) to lower it: waited for as an event (the timeout only
        # guards against a hang; the thread tries 0.05 s after the set)
        assert failed.wait(10), "the thread never tried to apply the lowered budget"
        with budget._lock:  # its failure handled (it holds the lock until it waits again)
            pass
        assert applied == [100] and budget.applied == 100 and budget._thread.is_alive()
        fail[0] = False
        budget.set(10)  # the next step's budget goes through
        assert applied == [100, 10]
    finally:
        budget.close()


def test_no_delay_applies_every_budget_at_once_without_a_thread():
    applied = []
    budget = DelayedBudget(applied.append, 0.0)
    for b in (5, 3, 3, 7, 1):
        budget.set(b)
    assert applied == [5, 3, 7, 1] and budget._thread is None
    budget.close()
    with pytest.raises(ValueError, match="-1"):
        DelayedBudget(applied.append, -1)


def test_cpu_auto_layout_is_layer_only_while_its_mappings_fit_half_the_limit(caplog):
    # bench vllm's small model: 16 seqs x 32 blocks x 2 x 4 layers = 4096 mappings
    caplog.set_level("INFO", logger=plugin.logger.name)
    assert plugin._cpu_auto_layout(16, 4096, 4, 128, 28669) == ("layer", 128)
    assert "layout layer: at most 4096 page mappings" in caplog.text
    assert plugin._cpu_auto_layout(16, 4096, 4, 128, 8192) == ("layer", 128)  # exactly half
    assert plugin._cpu_auto_layout(16, 4096, 4, 128, 8191) == ("mega", 128)
    assert "could need 4096 page mappings" in caplog.text and "--max-num-seqs" in caplog.text
    # vLLM's CPU defaults (256 seqs) and an 8B model's 8k rows: 32 layers x 64 blocks x 2 x 256
    assert plugin._cpu_auto_layout(256, 8192, 32, 128, 28669) == ("mega", 128)
    assert plugin._cpu_auto_layout(1, 100, 1, 128, 0) == ("mega", 128)  # no mappings allowed


def test_cpu_auto_layout_doubles_the_block_for_layer_only_where_that_makes_it_fit(caplog):
    # qwen2.5-0.5b at bench vllm's sizes: 16 x 32 blocks x 2 x 24 layers = 24576 > 14334
    caplog.set_level("INFO", logger=plugin.logger.name)
    assert plugin._cpu_auto_layout(16, 4096, 24, 128, 28669) == ("mega", 128)  # a given block
    assert plugin._cpu_auto_layout(16, 4096, 24, 128, 28669, coarser=True) == ("layer", 256)
    assert (
        "at most 12288 page mappings (16 seqs x 4096 tokens in 256-token blocks, twice 128 to "
        "halve them x 24 layers x K,V)" in caplog.text
    ), caplog.text
    # where the block as it is fits, it stays; where twice it does not either, mega keeps it
    assert plugin._cpu_auto_layout(16, 4096, 4, 128, 28669, coarser=True) == ("layer", 128)
    caplog.clear()
    assert plugin._cpu_auto_layout(256, 8192, 32, 128, 28669, coarser=True) == ("mega", 128)
    assert "could need 524288 page mappings" in caplog.text and "256-token blocks" in caplog.text


def test_the_v1_runner_is_selected_and_an_explicit_v2_refused(monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    plugin.select_v1_runner()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    plugin.select_v1_runner()  # idempotent
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(vattention.ConfigError, match="VLLM_USE_V2_MODEL_RUNNER=1"):
        plugin.select_v1_runner()


def test_register_is_a_no_op_without_the_switch():
    """Installing vattention changes nothing: without VATTENTION_VLLM=1, vLLM is not imported."""
    code = (
        "import sys, vattention.integrations.vllm as p; p.register(); "
        "print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))"
    )
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == "False"


def test_stats_writer_writes_periodically_and_a_final_document(tmp_path):
    path = tmp_path / "kv.json"
    ticks = []

    def snapshot():
        ticks.append(1)
        return {"ticks": len(ticks)}

    writer = StatsWriter(str(path), snapshot, interval_s=0.05)
    assert json.loads(path.read_text())["ticks"] == 1  # written at start
    deadline = time.monotonic() + 10
    while json.loads(path.read_text())["ticks"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    writer.close({"final": True})
    assert json.loads(path.read_text()) == {"final": True}
    assert [p.name for p in tmp_path.iterdir()] == ["kv.json"]  # no temporary left behind
    assert stats_path(str(path), 3, 4).endswith("kv.json.rank3")


# ---- the shared-prefix hint read from block tables (prefix_hint) ----------------------------


@st.composite
def _tables(draw):
    """A batch's block tables: requests copy a random run of a few 'prompts' (shared blocks),
    then own blocks; some holes (null block 0) as a sliding window leaves them."""
    n, width, bs = draw(st.integers(1, 10)), draw(st.integers(1, 8)), draw(st.sampled_from([1, 16]))
    prompts = [[draw(st.integers(1, 6)) * 10 + j for j in range(width)] for _ in range(3)]
    rows, past, own = [], [], 1000
    for _ in range(n):
        p = prompts[draw(st.integers(0, 2))]
        keep = draw(st.integers(0, width))
        row = p[:keep]
        while len(row) < width:
            row.append(own)
            own += 1
        if draw(st.integers(0, 5)) == 0:
            row[draw(st.integers(0, width - 1))] = 0
        rows.append(row)
        past.append(draw(st.integers(0, width * bs)))
    return torch.tensor(rows, dtype=torch.int32), past, bs


@given(_tables())
def test_shared_prefix_hint_never_claims_more_than_the_tables_share(case):
    from vattention.integrations.vllm.prefix_hint import SharedPrefixMemo, shared_prefixes

    table, past, bs = case
    groups, lens = shared_prefixes(table, past, bs)
    ids = table.tolist()

    def shared_tokens(i, j):  # whole cached blocks both rows name alike (holes never match)
        run = 0
        while (
            run < len(ids[i])
            and ids[i][run] == ids[j][run]
            and ids[i][run] != 0
            and (run + 1) * bs <= min(past[i], past[j])
        ):
            run += 1
        return run * bs

    if groups is None:  # no two requests with the same non-null first block, both cached
        firsts = [ids[i][0] for i in range(len(ids)) if ids[i][0] and past[i] >= bs]
        assert len(firsts) == len(set(firsts))
        return
    g, n = groups.tolist(), lens.tolist()
    assert groups.dtype == lens.dtype == torch.int32
    for i in range(len(ids)):
        assert n[i] <= past[i] and (g[i] >= 0 or n[i] == 0)
        for j in range(len(ids)):
            if i != j and g[i] >= 0 and g[i] == g[j]:
                assert min(n[i], n[j]) <= shared_tokens(i, j)
                assert ids[i][0] == ids[j][0]
            elif i != j and ids[i][0] == ids[j][0] and ids[i][0] and min(past[i], past[j]) >= bs:
                assert g[i] == g[j] >= 0  # requests sharing a cached first block: one group
        if g[i] >= 0:  # and no less than it shares with its group's first request
            lead = g.index(g[i])
            assert min(n[i], n[lead]) == (shared_tokens(i, lead) if i != lead else n[i])
    # the memo answers the same, and again without recomputing while nothing changed
    memo = SharedPrefixMemo()
    first = memo(table, past, bs)
    assert [x.tolist() for x in first] == [g, n]
    assert memo(table, past, bs) is first
