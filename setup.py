"""Build of the C++ core, vattention._C (metadata lives in pyproject.toml).

The CUDA backend is compiled when cuda.h is found ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda). It
needs the header only: libcuda is loaded at run time, so the package imports without a GPU.
"""

import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext, naive_recompile
from setuptools import setup

ParallelCompile("VATTENTION_BUILD_JOBS", needs_recompile=naive_recompile).install()


def cuda_include_dir():
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "include", "cuda.h")):
            return os.path.join(root, "include")
    return None


def folder(name):
    """Every source of one build unit (a folder of csrc/: docs/architecture.md)."""
    return sorted(glob.glob(os.path.join("csrc", name, "*.cpp")))


# core: the cache (no Python, no driver); host: the Linux backend; attention: the CPU attention
# kernel; python: bindings and DLPack. -fopenmp: the kernel runs on the OpenMP runtime torch
# already loaded (libgomp.so.1, the same soname); only csrc/attention has OpenMP pragmas, so the
# flag (setuptools takes flags per extension) changes no other object.
sources = folder("core") + folder("host") + folder("attention") + folder("python")
include_dirs = ["csrc"]
macros = []
cuda_include = cuda_include_dir()
if cuda_include and folder("cuda") and os.environ.get("VATTENTION_NO_CUDA") != "1":
    sources += folder("cuda")  # the CUDA backend: needs cuda.h only, libcuda is loaded at run time
    include_dirs.append(cuda_include)
    macros.append(("VATTENTION_WITH_CUDA", "1"))

# VATTENTION_CPU_KERNELS=generic: compile only the CPU attention kernel's generic variant (the
# AVX-512 and AVX2 ones are most of the build's compile time; the kernel then runs its generic
# code), for builds that will not run the CPU kernel, such as `make gpu-check`'s.
cpu_kernels = os.environ.get("VATTENTION_CPU_KERNELS", "all")
if cpu_kernels == "generic":
    macros += [(f"VATTENTION_SKIP_{isa}", "1") for isa in ("AVX512", "AVX512BF16", "AMX", "AVX2")]
elif cpu_kernels != "all":
    raise SystemExit(f"VATTENTION_CPU_KERNELS={cpu_kernels!r}: expected 'all' or 'generic'")

# VATTENTION_EXT=none: register the package (e.g. the vLLM plugin's entry point in a second venv)
# without compiling; the editable install then uses the extension already built in place.
ext_modules = (
    []
    if os.environ.get("VATTENTION_EXT") == "none"
    else [
        Pybind11Extension(
            "vattention._C",
            sources,
            include_dirs=include_dirs,
            define_macros=macros,
            cxx_std=17,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            libraries=["dl"],
        )
    ]
)

setup(
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
)
