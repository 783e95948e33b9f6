"""An optional folder of wheels for the GPU check: FlashAttention-4 and what it needs, brought by
the user to a machine with no network (``GPU_CHECK_WHEELS=DIR make gpu-check``).

The wheels are installed with ``pip install --no-deps --no-index --target TARGET`` into a folder
of the check's own (never the interpreter's site-packages, never the network), and the parts add
TARGET with ``site.addsitedir`` (fa4_measure.load_fa4), which reads its ``.pth`` files: the
``nvidia-cutlass-dsl`` meta wheel puts the ``cutlass`` package on the path through one. The set
that imports ``flash_attn.cute`` for FA4 4.0.0b36 on Python 3.12 with a CUDA 13 torch is
WHEEL_SET (docs/cuda.md, "FlashAttention-4 on a GPU machine without network").

    python benchmarks/gpu/fa4_wheels.py DIR TARGET   # what check.py runs
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Tuple

# Read from the wheels' METADATA (pip download --no-deps, 2026-11-28): flash-attn-4 4.0.0b36
# needs nvidia-cutlass-dsl>=4.6.2, apache-tvm-ffi>=0.1.11,<0.2, torch-c-dlpack-ext,
# quack-kernels>=0.5.3, einops, typing_extensions, torch; nvidia-cutlass-dsl-libs-base and -core
# need cuda-bindings>=12.8 and protobuf>=4.21.12 (the GPU machine's Python has those, torch and
# typing_extensions). The meta wheel names -libs-cu12 and, with its cu13 extra, -libs-cu13: for a
# CUDA 13 torch bring -libs-cu13.
WHEEL_SET = (
    "flash_attn_4-4.0.0b36-py3-none-any.whl",
    "nvidia_cutlass_dsl-4.8.1-py3-none-any.whl",
    "nvidia_cutlass_dsl_libs_core-4.8.1-py3-none-any.whl",
    "nvidia_cutlass_dsl_libs_base-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl",
    "nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl",
    "apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
    "torch_c_dlpack_ext-0.1.5-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
    "quack_kernels-0.6.5-py3-none-any.whl",
    "einops-0.8.2-py3-none-any.whl",
)


def _fingerprint(wheels: list) -> str:
    h = hashlib.sha256()
    for w in wheels:
        h.update(f"{w.name} {w.stat().st_size}\n".encode())
    return h.hexdigest()


def install(folder: Path, target: Path) -> Tuple[bool, str]:
    """Installs every wheel of ``folder`` into ``target`` (offline, no dependencies resolved), or
    keeps an earlier install of the same wheels. Returns (ok, one line saying what happened)."""
    if not folder.is_dir():
        return False, f"GPU_CHECK_WHEELS={folder}: not a folder"
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        return False, f"GPU_CHECK_WHEELS={folder}: no .whl file in it"
    stamp = target / ".vattention-wheels"
    print_ = ", ".join(w.name.split("-")[0] + " " + w.name.split("-")[1] for w in wheels)
    lacking = missing(folder)
    if lacking:  # other versions may do; if not, FA4's import in the part says which one failed
        print_ += f" (not the WHEEL_SET's {', '.join(lacking)})"
    if stamp.exists() and stamp.read_text() == _fingerprint(wheels):
        return True, f"{len(wheels)} wheels from {folder} already in {target}: {print_}"
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--upgrade"]
    cmd += ["--disable-pip-version-check", "--target", str(target), *map(str, wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["?"])[-1]
        return False, f"pip install --no-deps --no-index --target {target} failed: {last[:300]}"
    stamp.write_text(_fingerprint(wheels))
    return True, f"{len(wheels)} wheels from {folder} installed into {target}: {print_}"


def missing(folder: Path) -> list:
    """The wheels of WHEEL_SET that ``folder`` lacks (for the report; others may do as well)."""
    have = {w.name for w in folder.glob("*.whl")} if folder.is_dir() else set()
    return [w for w in WHEEL_SET if w not in have]


if __name__ == "__main__":
    ok, line = install(Path(sys.argv[1]), Path(sys.argv[2]))
    print(line)
    sys.exit(0 if ok else 1)
