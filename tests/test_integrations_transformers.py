"""VAttentionCache in transformers' generate(): same tokens as DynamicCache, no copies, paged
memory.

Tiny random models are built from configs (no downloads). Skips cleanly without transformers.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import vattention  # noqa: E402
from vattention.integrations.transformers import VAttentionCache, model_kv_shape  # noqa: E402

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 6}),
}
PAGE = 4096  # one OS page; a token row of one layer is 2 heads * 16 dims * 4 bytes = 128 B
TOKENS_PER_PAGE = 32


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest single-threaded, and CI has 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(family: str = "llama", attn: str = "sdpa", layers: int = 2) -> torch.nn.Module:
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        **extra,
    )
    config._attn_implementation = attn
    torch.manual_seed(0)
    return model_cls(config).eval()


def prompts(batch: int = 2, length: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 96, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :3] = 0  # left padding on row 1
        ids[1, :3] = 0
    return ids, mask


def generate(model, ids, mask, cache=None, *, sample=False, new=24, seed=3):
    torch.manual_seed(seed)
    kwargs = {"past_key_values": cache} if cache is not None else {}
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=sample,
        top_k=0 if sample else None,
        **kwargs,
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("layout", ["layer", "mega"])
def test_greedy_tokens_match_dynamic_cache(family, attn, layout):
    model = tiny_model(family, attn)
    ids, mask = prompts(batch=2)
    expected = generate(model, ids, mask, transformers.DynamicCache())
    with VAttentionCache.from_model(
        model, max_batch_size=2, max_seq_len=64, page_size=PAGE, layout=layout
    ) as cache:
        got = generate(model, ids, mask, cache)
        assert cache.get_seq_length() == ids.shape[1] + 24 - 1  # the last token is not fed back
    assert torch.equal(got, expected)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sampling_tokens_match_dynamic_cache(family):
    model = tiny_model(family)
    ids, mask = prompts(batch=3)
    expected = generate(model, ids, mask, transformers.DynamicCache(), sample=True)
    with VAttentionCache.from_model(
        model, max_batch_size=3, max_seq_len=64, page_size=PAGE
    ) as cache:
        got = generate(model, ids, mask, cache, sample=True)
    assert torch.equal(got, expected)


def test_batch_one_and_default_cache_agree():
    model = tiny_model("qwen2")
    ids, mask = prompts(batch=1, length=5)
    expected = generate(model, ids, mask)  # generate's own DynamicCache
    with VAttentionCache.from_model(
        model, max_batch_size=1, max_seq_len=40, page_size=PAGE
    ) as cache:
        assert torch.equal(generate(model, ids, mask, cache), expected)


def test_physical_memory_follows_tokens_not_max_len():
    model = tiny_model("llama")
    ids, mask = prompts(batch=2, length=7)
    seen: list[int] = []
    with VAttentionCache.from_model(
        model, max_batch_size=2, max_seq_len=4096, page_size=PAGE
    ) as cache:

        def record(input_ids, scores):  # called once per generated token
            seen.append(cache.memory_bytes())
            return scores

        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=60,
            min_new_tokens=60,
            do_sample=False,
            past_key_values=cache,
            logits_processor=transformers.LogitsProcessorList([record]),
        )
        cfg = cache.config
        tensors = 2 * cfg.num_layers * 2  # K and V per layer, 2 slots
        # tokens cached when token t is chosen: 7 + t; pages per tensor: ceil(tokens / 32)
        expected = [-(-(7 + t) // TOKENS_PER_PAGE) * PAGE * tensors for t in range(60)]
        assert seen == expected
        assert seen[-1] == 3 * PAGE * tensors  # 66 tokens -> 3 pages per tensor
        assert cfg.static_bytes == 4194304 > 40 * seen[-1]  # static rows: 4096 tokens each


def test_attention_gets_zero_copy_views_of_the_cache_rows():
    model = tiny_model("llama")
    ids, mask = prompts(batch=2)
    pointers = set()
    with VAttentionCache.from_model(
        model, max_batch_size=2, max_seq_len=64, page_size=PAGE
    ) as cache:
        original = cache.layers[0].update

        def spy(k, v, *args, **kwargs):
            keys, values = original(k, v, *args, **kwargs)
            pointers.add((keys.data_ptr(), values.data_ptr()))
            return keys, values

        cache.layers[0].update = spy
        generate(model, ids, mask, cache, new=10)
        k_rows, v_rows = cache.kv_cache.layer(0)
        slot = cache.slots[0]
        # 10 forward passes, one address: the slot rows themselves, never a fresh copy
        assert pointers == {(k_rows[slot].data_ptr(), v_rows[slot].data_ptr())}
        keys = cache.layers[0].keys
        assert keys.shape == (2, 2, ids.shape[1] + 9, 16)
        assert torch.equal(keys.transpose(1, 2), k_rows[slot : slot + 2, : ids.shape[1] + 9])


def test_reset_reuses_mapped_pages_and_repeats_tokens():
    model = tiny_model("mistral")
    ids, mask = prompts(batch=2)
    with VAttentionCache.from_model(
        model, max_batch_size=2, max_seq_len=64, page_size=PAGE
    ) as cache:
        first = generate(model, ids, mask, cache)
        mapped = cache.memory_bytes()
        cache.reset()
        assert cache.get_seq_length() == 0 and cache.slots == []
        second = generate(model, ids, mask, cache)
        assert torch.equal(first, second)
        assert cache.memory_bytes() == mapped


def test_mask_sizes_and_crop_match_dynamic_cache():
    model = tiny_model("llama")
    ids, mask = prompts(batch=2)
    dynamic = transformers.DynamicCache()
    generate(model, ids, mask, dynamic, new=5)
    with VAttentionCache.from_model(
        model, max_batch_size=2, max_seq_len=64, page_size=PAGE
    ) as cache:
        generate(model, ids, mask, cache, new=5)
        assert cache.get_seq_length() == dynamic.get_seq_length() == 11
        # transformers 5.12+ passes the query length; 4.57-5.0 pass cache_position
        takes_position = (
            "cache_position"
            in inspect.signature(transformers.cache_utils.DynamicLayer.get_mask_sizes).parameters
        )
        query = torch.arange(11, 12) if takes_position else 1
        assert cache.get_mask_sizes(query, 0) == dynamic.get_mask_sizes(query, 0) == (12, 0)
        cache.crop(-4)
        dynamic.crop(-4)
        assert cache.get_seq_length() == dynamic.get_seq_length() == 7
        assert torch.equal(cache.layers[1].keys, dynamic.layers[1].keys)


def test_wrong_batch_or_dtype_is_a_config_error():
    model = tiny_model("llama")
    ids, mask = prompts(batch=2)
    with VAttentionCache.from_model(
        model, max_batch_size=1, max_seq_len=64, page_size=PAGE
    ) as cache:
        with pytest.raises(vattention.ConfigError, match="exceeds max_batch_size=1"):
            generate(model, ids, mask, cache, new=2)
    with VAttentionCache.from_model(
        model, max_batch_size=2, max_seq_len=64, page_size=PAGE, dtype=torch.float64
    ) as cache:
        with pytest.raises(vattention.ConfigError, match="torch.float64"):
            generate(model, ids, mask, cache, new=2)


def test_sequence_longer_than_max_seq_len_raises():
    model = tiny_model("llama")
    ids, mask = prompts(batch=1, length=6)
    with VAttentionCache.from_model(
        model, max_batch_size=1, max_seq_len=10, page_size=PAGE
    ) as cache:
        with pytest.raises(vattention.SequenceTooLongError):
            generate(model, ids, mask, cache, new=8)


def test_model_kv_shape_reads_head_dim_and_kv_heads():
    config = transformers.LlamaConfig(
        hidden_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=8,
    )
    assert model_kv_shape(config) == {"num_layers": 3, "num_kv_heads": 3, "head_dim": 8}


def test_beam_search_and_num_return_sequences_match_dynamic_cache():
    model = tiny_model("llama")
    ids, mask = prompts(batch=2)
    beams = {"max_new_tokens": 12, "num_beams": 3, "do_sample": False}
    expected = model.generate(
        ids, attention_mask=mask, past_key_values=transformers.DynamicCache(), **beams
    )
    with VAttentionCache.from_model(
        model, max_batch_size=6, max_seq_len=64, page_size=PAGE
    ) as cache:  # 2 prompts x 3 beams
        assert torch.equal(
            model.generate(ids, attention_mask=mask, past_key_values=cache, **beams), expected
        )
    sampled = {"max_new_tokens": 12, "num_return_sequences": 2, "do_sample": True}
    torch.manual_seed(5)
    expected = model.generate(ids, attention_mask=mask, **sampled)
    with VAttentionCache.from_model(
        model, max_batch_size=4, max_seq_len=64, page_size=PAGE
    ) as cache:
        torch.manual_seed(5)
        assert torch.equal(
            model.generate(ids, attention_mask=mask, past_key_values=cache, **sampled), expected
        )


def test_wrapping_a_shared_kv_cache_uses_free_slots_and_leaves_it_open():
    model = tiny_model("llama")
    ids, mask = prompts(batch=2)
    expected = generate(model, ids, mask, transformers.DynamicCache(), new=6)
    cfg = vattention.KVCacheConfig(
        **model_kv_shape(model),
        max_batch_size=4,
        max_seq_len=64,
        dtype=torch.float32,
        page_size=PAGE,
    )
    with vattention.KVCache(cfg) as kv:
        other = kv.alloc()  # slot 0 belongs to someone else
        cache = VAttentionCache(kv)
        assert torch.equal(generate(model, ids, mask, cache, new=6), expected)
        assert cache.slots == [1, 2] and kv.active_slots() == [0, 1, 2]
        cache.close()
        assert kv.active_slots() == [other] and not kv.closed


def test_non_contiguous_free_slots_are_refused_and_released():
    model = tiny_model("llama")
    ids, mask = prompts(batch=2)
    cfg = vattention.KVCacheConfig(
        **model_kv_shape(model),
        max_batch_size=4,
        max_seq_len=64,
        dtype=torch.float32,
        page_size=PAGE,
    )
    with vattention.KVCache(cfg) as kv:
        taken = [kv.alloc() for _ in range(4)]
        kv.free(taken[0])
        kv.free(taken[2])  # free: 0 and 2
        with pytest.raises(vattention.InvalidSlotError, match=r"not contiguous"):
            generate(model, ids, mask, VAttentionCache(kv), new=2)
        assert kv.active_slots() == [1, 3]


def test_a_k_only_kv_cache_is_refused_with_a_config_error():
    model = tiny_model("llama")
    ids, mask = prompts(batch=1)
    cfg = vattention.KVCacheConfig(
        **model_kv_shape(model),
        max_batch_size=1,
        max_seq_len=64,
        dtype=torch.float32,
        page_size=PAGE,
        value_cache=False,
    )
    with vattention.KVCache(cfg) as kv:
        with pytest.raises(vattention.ConfigError, match="needs value_cache=True"):
            generate(model, ids, mask, VAttentionCache(kv), new=2)


# ---- sliding windows --------------------------------------------------------------------------
WINDOW = 8
WINDOWED = {
    # family: (config class, model class, extra config, attention implementation)
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"sliding_window": WINDOW},
        "sdpa",
    ),
    "qwen2-mixed": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
        "sdpa",
    ),
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        {"sliding_window": WINDOW, "head_dim": 16},
        "eager",
    ),  # no SDPA for Gemma 2
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        {
            "sliding_window": WINDOW,
            "head_dim": 16,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
        "sdpa",
    ),
}


def windowed_model(family: str) -> torch.nn.Module:
    config_cls, model_cls, extra, attn = WINDOWED[family]
    config = config_cls(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        **extra,
    )
    config._attn_implementation = attn
    torch.manual_seed(0)
    return model_cls(config).eval()


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_sliding_window_models_match_dynamic_cache_with_memory_bounded_by_the_window(family):
    model = windowed_model(family)
    ids, mask = prompts(batch=2, length=5 * WINDOW)  # prompt longer than the window, left padded
    new = 60
    expected = generate(model, ids, mask, transformers.DynamicCache(config=model.config), new=new)
    with VAttentionCache.from_model(
        model, max_batch_size=2, max_seq_len=128, page_size=PAGE
    ) as cache:
        windows = cache.config.layer_windows
        assert [w > 0 for w in windows] == cache.is_sliding
        if family != "mistral":
            assert 0 in windows and WINDOW in windows  # mixed local/global layers
        got = generate(model, ids, mask, cache, new=new)
        seq = cache.get_seq_length()
        assert seq == ids.shape[1] + new - 1
        # Full layers hold every token; windowed ones only the pages of the last window (the
        # last step's query at seq - 1 reads keys from seq - WINDOW on).
        gone = (seq - WINDOW) // TOKENS_PER_PAGE
        full_pages = -(-seq // TOKENS_PER_PAGE)
        per_slot = sum(full_pages - (gone if w else 0) for w in windows) * 2  # K and V
        stats = cache.kv_cache.stats()
        assert stats["pages_mapped"] == 2 * per_slot
        assert gone >= 2 and stats["window_released_pages"] == 2 * 2 * gone * windows.count(WINDOW)
        for layer, w in enumerate(windows):
            start = cache.kv_cache.window_start(cache.slots[0], layer)
            assert start == (gone * TOKENS_PER_PAGE if w else 0)
            assert cache.layers[layer].keys.shape[-2] == seq - start
    assert torch.equal(got, expected)


# ---- per-layer KV shapes ----------------------------------------------------------------------
def gemma4_model(**extra) -> torch.nn.Module:
    """Tiny Gemma 4: sliding layers 2 KV heads x 16, global layers 4 KV heads x 32 (its
    ``global_head_dim`` and, with ``attention_k_eq_v``, ``num_global_key_value_heads``)."""
    args = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        attention_k_eq_v=True,
        num_global_key_value_heads=4,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=96,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    args.update(extra)
    config = transformers.Gemma4TextConfig(**args)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Gemma4ForCausalLM(config).eval()


def test_per_layer_shapes_match_dynamic_cache_with_each_layer_sized_for_itself():
    model = gemma4_model()
    assert model_kv_shape(model) == {
        "num_layers": 4,
        "num_kv_heads": (2, 4, 2, 4),
        "head_dim": (16, 32, 16, 32),
    }
    ids, mask = prompts(batch=2, length=5 * WINDOW)
    new = 60
    expected = generate(model, ids, mask, transformers.DynamicCache(config=model.config), new=new)
    with VAttentionCache.from_model(
        model, max_batch_size=2, max_seq_len=128, page_size=PAGE
    ) as cache:
        cfg = cache.config
        assert cfg.layer_windows == (WINDOW, 0, WINDOW, 0)
        # fp32 token rows of 128 and 512 bytes: a page index is 32 tokens, 1 and 4 pages a tensor.
        assert cfg.tokens_per_page == TOKENS_PER_PAGE
        assert [cfg.index_pages(i) for i in range(4)] == [1, 4, 1, 4]
        got = generate(model, ids, mask, cache, new=new)
        seq = cache.get_seq_length()
        indices = -(-seq // TOKENS_PER_PAGE)
        gone = (seq - WINDOW) // TOKENS_PER_PAGE
        for layer in range(4):
            k = cache.layers[layer].keys
            assert tuple(k.shape[1::2]) == (cfg.layer_kv_heads[layer], cfg.layer_head_dims[layer])
        per_slot = 2 * (2 * 4 * indices + 2 * 1 * (indices - gone))  # K and V
        assert cache.kv_cache.stats()["pages_mapped"] == 2 * per_slot
        assert gone >= 2
    assert torch.equal(got, expected)


def test_models_sharing_kv_between_layers_are_refused():
    with pytest.raises(
        vattention.ConfigError,
        match=r"model_type='gemma4_text' shares K/V between layers "
        r"\(num_kv_shared_layers=2\)",
    ):
        model_kv_shape(transformers.Gemma4TextConfig(num_hidden_layers=4, num_kv_shared_layers=2))


def test_from_model_reads_windows_and_refuses_models_it_cannot_serve():
    from vattention.integrations.transformers import model_windows

    assert model_windows(transformers.LlamaConfig()) is None
    assert model_windows(transformers.MistralConfig(sliding_window=4096)) == 4096
    assert model_windows(transformers.Gemma2Config(num_hidden_layers=4)) == (4096, None) * 2
    mamba = transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2)
    with pytest.raises(vattention.ConfigError, match="model_type='mamba'"):
        model_kv_shape(mamba)
    with pytest.raises(vattention.ConfigError, match="bidirectional"):
        model_windows(
            transformers.Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True)
        )
    with pytest.raises(vattention.ConfigError, match="per-layer windows need layout='layer'"):
        VAttentionCache.from_model(
            windowed_model("gemma3"),
            max_batch_size=1,
            max_seq_len=64,
            page_size=PAGE,
            layout="mega",
        )


# ---- the compileable path (transformers' compiled decoding, as for StaticCache) --------------
COMPILED_CHECK = os.path.join(os.path.dirname(__file__), "support", "hf_compiled_generate_check.py")
NO_WINDOW = {"sliding_window": None}  # Mistral without a window: views keep their shape


def compileable_model(family: str) -> torch.nn.Module:
    if family != "mistral":
        return tiny_model(family)
    config_cls, model_cls, _ = FAMILIES["mistral"]
    FAMILIES["mistral"] = (config_cls, model_cls, NO_WINDOW)
    try:
        return tiny_model("mistral")
    finally:
        FAMILIES["mistral"] = (config_cls, model_cls, {"sliding_window": 6})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_compileable_cache_uncompiled_matches_dynamic_cache_with_bucketed_views(family):
    """On the CPU transformers does not compile by default: the bucketed views and the 4D mask
    it builds for a compileable cache run eagerly, with DynamicCache's tokens."""
    model = compileable_model(family)
    ids, mask = prompts(batch=2)
    expected = generate(model, ids, mask, transformers.DynamicCache(), new=40)
    with VAttentionCache.from_model(
        model,
        max_batch_size=2,
        max_seq_len=4096,
        page_size=PAGE,
        compileable=True,
        bucket_tokens=16,
    ) as cache:
        assert cache.is_compileable and cache.kv_cache.config.scrub
        views: list[int] = []
        original = cache.layers[0].update

        def spy(k, v, *args, **kwargs):
            keys, values = original(k, v, *args, **kwargs)
            views.append(keys.shape[-2])
            return keys, values

        cache.layers[0].update = spy
        got = generate(model, ids, mask, cache, new=40)
        assert cache.get_seq_length() == 7 + 40 - 1 == 46
        # the prefill (7 tokens) and the forwards ending at 8..16 see bucket 16, those ending
        # at 17..32 bucket 32, at 33..46 bucket 48
        assert views == [16] * 10 + [32] * 16 + [48] * 14
        # memory: the last bucket's pages (48 tokens: 2 pages of 32) per K/V tensor of each row
        assert cache.memory_bytes() == 2 * PAGE * (2 * 2 * 2)
    assert torch.equal(got, expected)


