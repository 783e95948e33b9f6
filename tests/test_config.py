"""KVCacheConfig validation and derived sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import vattention
from vattention import ConfigError, KVCacheConfig, parse_size

BASE = dict(
    num_layers=32,
    num_kv_heads=8,
    head_dim=128,
    max_batch_size=8,
    max_seq_len=4096,
    dtype=torch.bfloat16,
)


def test_parse_size_units():
    assert parse_size(4096) == 4096
    assert parse_size("64KB") == 64 << 10
    assert parse_size("64kib") == 64 << 10
    assert parse_size("2MB") == 2 << 20
    assert parse_size("1.5GB") == 3 << 29
    assert parse_size("0") == 0


@pytest.mark.parametrize("bad", ["2XB", "", "-5MB", "MB", 2.5, None, True, -1])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError, match="size"):
        parse_size(bad)


def test_derived_sizes_layer_layout():
    cfg = KVCacheConfig(**BASE)
    assert cfg.page_bytes == 2 << 20
    assert cfg.element_bytes == 2
    assert cfg.bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert cfg.tensor_token_bytes == 8 * 128 * 2
    assert cfg.tokens_per_page == 1024
    assert cfg.num_tensors == 64
    assert cfg.slot_bytes == 4096 * 2048
    assert cfg.virtual_bytes == 64 * 8 * 4096 * 2048
    assert cfg.pages_for_tokens(1) == 64 and cfg.pages_for_tokens(1025) == 128


def test_derived_sizes_mega_layout():
    cfg = KVCacheConfig(**BASE, layout="mega")
    assert cfg.tensor_token_bytes == 32 * 8 * 128 * 2
    assert cfg.tokens_per_page == 32
    assert cfg.num_tensors == 2
    assert cfg.pages_for_tokens(33) == 4


def test_slot_stride_padded_to_page_multiple():
    cfg = KVCacheConfig(**{**BASE, "max_seq_len": 1000})
    assert cfg.slot_bytes % cfg.page_bytes == 0 and cfg.slot_bytes >= 1000 * cfg.tensor_token_bytes


def test_config_is_frozen_and_keyword_only():
    cfg = KVCacheConfig(**BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 3
    with pytest.raises(TypeError):
        KVCacheConfig(32, 8, 128, 8, 4096, torch.bfloat16)


@pytest.mark.parametrize(
    "field", ["num_layers", "num_kv_heads", "head_dim", "max_batch_size", "max_seq_len"]
)
@pytest.mark.parametrize("value", [0, -3])
def test_nonpositive_dimensions_rejected(field, value):
    with pytest.raises(ConfigError, match=f"{field}={value}.*>= 1"):
        KVCacheConfig(**{**BASE, field: value})


def test_tokens_per_page_below_one_rejected():
    with pytest.raises(ConfigError, match=r"1024 bytes.*2048 bytes.*tokens_per_page would be < 1"):
        KVCacheConfig(**{**BASE, "page_size": "1KB"})
    assert KVCacheConfig(**BASE, layout="mega", page_size="64KB").tokens_per_page == 1
    with pytest.raises(ConfigError, match="tokens_per_page"):
        KVCacheConfig(**BASE, layout="mega", page_size="32KB")


def test_bad_dtype_layout_device():
    with pytest.raises(ConfigError, match="dtype"):
        KVCacheConfig(**{**BASE, "dtype": torch.complex64})
    with pytest.raises(ConfigError, match="layout='paged'"):
        KVCacheConfig(**BASE, layout="paged")
    with pytest.raises(ConfigError, match="device='tpu'"):
        KVCacheConfig(**BASE, device="tpu")
    assert KVCacheConfig(**{**BASE, "dtype": "float16"}).dtype == torch.float16
    assert KVCacheConfig(**BASE, device="cuda").device == "cuda:0"


def test_page_size_not_multiple_of_granularity_rejected():
    cfg = KVCacheConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=64,
        max_batch_size=1,
        max_seq_len=64,
        dtype=torch.float16,
        page_size=6000,
    )
    with pytest.raises(ConfigError, match=r"page_size=6000 bytes is not a positive multiple.*4096"):
        vattention.KVCache(cfg)


@pytest.mark.parametrize(
    "field",
    ["num_layers", "num_kv_heads", "head_dim", "max_batch_size", "max_seq_len", "lookahead_tokens"],
)
def test_values_beyond_the_core_are_config_errors_naming_field_and_limit(field):
    # Once pybind11's "incompatible constructor arguments" TypeError leaked through here.
    with pytest.raises(ConfigError, match=rf"{field}=1180591620717411303424 exceeds.*2\*\*63 - 1"):
        KVCacheConfig(**{**BASE, field: 2**70})


def test_a_cache_too_large_for_the_address_space_is_a_config_error():
    with pytest.raises(
        ConfigError, match=r"max_batch_size=4611686018427387904.*limit is 65536 GiB"
    ):
        KVCacheConfig(**{**BASE, "max_batch_size": 2**62})


def test_config_pickles_and_compares_by_value():
    import pickle

    cfg = KVCacheConfig(**BASE)
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and hash(again) == hash(cfg)
    assert again.geometry.virtual_bytes == cfg.virtual_bytes
