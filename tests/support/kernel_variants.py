"""The `isa` fixture: a test of the CPU attention kernel runs once per variant of the kernel; and
the `threads` fixture: once on one OpenMP thread and once on two (the work is split differently).

The variants are the kernel's own list (:func:`vattention.attention.kernel_variants`: one per
csrc/attention/isa_*.cpp), so a run on an AVX-512 machine also runs what an AVX2 or a generic
CPU runs, and a new variant is tested without a change here. The fixture checks that the kernel
really runs the variant it asked for, and puts back the one that ran before (a
VATTENTION_ATTENTION_ISA choice survives). At the end of the session one line says which
variants ran, which this CPU (or its OS: AMX's tile state) cannot run and why, and which of the
CPU's features (AMX-INT8, AMX-FP16, AVX512-FP16) no variant uses. A conftest plugin
(tests/conftest.py's ``pytest_plugins``).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from vattention import _C
from vattention.attention import kernel_isa, kernel_variants
from vattention.attention.variants import unused_cpu_features

VARIANTS = {v.name: v for v in kernel_variants()}
_ran: Counter = Counter()
_skipped: Counter = Counter()


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """The test runs on `request.param` threads (torch's, which the kernel takes)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(params=list(VARIANTS))
def isa(request):
    """The test runs on the kernel's `request.param` variant (skipped where the CPU cannot)."""
    variant = VARIANTS[request.param]
    if not variant.runnable:
        _skipped[variant.name] += 1
        pytest.skip(f"the {variant.name} variant cannot run here: {variant.why_not()}")
    before = kernel_isa()
    assert _C.set_attention_kernel_isa(variant.name), f"{variant.name} runnable yet refused"
    assert kernel_isa() == variant.name, (kernel_isa(), variant.name)
    _ran[variant.name] += 1
    yield variant.name
    assert kernel_isa() == variant.name, f"the test left {kernel_isa()}, not {variant.name}"
    assert _C.set_attention_kernel_isa(before)


def summary() -> str:
    """The session's line: variants run (tests each), those that did not and why, features of
    the CPU that no variant uses."""
    ran = ", ".join(f"{name} ({_ran[name]} tests)" for name in VARIANTS if _ran[name])
    parts = [f"ran {ran or 'none'}"]
    for name, variant in VARIANTS.items():
        if _skipped[name]:
            parts.append(f"{name} not run ({variant.why_not()}; {_skipped[name]} tests skipped)")
    unused = unused_cpu_features()
    if unused:
        parts.append("this CPU's " + ", ".join(unused) + " are used by no variant")
    return "cpu attention kernel variants: " + "; ".join(parts)


def pytest_terminal_summary(terminalreporter):
    if _ran or _skipped:
        terminalreporter.write_line(summary())