def test_compileable_cache_beam_search_matches_dynamic_cache():
    """reorder_cache permutes the tokens present (not the bucket) of the compileable cache."""
    model = tiny_model("llama")
    ids, mask = prompts(batch=2)
    beams = {"max_new_tokens": 12, "num_beams": 3, "do_sample": False}
    expected = model.generate(
        ids, attention_mask=mask, past_key_values=transformers.DynamicCache(), **beams
    )
    with VAttentionCache.from_model(
        model,
        max_batch_size=6,
        max_seq_len=64,
        page_size=PAGE,
        compileable=True,
        bucket_tokens=8,
    ) as cache:  # 2 prompts x 3 beams; buckets of 8 tokens: 7 + 11 fed back crosses two
        got = model.generate(ids, attention_mask=mask, past_key_values=cache, **beams)
        assert cache.get_seq_length() == 18 and cache.view_len == 24
    assert torch.equal(got, expected)


def run_compiled_check(
    case: str, family: str, layout: str = "layer"
) -> subprocess.CompletedProcess[str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, COMPILED_CHECK, case, family, layout],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def compiled_check(case: str, family: str, layout: str = "layer") -> dict:
    proc = run_compiled_check(case, family, layout)
    if proc.returncode == -signal.SIGSEGV:
        pytest.fail("the compiled generate read unmapped cache memory\n" + proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["layer", "mega"])
