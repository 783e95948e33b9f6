"""GPU-only tests (``pytest -m gpu``): they need a real NVIDIA driver and device, and skip here.

A real GPU means: torch sees CUDA, and vattention's CUDA backend is not pointed at the test
emulation (``VATTENTION_LIBCUDA`` unset or naming a real driver).
"""

from __future__ import annotations

import os

import pytest


def real_gpu_reason() -> str:
    """ "" when a real GPU is usable, else why these tests skip."""
    lib = os.environ.get("VATTENTION_LIBCUDA", "")
    if "cuda_emu" in lib:
        return "VATTENTION_LIBCUDA points at the CUDA emulation, not a real driver"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch (CPU-only torch or no GPU)"
    return ""


@pytest.fixture
def gpu():
    """The device string of the real GPU, or skip."""
    reason = real_gpu_reason()
    if reason:
        pytest.skip(reason)
    return "cuda:0"
