"""Which CUDA backend the tests run: the real driver, the strict EMULATION, or none (and why).

Imported by conftest.py before any test creates a cache: the driver library is loaded once per
process, so VATTENTION_LIBCUDA must point at the emulation before the first CUDA backend exists.
Test modules import CUDA_MODE from here (not from conftest, whose module name is ambiguous),
as ``support.cuda_setup``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cuda_emulator"))
import emu as cuda_emu  # noqa: E402  (tests/cuda_emulator/emu.py: the CUDA driver EMULATION)

import vattention  # noqa: E402

GPU_MIN_PAGE = 2 << 20  # VMM granularity of real GPUs


def have_gpu() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


def _cuda_mode() -> tuple[str, str]:
    """("gpu" | "emulated" | "", reason it is unavailable).

    A real driver is used when VATTENTION_LIBCUDA names one, or when it is unset and torch sees a
    GPU; otherwise the backend is pointed at the emulation.
    """
    lib = os.environ.get("VATTENTION_LIBCUDA", "")
    if (lib and "cuda_emu" not in lib) or (not lib and have_gpu()):
        mode = "gpu"
    else:
        reason = cuda_emu.unavailable_reason()
        if reason:
            return "", reason
        os.environ["VATTENTION_LIBCUDA"] = str(cuda_emu.LIB_PATH)
        mode = "emulated"
    reason = vattention._C.backend_unavailable_reason("cuda")
    if reason:
        return "", reason
    if mode == "emulated":
        cuda_emu.Emulator.load().reset_for_suite()  # 64 KB granularity, see emu.py
    return mode, ""


CUDA_MODE, CUDA_REASON = _cuda_mode()
# The smallest page the "cuda" device takes: a real GPU's granularity, or the emulation's (64 KB
# in the suite; 2 MB when VAEMU_SUITE_GRANULARITY sets a GPU's, as the GPU check's emulated run
# does). Cases with smaller pages skip, as on a GPU.
CUDA_PAGE_FLOOR = GPU_MIN_PAGE if CUDA_MODE == "gpu" else cuda_emu.SUITE_GRANULARITY
# Whether the "cuda" device is a GPU's or behaves like one here: the cases marked not_on_gpu
# (conftest.py) skip.
GPU_LIKE = CUDA_PAGE_FLOOR >= GPU_MIN_PAGE


def skip_below_gpu_pages(device: str, page_size) -> None:
    """Skips the test where the cuda device takes only a GPU's pages (GPU_LIKE) and this case's
    are smaller: a limit of the harness's parameters, not of the backend."""
    if GPU_LIKE and device.startswith("cuda"):
        if vattention.config.parse_size(page_size) < GPU_MIN_PAGE:
            pytest.skip("real GPUs need pages of at least 2 MB (VMM granularity)")