def test_compiled_generate_matches_dynamic_cache_in_one_graph_per_compile(layout):
    """Inductor, fullgraph, transformers' default dynamic=None, three buckets (16, 32, 48):
    DynamicCache's tokens, no graph break, two compiles (the second makes the length symbolic),
    every view within the mapped pages (max_seq_len 4096 is virtual: reading past the buckets
    would fault), and the pages of the last bucket held, exactly."""
    r = compiled_check("inductor", "llama", layout)
    assert r["tokens_equal"] and r["graph_breaks"] == 0
    assert r["buckets"] == [16, 32, 48] and r["graphs"] == 2
    assert r["views_within_mapped"] and r["forwards"] == 40 and r["seq_len"] == 46
    # 48 tokens: 2 pages of 32 per K/V tensor of each layer and row (layer); 3 pages of 16
    # tokens of both layers per K/V tensor of each row (mega)
    pages = {"layer": 2 * (2 * 2 * 2), "mega": 3 * (2 * 2)}[layout]
    assert r["bytes_mapped"] == r["bytes_of_bucket_pages"] == pages * PAGE


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_compiled_generate_compiles_once_per_bucket_with_static_shapes(family):
    """dynamic=False (dynamo alone, so that the compiles are cheap): one graph per bucket."""
    r = compiled_check("buckets", family)
    assert r["tokens_equal"] and r["graph_breaks"] == 0
    assert r["buckets"] == [16, 32, 48] and r["graphs"] == 3
    assert r["views_within_mapped"] and r["bytes_mapped"] == r["bytes_of_bucket_pages"]


