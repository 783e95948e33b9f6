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


sources = sorted(glob.glob("csrc/*.cpp"))
# The CPU attention kernel and its pybind glue (folders are build units). -fopenmp: the kernel runs
# on the OpenMP runtime torch already loaded (libgomp.so.1, same soname). setuptools takes flags
# per extension; only csrc/attention has OpenMP pragmas, so the flag changes no other object.
sources += sorted(glob.glob("csrc/attention/*.cpp")) + sorted(glob.glob("csrc/python/*.cpp"))
include_dirs = ["csrc"]
macros = []
cuda_include = cuda_include_dir()
has_cuda_backend = os.path.exists(os.path.join("csrc", "cuda_backend.cpp"))
if cuda_include and has_cuda_backend and os.environ.get("VATTENTION_NO_CUDA") != "1":
    include_dirs.append(cuda_include)
    macros.append(("VATTENTION_WITH_CUDA", "1"))
else:
    sources = [s for s in sources if not os.path.basename(s).startswith("cuda_")]

# VATTENTION_EXT=none: register the package (e.g. the vLLM plugin's entry point in a second venv)
# without compiling; the editable install then uses the extension already built in place.
ext_modules = [] if os.environ.get("VATTENTION_EXT") == "none" else [
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

setup(
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
)
