"""support/one_device.py: on the emulation, a cache tensor mixed with a CPU tensor in one torch call
raises as it does on a GPU, and what a GPU allows (writes of CPU data, scalars, moves to the
cache's device and back) is allowed. Plain CPU tensors stand for the cache's here."""

from __future__ import annotations

import pytest
import torch

from support.one_device import DeviceView, OneDevice, as_device_view

SAME_DEVICE = "Expected all tensors to be on the same device"


@pytest.fixture
def view():
    return as_device_view(torch.arange(12, dtype=torch.float32).view(3, 4))


@pytest.mark.parametrize(
    "mix",
    [
        lambda v, c: torch.equal(v, c),
        lambda v, c: v + c,
        lambda v, c: v == c,
        lambda v, c: torch.cat([v, c]),
        lambda v, c: torch.nn.functional.scaled_dot_product_attention(
            c.view(1, 1, 3, 4), v.view(1, 1, 3, 4), v.view(1, 1, 3, 4)
        ),
    ],
)
def test_a_cache_tensor_mixed_with_a_cpu_tensor_raises_as_on_a_gpu(view, mix):
    cpu = torch.arange(12, dtype=torch.float32).view(3, 4)
    mix(view, cpu)  # without the mode: host memory, nothing to see
    with OneDevice(), pytest.raises(RuntimeError, match=SAME_DEVICE):
        mix(view, cpu)


def test_assert_close_of_a_cache_tensor_and_a_cpu_tensor_fails(view):
    cpu = torch.arange(12, dtype=torch.float32).view(3, 4)
    with OneDevice(), pytest.raises(RuntimeError, match="unexpected exception"):
        torch.testing.assert_close(view, cpu)  # raised inside, wrapped by assert_close
    with OneDevice():
        torch.testing.assert_close(view.cpu(), cpu)


def test_what_a_gpu_allows_is_allowed(view):
    cpu = torch.arange(12, dtype=torch.float32).view(3, 4)
    with OneDevice():
        view[0] = cpu[1]  # a write of CPU data
        view.copy_(cpu)
        assert bool((view == 0).any()) and float(view.sum()) == 66.0  # scalars, reductions
        assert view[torch.tensor([2])].shape == (1, 4)  # CPU indices
        assert float((view + torch.tensor(1.0)).sum()) == 78.0  # a 0-dim CPU tensor
        moved = cpu.to(view.device)  # to the cache's device
        assert type(moved) is DeviceView and torch.equal(view, moved)
        assert type(torch.zeros(3, 4, device=view.device)) is DeviceView
        back = view.cpu()  # and back
        assert type(back) is torch.Tensor and torch.equal(back, cpu)
        assert type(view.to("cpu")) is torch.Tensor and type(view[1:].float()) is DeviceView


def test_a_cache_tensor_has_no_numpy_view_under_the_mode(view):
    with OneDevice():
        with pytest.raises(TypeError, match="numpy"):
            view.numpy()
        assert view.cpu().numpy().shape == (3, 4)
    assert view.numpy().shape == (3, 4)  # without it, host memory like any CPU tensor's
