"""vattention.integrations.original_api: the original library's function-level API over KVCache."""

from __future__ import annotations

import pytest
import torch

import vattention
import vattention.integrations.original_api as vattn

PAGE = 4096  # 64 float32 head dims x 1 head = 256 B per token row -> 16 tokens per page


@pytest.fixture(autouse=True)
def _fresh():
    vattn.cleanup()
    yield
    vattn.cleanup()


def init(layers=2, batch=3, context=128, megacache=False):
    return vattn.init_kvcache(
        layers, 1, 64, batch, context, "cpu", torch.float32, PAGE, megacache=megacache
    )


def test_init_returns_k_tensors_then_v_tensors():
    tensors = init(layers=3)
    cache = vattn.get_cache()
    assert len(tensors) == 6
    assert all(t.shape == (3, 128, 1, 64) for t in tensors)
    assert [t.data_ptr() for t in tensors] == [
        t.data_ptr() for t in list(cache.k_cache) + list(cache.v_cache)
    ]


def test_megacache_returns_one_k_and_one_v_sharing_memory_with_layer_views():
    k, v = init(layers=3, megacache=True)
    cache = vattn.get_cache()
    assert k.shape == v.shape == (3, 128, 3, 1, 64)
    slot = vattn.alloc_new_batch_idx(4)
    vattn.step([4 if i == slot else 0 for i in range(3)])
    k[slot, :4, 2] = 7.0
    assert torch.equal(cache.layer(2)[0][slot, :4], torch.full((4, 1, 64), 7.0))


def test_alloc_step_free_cycle_maps_pages_for_seq_lens():
    init()
    a, b = vattn.alloc_new_batch_idx(10), vattn.alloc_new_batch_idx(40)
    assert {a, b} == {0, 1}
    lens = [0, 0, 0]
    lens[a], lens[b] = 10, 40
    vattn.step(lens)
    cache = vattn.get_cache()
    assert (cache.mapped_tokens(a), cache.mapped_tokens(b)) == (16, 48)
    assert cache.stats()["pages_mapped"] == (1 + 3) * 4  # 4 tensors (2 layers, K+V)
    vattn.free_batch_idx(a)
    assert vattn.alloc_new_batch_idx(1) == a  # keeps its mapped pages
    assert vattn.alloc_new_batch_idx(1) == 2
    assert vattn.alloc_new_batch_idx(1) == -1  # no free index


def test_eager_reclaim_unmaps_free_indices():
    init()
    idx = vattn.alloc_new_batch_idx(20)
    vattn.step([20 if i == idx else 0 for i in range(3)])
    vattn.free_batch_idx(idx)
    cache = vattn.get_cache()
    assert cache.stats()["pages_mapped"] == 2 * 4  # deferred: still mapped
    vattn.step([0, 0, 0], eager_reclaim=True)
    assert cache.stats()["pages_mapped"] == 0


def test_set_deferred_reclamation_false_returns_pages_on_free():
    init()
    vattn.set_deferred_reclamation(False)
    idx = vattn.alloc_new_batch_idx(20)
    vattn.step([20 if i == idx else 0 for i in range(3)])
    vattn.free_batch_idx(idx)
    assert vattn.get_cache().stats()["pages_mapped"] == 0


def test_num_free_kvblocks_counts_pool_and_overcommitted_pages():
    init()
    assert vattn.reserve_physical_pages(12 * PAGE) == 12
    assert vattn.num_free_kvblocks() == 3  # 12 pages / 4 tensors
    idx = vattn.alloc_new_batch_idx(20)
    vattn.step([20 if i == idx else 0 for i in range(3)])  # 2 blocks mapped
    assert vattn.num_free_kvblocks() == 1
    vattn.free_batch_idx(idx)  # mapped but reclaimable
    assert vattn.num_free_kvblocks() == 3


def test_step_async_backs_the_next_token_too():
    init()
    idx = vattn.alloc_new_batch_idx(16)
    vattn.step_async([16 if i == idx else 0 for i in range(3)])
    cache = vattn.get_cache()
    cache.wait()
    assert cache.mapped_tokens(idx) == 32  # 17 tokens -> 2 pages


def test_step_rejects_lengths_for_unallocated_indices_and_wrong_size():
    init()
    with pytest.raises(vattention.InvalidSlotError, match=r"\[1\]"):
        vattn.step([0, 5, 0])
    with pytest.raises(vattention.InvalidSlotError, match="max_batch_size=3"):
        vattn.step([0, 0])


def test_out_of_pages_is_recoverable_and_maps_nothing():
    init()
    cache = vattn.get_cache()
    cache.set_memory_budget(8 * PAGE)
    a, b = vattn.alloc_new_batch_idx(16), vattn.alloc_new_batch_idx(32)
    lens = [0, 0, 0]
    lens[a], lens[b] = 16, 32  # needs 4 + 8 pages
    with pytest.raises(vattention.OutOfPagesError):
        vattn.step(lens)
    assert cache.stats()["pages_mapped"] == 0
    lens[b] = 0
    vattn.step(lens)
    assert cache.stats()["pages_mapped"] == 4


def test_double_free_and_calls_before_init_raise():
    with pytest.raises(vattention.VAttentionError, match="init_kvcache"):
        vattn.num_free_kvblocks()
    init()
    idx = vattn.alloc_new_batch_idx(1)
    vattn.free_batch_idx(idx)
    with pytest.raises(vattention.InvalidSlotError):
        vattn.free_batch_idx(idx)


def test_show_functions_print_config_and_allocator_table(capsys):
    init()
    idx = vattn.alloc_new_batch_idx(20)
    vattn.step([20 if i == idx else 0 for i in range(3)])
    config = vattn.show_kvcache_config()
    state = vattn.show_allocator_state()
    printed = capsys.readouterr().out
    assert "Num layers: 2" in config and "Tokens per page: 16" in config
    assert state.splitlines()[2 + idx].split() == [f"{idx}:", "20", ":", "2", ":", "2"]
    assert config in printed and state in printed


def test_device_ordinal_means_cuda():
    assert vattn._device_name(0) == "cuda:0" and vattn._device_name("cpu") == "cpu"
