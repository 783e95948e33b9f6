"""The emulated run's stand-in for a GPU's one-device rule: a cache tensor and a CPU tensor mixed in
one torch call raise, as they do on a GPU.

On the CUDA driver emulation the cache's memory is host memory, read through ``host_alias`` as
CPU tensors, so a test comparing it with a CPU tensor passes here and fails on every GPU
("Expected all tensors to be on the same device"; 39 cuda cases did on the first real run). So
``kv_views`` hands out :class:`DeviceView` tensors on the emulation, and while :class:`OneDevice`
is active (the cuda cases a GPU runs: conftest.py) a torch call that mixes one with a CPU tensor
of one element or more raises the GPU's error. What a GPU allows is allowed here too:

- writing CPU data into a cache tensor (``view[i] = cpu``, ``copy_``), indexing one with CPU
  indices, CPU scalars (0-dim tensors) in any operation;
- moving data to the cache's device: ``cpu.to(view.device)``, ``torch.zeros(..., device=
  view.device)`` (a view's ``.device`` is a marked ``cpu`` device that this mode recognises), and
  back: ``view.cpu()``, ``view.to("cpu")`` give ordinary CPU tensors.

``view.numpy()`` raises, as for a CUDA tensor. Without the mode a DeviceView is a CPU tensor like
any other (the cuda cases a GPU does not run read host memory on purpose).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

# What DeviceView.device returns: the cache's device on the emulation. A CPU device by value (so
# torch accepts it), recognised by identity when data is moved "to the cache's device".
CACHE_DEVICE = torch.device("cpu")

# Calls that may mix a cache tensor with CPU tensors on a GPU.
_CROSS_DEVICE = {
    torch.Tensor.copy_,
    torch.Tensor.__setitem__,
    torch.Tensor.__getitem__,
    torch.Tensor.to,
    torch.Tensor.cpu,
    torch.Tensor.cuda,
}


class DeviceView(torch.Tensor):
    """A cache tensor on the emulation: host memory standing for device memory. What a call on
    one returns is a DeviceView too, but for a move to the CPU."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return CACHE_DEVICE

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs)
        if _target(func, args, kwargs or {}) == "cpu":
            return tree_map(lambda t: t.as_subclass(torch.Tensor) if _is_view(t) else t, out)
        return out


def as_device_view(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.as_subclass(DeviceView)


def _is_view(t: Any) -> bool:
    return isinstance(t, DeviceView)


def _plain(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, DeviceView)


def _tensors(args, kwargs):
    """The tensors among the arguments, one level into lists and tuples (torch.cat's)."""
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            yield from (t for t in x if isinstance(t, torch.Tensor))


def _target(func, args, kwargs) -> str:
    """Where a move or a factory puts its result: "cache", "cpu" or "" (not a move)."""
    if func is torch.Tensor.cpu:
        return "cpu"
    if func is torch.Tensor.cuda:
        return "cache"
    device = kwargs.get("device")
    candidates = (*args[1:], device) if func is torch.Tensor.to else (device,)
    for c in candidates:
        if c is CACHE_DEVICE or (func is torch.Tensor.to and _is_view(c)):
            return "cache"
        if isinstance(c, (str, torch.device)) or (func is torch.Tensor.to and _plain(c)):
            return "cpu"
    return ""


class OneDevice(TorchFunctionMode):
    """Raises where a torch call mixes a DeviceView with CPU data, as a GPU does."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if DeviceView in types:
            if func is torch.Tensor.numpy:
                raise TypeError(
                    "can't convert a cache tensor (device memory on a GPU) to numpy: use .cpu() "
                    "first (emulated one-device check)"
                )
            if func not in _CROSS_DEVICE and any(
                _plain(t) and t.dim() > 0 for t in _tensors(args, kwargs)
            ):
                raise RuntimeError(
                    "Expected all tensors to be on the same device: "
                    f"{getattr(func, '__name__', func)} mixes a cache tensor (device memory on a "
                    "GPU) with a CPU tensor. Move the CPU side to the cache's device "
                    "(.to(view.device)) or both to the CPU (emulated one-device check, "
                    "tests/support/one_device.py)"
                )
        out = func(*args, **kwargs)
        moves = func is torch.Tensor.to or func is torch.Tensor.cuda or "device" in kwargs
        if moves and _target(func, args, kwargs) == "cache":  # CPU data to the cache's device
            return tree_map(lambda t: t.as_subclass(DeviceView) if _plain(t) else t, out)
        return out
