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