def test_compiled_chunked_prefill_after_early_initialization():
    """prefill_chunk_size makes transformers compile the prefill chunks too: with the slots
    claimed first (early_initialization), every forward is compiled, without a graph break, and
    the tokens are DynamicCache's with the same chunks."""
    r = compiled_check("chunked", "llama")
    assert r["tokens_equal"] and r["graph_breaks"] == 0
    # chunks of 4 and 3 tokens, then single tokens: one graph per (query length, bucket)
    assert r["buckets"] == [16, 32, 48] and r["graphs"] == 5 and r["views_within_mapped"]
    assert r["forwards"] == 41 and r["bytes_mapped"] == r["bytes_of_bucket_pages"]


def test_a_compiled_view_past_the_mapped_pages_is_caught_by_a_fault():
    """The control for the checks above: views (and mask) one page longer than prepare_forward
    mapped make the compiled generate die of SIGSEGV, with the cache's fault report."""
    import signal

    proc = run_compiled_check("overread", "llama")
    assert proc.returncode == -signal.SIGSEGV, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "that position has no physical page" in proc.stderr


def test_prepare_forward_maps_a_bucket_once_and_is_idempotent_before_the_forward():
    model = tiny_model("llama")
    ids, mask = prompts(batch=2)
    with VAttentionCache.from_model(
        model,
        max_batch_size=2,
        max_seq_len=64,
        page_size=PAGE,
        compileable=True,
        bucket_tokens=16,
    ) as cache:
        generate(model, ids, mask, cache, new=3)  # 7 + 2 fed back = 9 tokens, bucket 16
        assert cache.get_seq_length() == 9 and cache.view_len == 16
        assert cache.prepare_forward(8) == 32  # 9 + 8 = 17 tokens: the next bucket, mapped
        assert cache.prepare_forward(8) == 32 and cache.get_seq_length() == 9
        assert all(cache.kv_cache.mapped_tokens(s) == 32 for s in cache.slots)
        assert cache.get_mask_sizes(8, 0) == (32, 0)
        with pytest.raises(vattention.SequenceTooLongError, match="9 cached \\+ 56 new tokens"):
            cache.prepare_forward(56)
        assert cache.get_seq_length() == 9 and cache.view_len == 32
        cache.crop(-4)
        assert cache.get_seq_length() == 5


