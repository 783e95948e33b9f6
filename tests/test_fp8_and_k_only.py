"""fp8 KV dtypes and K-only caches (value_cache=False): every path on both backends."""

from __future__ import annotations

import pytest
import torch

import vattention
import vattention.integrations.original_api as vattn

from support.helpers import kv_views
from support.share_helpers import bits

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def fill(cache, slot, start, end, seed):
    """Random bytes in tokens [start, end) of every tensor of `slot`; returns them per layer."""
    gen = torch.Generator().manual_seed(seed)
    cfg = cache.config
    written = []
    for layer in range(cfg.num_layers):
        pair = []
        for tensor in kv_views(cache, layer):
            if tensor is None:
                pair.append(None)
                continue
            raw = torch.randint(
                0,
                127,
                (end - start, cfg.layer_kv_heads[layer], cfg.layer_head_dims[layer]),
                generator=gen,
                dtype=torch.uint8,
            )  # no NaN bit patterns
            data = raw.view(cfg.dtype) if cfg.element_bytes == 1 else raw.to(cfg.dtype)
            tensor[slot, start:end] = data.to(tensor.device)
            pair.append(data)
        written.append(pair)
    return written


def check(cache, slot, start, end, written):
    for layer, pair in enumerate(written):
        for tensor, data in zip(kv_views(cache, layer), pair):
            assert (tensor is None) == (data is None)
            if tensor is not None:
                got = bits(tensor[slot, start:end].cpu())
                assert torch.equal(got, bits(data)), f"layer {layer}"


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_tensors_are_zero_copy_views_of_the_reservation(make_cache, dtype):
    cache = make_cache(dtype=dtype, max_seq_len=1024)
    cfg = cache.config
    assert cfg.element_bytes == 1 and cfg.bytes_per_token == 2 * 2 * 2 * 64
    for layer in range(cfg.num_layers):
        k, v = kv_views(cache, layer)  # host-memory views over the same addresses on the emulation
        assert k.dtype == v.dtype == dtype
        assert (k.data_ptr(), v.data_ptr()) == cache.layer_ptrs(layer)
        assert tuple(k.shape) == (4, 1024, 2, 64) and k.stride()[-1] == 1
    slot = cache.alloc()
    cache.step({slot: 300})
    written = fill(cache, slot, 0, 300, seed=1)
    check(cache, slot, 0, 300, written)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_fork_and_swap_are_bit_identical(make_cache, dtype):
    cache = make_cache(dtype=dtype, max_seq_len=1024)
    src = cache.alloc()
    cache.step({src: 777})
    written = fill(cache, src, 0, 777, seed=2)
    child = cache.fork(src)
    check(cache, child, 0, 777, written)
    handle = cache.swap_out(src)
    back = cache.swap_in(handle)
    check(cache, back, 0, 777, written)


def test_fp8_by_name_and_through_the_original_api():
    cfg = vattention.KVCacheConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=64,
        max_batch_size=1,
        max_seq_len=64,
        dtype="float8_e5m2",
        page_size="4KB",
    )
    assert cfg.dtype == torch.float8_e5m2
    k, v = vattn.init_kvcache(2, 1, 64, 2, 64, "cpu", torch.float8_e4m3fn, 4096)[0::2]
    try:
        assert k.dtype == v.dtype == torch.float8_e4m3fn
    finally:
        vattn.cleanup()


def test_k_only_cache_reserves_and_maps_one_tensor_per_layer(make_cache, layout):
    # DeepSeek-style MLA latent: one "head" of kv_lora_rank + rope_dim = 512 + 64 elements.
    cache = make_cache(
        num_layers=3, num_kv_heads=1, head_dim=576, max_seq_len=2048, value_cache=False
    )
    cfg = cache.config
    assert cfg.num_tensors == (3 if layout == "layer" else 1)
    assert cfg.bytes_per_token == 3 * 576 * 2
    k, v = kv_views(cache, 2)
    assert v is None and tuple(k.shape) == (4, 2048, 1, 576)
    assert cache.layer_ptrs(0)[1] == 0
    if cache.config.device == "cpu":
        assert cache.v_cache == [None] * 3
        if layout == "mega":
            mk, mv = cache.mega_tensors()
            assert mv is None and tuple(mk.shape) == (4, 2048, 3, 1, 576)
    slot = cache.alloc()
    cache.step({slot: 1000})
    # the row maps its read end (1024 with the tile rule: CUDA's default), backing 1000 tokens
    mapped = -(-cfg.read_end(1000) * cfg.tensor_token_bytes // cfg.page_bytes)
    assert cache.stats()["pages_mapped"] == cfg.num_tensors * mapped
    assert cache.stats()["bytes_used_by_tokens"] == 1000 * cfg.bytes_per_token
    assert cfg.pages_for_tokens(1000) == cfg.num_tensors * mapped  # what the row maps
    written = fill(cache, slot, 0, 1000, seed=3)
    check(cache, slot, 0, 1000, written)
    with pytest.raises(vattention.ConfigError, match="value_cache=False"):
        cache._core.export_tensor(1, 0, 1, 8)


def test_k_only_cache_forks_swaps_and_windows(make_cache, layout):
    cache = make_cache(
        num_kv_heads=1, head_dim=576, max_seq_len=4096, value_cache=False, sliding_window=512
    )
    src = cache.alloc()
    cache.step({src: 1500})
    written = fill(cache, src, 0, 1500, seed=4)
    child = cache.fork(src)
    check(cache, child, 0, 1500, written)
    handle = cache.swap_out(child)
    back = cache.swap_in(handle)
    check(cache, back, 0, 1500, written)
    cache.step({src: 1501})
    start = cache.window_start(src, 0)
    check(cache, src, start, 1500, [[k[start:], None] for k, _ in written])


def test_value_cache_must_be_a_bool():
    with pytest.raises(vattention.ConfigError, match="value_cache=0 must be True or False"):
        vattention.KVCacheConfig(
            num_layers=1,
            num_kv_heads=1,
            head_dim=64,
            max_batch_size=1,
            max_seq_len=64,
            dtype=torch.float16,
            value_cache=0,
        )
