"""Every command prints its own usage, and the documented examples run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import vattention.__main__
import vattention.bench.cli

ROOT = Path(__file__).resolve().parent.parent


def _run(args, cwd=None, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        env=env,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "args,usage",
    [
        (["bench", "--help"], "usage: python -m vattention bench [-h] {memory,vllm,elastic}"),
        (["bench", "memory", "--help"], "usage: python -m vattention bench memory [-h]"),
        (["bench", "vllm", "--help"], "usage: python -m vattention bench vllm [-h]"),
        (["demo", "--help"], "usage: python -m vattention demo [-h]"),
        (["info", "--help"], "usage: python -m vattention info [-h]"),
        (["pool", "--help"], "usage: python -m vattention pool [-h]"),
        (["--help"], "usage: python -m vattention [-h] {info,demo,bench,pool}"),
    ],
)
def test_each_command_prints_its_own_usage(args, usage, capsys):
    # In this process (a fresh interpreter per command costs a torch import each); the module
    # entry point itself runs in the test below.
    with pytest.raises(SystemExit) as exit_:
        vattention.__main__.main(args)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(usage), out[:300]


def test_python_dash_m_runs_the_command_line():
    proc = _run(["vattention", "--help"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m vattention [-h] {info,demo,bench,pool}")


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        vattention.__main__.main(["bogus"])
    assert exit_.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


def test_bench_cli_docstring_example_runs(tmp_path):
    doc = vattention.bench.cli.__doc__
    command = re.search(r"runs on its own.*?``python -m ([^`]+)``", doc, re.S).group(1).split()
    proc = _run(command, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "allocators failed" not in proc.stderr, proc.stderr[-2000:]
    assert "| vattention-mega-64KB |" in proc.stdout


def _kernel_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith("cpu attention kernel")]


def test_info_names_the_cpu_kernel_variant_and_why():
    """`info` says which variant of the CPU attention kernel a call runs (the best one this build
    and CPU run), with the CPU features it runs on, why each better variant does not run, every
    variant's status (amx: also whether the OS granted the tile state), the kernels' tuning (the
    CPU's vendor), and the CPU's features that no variant uses (AMX-INT8, AMX-FP16,
    AVX512-FP16)."""
    from vattention.attention import kernel_variants
    from vattention.attention.variants import ISA_ENV, unused_cpu_features
    from vattention.bench.machine import cpu_vendor

    env = {k: v for k, v in os.environ.items() if k != ISA_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "vattention", "info"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(env, PYTHONPATH=str(ROOT)),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    variants = kernel_variants()
    runnable = [v for v in variants if v.runnable]
    best = runnable[0]
    has = (
        f"the CPU has {', '.join(best.needs)} and this build has it"
        if best.needs
        else "plain C++, for any CPU"
    )
    better = "".join(f"; {v.name}: {v.why_not()}" for v in variants[: variants.index(best)])
    summary = ", ".join(v.name for v in runnable) + " run here"
    summary += "".join(f"; {v.name} does not: {v.why_not()}" for v in variants if not v.runnable)
    vendor = "intel" if cpu_vendor() == "GenuineIntel" else "other"
    want = [
        f"cpu attention kernel: {best.name} (the best variant here: {has}{better})",
        f"cpu attention kernel variants: {summary}",
        f"cpu attention kernel tuning: {vendor} (prefetches and fp32 decode's P V order: intel"
        " as measured on Intel cores, other as on AMD's, for every other CPU; the same results"
        " either way)",
    ]
    if unused_cpu_features():
        want.append(
            "cpu attention kernel: no variant uses this CPU's "
            + ", ".join(unused_cpu_features())
            + " (there is no AMX-INT8, AMX-FP16 or AVX512-FP16 variant)"
        )
    assert _kernel_lines(proc.stdout) == want, proc.stdout


@pytest.mark.parametrize("choice", ["generic", "sve"])
def test_info_says_when_the_environment_picks_the_variant(choice):
    """VATTENTION_ATTENTION_ISA=generic runs the generic kernel (`info` says so, and which would
    run without it); a name that is no variant here is ignored, and `info` says that too."""
    from vattention.attention import kernel_variants

    best = next(v.name for v in kernel_variants() if v.runnable)
    proc = subprocess.run(
        [sys.executable, "-m", "vattention", "info"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), VATTENTION_ATTENTION_ISA=choice),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    first = _kernel_lines(proc.stdout)[0]
    if choice == "sve":
        assert first.startswith(f"cpu attention kernel: {best} (the best variant here: "), first
        assert first.endswith(
            "; VATTENTION_ATTENTION_ISA=sve ignored: not a variant this build and CPU run)"
        ), first
    elif best == "generic":  # a CPU without AVX2, or a build without the other variants
        assert first.startswith(
            "cpu attention kernel: generic (the best variant here: plain C++, for any CPU"
        ), first
    else:
        assert first == (
            "cpu attention kernel: generic (selected by VATTENTION_ATTENTION_ISA=generic; the best"
            f" variant here is {best})"
        ), first


def test_top_level_help_says_what_each_command_does(capsys):
    with pytest.raises(SystemExit):
        vattention.__main__.main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out  # no reStructuredText markup in a terminal
    for command in vattention.__main__.COMMANDS:
        line = re.search(rf"^  {command} +(\S.*)$", out, re.M)
        assert line is not None, f"no line for {command}:\n{out}"
        assert line.group(1) == vattention.__main__.SUMMARIES[command]


def test_every_demo_option_has_help(capsys):
    with pytest.raises(SystemExit):
        vattention.__main__.main(["demo", "--help"])
    out = capsys.readouterr().out
    # One block per option: "--name METAVAR", then its help, on the same line or indented below.
    blocks = [b.split() for b in re.split(r"\n(?=  -)", out.split("options:")[1]) if "--" in b]
    assert [b[0] for b in blocks if b[0] != "-h,"] == [
        "--requests", "--batch", "--max-seq-len", "--page-size", "--layout", "--budget",
        "--trace", "--seed",
    ]  # fmt: skip
    undocumented = [b[0] for b in blocks if len(b) <= 2]  # the option and its metavar only
    assert not undocumented, out
    assert "packaged trace (sharegpt, arxiv_summarization, arxiv_long)" in " ".join(out.split())


def test_bench_vllm_help_says_repetitions_run_twice_per_engine(capsys):
    with pytest.raises(SystemExit):
        vattention.__main__.main(["bench", "vllm", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "rounds of A B B A per workload (default: 2): each engine runs 2N timed passes" in out


def test_a_source_folder_without_its_compiled_core_says_so(tmp_path):
    """Run from a folder holding vattention's sources but no build, as from a clone's root after a
    non-editable install: the error names the missing core and what to do, not a circular
    import."""
    import shutil

    import torch

    shutil.copytree(
        ROOT / "vattention", tmp_path / "vattention", ignore=shutil.ignore_patterns("_C*.so")
    )
    site = str(Path(torch.__file__).resolve().parents[1])
    # -S: no site-packages .pth files, so no installed (or editable) vattention is found first;
    # torch's folder is added by hand.
    code = (
        f"import sys; sys.path.insert(0, ''); sys.path.append({site!r}); "
        "import runpy; sys.argv = ['vattention', 'info']; "
        "runpy.run_module('vattention', run_name='__main__', alter_sys=True)"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "circular import" not in proc.stderr, proc.stderr[-2000:]
    assert (
        f"vattention's compiled core (the extension module vattention._C) is not in "
        f"{tmp_path / 'vattention'}" in proc.stderr
    ), proc.stderr[-2000:]
    assert "`make build`" in proc.stderr and "run from another directory" in proc.stderr
