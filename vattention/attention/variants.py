"""Which instruction-set variant of the CPU attention kernel runs here, and why.

The kernel (``csrc/attention``) is compiled once per instruction set: ``amx`` (AMX-BF16 tiles for
the prefill of bf16 caches and the scores of their GQA decode, ``avx512``'s code for the rest),
``avx512bf16`` (AVX-512 with the bf16 dot product ``vdpbf16ps``), ``avx512``, ``avx2`` (with FMA
and F16C) and ``generic`` (plain C++, any CPU). At its first call it runs the best variant that
this build contains and this CPU runs, unless ``VATTENTION_ATTENTION_ISA=<name>`` names a
runnable one. ``amx`` also needs the operating system to grant the process AMX's tile data (Linux
5.16 and later, on request; the kernel asks once); where it refuses, the variant reports why and
is not run. No variant uses AMX-INT8, AMX-FP16 or AVX512-FP16. ``python -m vattention info``
prints :func:`kernel_report`.
"""

from __future__ import annotations

import os
from typing import List, NamedTuple, Tuple

from .. import _C
from .kernel import kernel_isa

__all__ = ["ISA_ENV", "KernelVariant", "kernel_report", "kernel_variants", "unused_cpu_features"]

#: The environment variable that picks a variant (read once, at the kernel's first call).
ISA_ENV = "VATTENTION_ATTENTION_ISA"


class KernelVariant(NamedTuple):
    """One instruction-set variant of the CPU attention kernel, as this build and CPU see it.

    Attributes
    ----------
    name : str
        ``"amx"``, ``"avx512bf16"``, ``"avx512"``, ``"avx2"`` or ``"generic"``.
    compiled : bool
        Whether this build contains it (``VATTENTION_CPU_KERNELS=generic`` builds, and builds
        off x86-64, contain ``generic`` only).
    needs : tuple of str
        The CPU features it runs on, spelled as ``/proc/cpuinfo`` and ``lscpu`` spell them.
    missing : tuple of str
        Those of ``needs`` this CPU (with its operating system) lacks.
    refused : str
        Why the operating system does not let this process use a state the variant needs
        although the CPU has it (``amx``: the tile data), ``""`` when it does.
    """

    name: str
    compiled: bool
    needs: Tuple[str, ...]
    missing: Tuple[str, ...]
    refused: str = ""

    @property
    def runnable(self) -> bool:
        """Whether the kernel can run this variant here."""
        return self.compiled and not self.missing and not self.refused

    def why_not(self) -> str:
        """Why this variant cannot run here (``""`` when it can).

        Examples
        --------
        >>> KernelVariant("avx2", True, ("avx2", "fma", "f16c"), ("avx2",)).why_not()
        'the CPU lacks avx2'
        >>> KernelVariant("amx", True, ("amx_tile",), (), "the OS refused it").why_not()
        'the OS refused it'
        """
        if not self.compiled:
            return "not compiled into this build"
        if self.missing:
            return "the CPU lacks " + ", ".join(self.missing)
        return self.refused


def kernel_variants() -> List[KernelVariant]:
    """Every variant of the CPU attention kernel, best first.

    Examples
    --------
    >>> [v.name for v in kernel_variants()]
    ['amx', 'avx512bf16', 'avx512', 'avx2', 'generic']
    >>> kernel_variants()[-1].runnable     # generic: any CPU
    True
    """
    return [
        KernelVariant(name, compiled, tuple(needs), tuple(missing), refused)
        for name, compiled, needs, missing, refused in _C.attention_kernel_variants()
    ]


def unused_cpu_features() -> List[str]:
    """Features of this CPU that no variant uses (AMX-INT8, AMX-FP16, AVX512-FP16), ``lscpu``
    spelling.

    Examples
    --------
    >>> set(unused_cpu_features()) <= {"amx_int8", "amx_fp16", "avx512_fp16"}
    True
    """
    return list(_C.attention_unused_cpu_features())


def _why_chosen(chosen: KernelVariant, best: KernelVariant, better: List[KernelVariant]) -> str:
    """Why ``chosen`` runs: the reasons of the variants above ``best``, and the override."""
    env = os.environ.get(ISA_ENV)
    if chosen.name != best.name:
        via = f"{ISA_ENV}={env}" if env == chosen.name else "set_attention_kernel_isa()"
        return f"selected by {via}; the best variant here is {best.name}"
    has = (
        "the CPU has " + ", ".join(best.needs) + " and this build has it"
        if best.needs
        else "plain C++, for any CPU"
    )
    reasons = [f"{v.name}: {v.why_not()}" for v in better]
    if env and env != chosen.name:
        reasons.append(f"{ISA_ENV}={env} ignored: not a variant this build and CPU run")
    return "; ".join([f"the best variant here: {has}", *reasons])


def kernel_report() -> List[str]:
    """What ``python -m vattention info`` says of the CPU attention kernel: the variant a call
    runs and why, what every variant needs, its tuning (``intel`` on Intel CPUs, else ``other``),
    and the CPU's features that none uses.

    Examples
    --------
    >>> lines = kernel_report()
    >>> lines[0].startswith("cpu attention kernel: " + kernel_isa() + " (")
    True
    >>> lines[1].startswith("cpu attention kernel variants: ")
    True
    >>> lines[2].split(" (")[0] in ("cpu attention kernel tuning: intel",
    ...                             "cpu attention kernel tuning: other")
    True
    """
    variants = kernel_variants()
    runnable = [v for v in variants if v.runnable]
    best = runnable[0]  # generic always runs
    chosen = next(v for v in variants if v.name == kernel_isa())
    better = variants[: variants.index(best)]
    lines = [f"cpu attention kernel: {chosen.name} ({_why_chosen(chosen, best, better)})"]
    summary = ", ".join(v.name for v in runnable) + " run here"
    for v in variants:
        if not v.runnable:
            summary += f"; {v.name} does not: {v.why_not()}"
    lines.append(f"cpu attention kernel variants: {summary}")
    lines.append(
        f"cpu attention kernel tuning: {_C.attention_kernel_tuning()} (prefetches and fp32"
        " decode's P V order: intel as measured on Intel cores, other as on AMD's, for every other"
        " CPU; the same results either way)"
    )
    unused = unused_cpu_features()
    if unused:
        lines.append(
            "cpu attention kernel: no variant uses this CPU's " + ", ".join(unused) + " (there is"
            " no AMX-INT8, AMX-FP16 or AVX512-FP16 variant)"
        )
    return lines