def test_compileable_refuses_what_its_views_cannot_serve():
    model = tiny_model("llama")
    cfg = vattention.KVCacheConfig(
        **model_kv_shape(model),
        max_batch_size=2,
        max_seq_len=64,
        dtype=torch.float32,
        page_size=PAGE,
    )
    with vattention.KVCache(cfg) as kv:
        with pytest.raises(vattention.ConfigError, match="build the KVCache with scrub=True"):
            VAttentionCache(kv, compileable=True)
        with pytest.raises(vattention.ConfigError, match="compileable=True"):
            VAttentionCache(kv).prepare_forward(1)
    with pytest.raises(vattention.ConfigError, match="sliding_window=6 < max_seq_len=64"):
        VAttentionCache.from_model(
            tiny_model("mistral"),
            max_batch_size=1,
            max_seq_len=64,
            page_size=PAGE,
            compileable=True,
        )
    with pytest.raises(vattention.ConfigError, match="bucket_tokens=0 must be >= 1"):
        VAttentionCache.from_model(
            model,
            max_batch_size=1,
            max_seq_len=64,
            page_size=PAGE,
            compileable=True,
            bucket_tokens=0,
        )
    with pytest.raises(vattention.ArgumentTypeError, match="bucket_tokens=16.0 must be an int"):
        VAttentionCache.from_model(
            model,
            max_batch_size=1,
            max_seq_len=64,
            page_size=PAGE,
            compileable=True,
            bucket_tokens=16.0,
        )
