"""Builds vattention._C in place for the running interpreter: no venv, no pip, no download.

`make gpu-check`'s first step, for a machine that has CUDA and torch and nothing else (the GPU
machine lent to a session has no network): ``python setup.py build_ext --inplace`` with every
core, and ``cuda.h`` found as setup.py looks for it, plus nvcc's installation. The CPU attention
kernel's AVX-512 and AVX2 variants (the check's ``cpu-attention`` part measures them on the GPU
machine's CPU) are compiled only on a machine with at least 8 cores, where they compile beside
the rest; with fewer, only its generic variant (VATTENTION_CPU_KERNELS=generic), as they are most
of the compile time on 2 cores; a failed build with them is run again without them, so that the
GPU parts keep their extension. A VATTENTION_CPU_KERNELS the caller sets wins. Skipped when the
extension for this interpreter was built from the same sources: a stamp under build/gpu-check/
holds a hash of what the build reads.

    python benchmarks/gpu/build.py            # build if needed; prints one line
    python benchmarks/gpu/build.py --record   # the extension was just built (make build): stamp it
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAMPS = ROOT / "build" / "gpu-check"
# What setup.py compiles (csrc/tests is the sanitizer build's, not the extension's).
SOURCE_DIRS = ("core", "host", "attention", "python", "cuda")


def ext_suffix() -> str:
    return str(sysconfig.get_config_var("EXT_SUFFIX"))


def extension_path() -> Path:
    return ROOT / "vattention" / f"_C{ext_suffix()}"


def cuda_home() -> str | None:
    """A root whose include/cuda.h exists: $CUDA_HOME, $CUDA_PATH, nvcc's installation, else
    /usr/local/cuda (setup.py looks at the first two and the last; nvcc's is added here)."""
    nvcc = shutil.which("nvcc")
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    roots.append(str(Path(nvcc).resolve().parents[1]) if nvcc else None)
    roots.append("/usr/local/cuda")
    for root in roots:
        if root and (Path(root) / "include" / "cuda.h").exists():
            return root
    return None


def fingerprint(cuda: str | None) -> str:
    """Hash of the sources, setup.py, this interpreter's ABI and the CUDA choice: equal
    fingerprints build the same extension."""
    h = hashlib.sha256()
    files = [ROOT / "setup.py", ROOT / "pyproject.toml"]
    for folder in SOURCE_DIRS:
        files += sorted((ROOT / "csrc" / folder).glob("*.[ch]*"))
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    with_cuda = cuda is not None and os.environ.get("VATTENTION_NO_CUDA") != "1"
    h.update(f"{ext_suffix()} cuda={with_cuda}".encode())
    return h.hexdigest()


def stamp_path() -> Path:
    return STAMPS / f"stamp{ext_suffix()}.txt"


def up_to_date(cuda: str | None) -> bool:
    stamp = stamp_path()
    return extension_path().exists() and stamp.exists() and stamp.read_text() == fingerprint(cuda)


def record(cuda: str | None) -> None:
    STAMPS.mkdir(parents=True, exist_ok=True)
    stamp_path().write_text(fingerprint(cuda))


def build_command() -> list[str]:
    # --force: setuptools' incremental build does not see header changes; the stamp said
    # something changed, so everything is compiled again.
    return [sys.executable, "setup.py", "build_ext", "--inplace", "--force"]


# Cores from which the CPU kernel's ISA variants are compiled too (each is one long compile
# unit, about 40 s; the generic one, always compiled, takes longer): on 8 or more they run beside
# the other units and add little to the build's time.
ALL_KERNELS_MIN_CORES = 8


def cpu_kernels() -> str:
    """What VATTENTION_CPU_KERNELS the build uses: the caller's, else by the core count."""
    if os.environ.get("VATTENTION_CPU_KERNELS"):
        return os.environ["VATTENTION_CPU_KERNELS"]
    return "all" if (os.cpu_count() or 1) >= ALL_KERNELS_MIN_CORES else "generic"


def build_env(cuda: str | None, kernels: str | None = None) -> dict[str, str]:
    env = dict(os.environ, VATTENTION_CPU_KERNELS=kernels or cpu_kernels())
    env["VATTENTION_BUILD_JOBS"] = str(os.cpu_count() or 1)
    if cuda:
        env["CUDA_HOME"] = cuda
    return env


def _compile(cuda: str | None, kernels: str, log: Path | None, mode: str) -> int:
    """One setup.py run (its output appended to ``log`` when mode is "a"); its exit code."""
    out = open(log, mode) if log else subprocess.DEVNULL
    try:
        proc = subprocess.run(
            build_command(),
            cwd=ROOT,
            env=build_env(cuda, kernels),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    finally:
        if log:
            out.close()  # type: ignore[union-attr]
    if proc.returncode == 0 and not extension_path().exists():
        return 1
    return proc.returncode


def build(log: Path | None = None) -> tuple[bool, str]:
    """(ok, one line saying what happened). The compiler's output goes to ``log``."""
    cuda = cuda_home()
    where = f"cuda.h from {cuda}/include" if cuda else "no cuda.h found: host backend only"
    if up_to_date(cuda):
        return True, f"up to date: {extension_path().name} for {sys.executable} ({where})"
    # A new file, not the old one rewritten: a process that has the old one loaded keeps it.
    extension_path().unlink(missing_ok=True)
    kernels = cpu_kernels()
    rc = _compile(cuda, kernels, log, "w")
    retried = ""
    if rc != 0 and kernels == "all" and not os.environ.get("VATTENTION_CPU_KERNELS"):
        # The ISA variants are there for the last part only: a compiler that cannot build them
        # must not cost the GPU parts their extension.
        retried = f"; the build with all CPU kernels failed (exit {rc}), so generic only"
        kernels = "generic"
        extension_path().unlink(missing_ok=True)
        rc = _compile(cuda, kernels, log, "a")
    if rc != 0:
        tail = log.read_text().strip().splitlines()[-5:] if log else []
        return False, f"build failed (exit {rc}; {where}{retried}): " + " / ".join(tail)
    record(cuda)
    return True, f"built {extension_path().name} ({where}; CPU kernels: {kernels}{retried})"


def main(argv: list[str]) -> int:
    if argv[1:] == ["--record"]:
        record(cuda_home())
        return 0
    ok, line = build()
    print(f"build: {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
