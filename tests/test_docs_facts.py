"""Facts the docs state about the code agree with the code: defaults quoted in prose, and install
commands that name only what exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vattention.integrations.vllm.release_delay import DEFAULT_RELEASE_DELAY_S

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted(ROOT.glob("examples/*.py")),
]


def test_the_idle_release_delay_quoted_is_the_default():
    readme = " ".join((ROOT / "README.md").read_text().split())
    quoted = re.search(
        r"holds that cap plus a small headroom \((\d+) s after its last request", readme
    )
    assert quoted is not None and float(quoted.group(1)) == DEFAULT_RELEASE_DELAY_S
    vllm = " ".join((ROOT / "docs" / "vllm.md").read_text().split())
    assert f"`VATTENTION_VLLM_RELEASE_DELAY`, default {DEFAULT_RELEASE_DELAY_S:g} s" in vllm


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: p.name)
def test_installs_name_no_package_that_does_not_exist(path):
    """vattention is not on PyPI: it installs from a clone (``pip install .``, ``".[extra]"``),
    never as ``vattention[extra]``; and an extra named must be one pyproject.toml defines."""
    text = path.read_text()
    assert not re.search(r"pip install [^\n`]*\bvattention\[", text), path
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = re.findall(r"^([a-z]+) = \[", section, re.M)
    assert "vllm" in extras and "hf" in extras
    for extra in re.findall(r"""pip install [^\n`]*?["']\.\[([a-z,]+)\]["']""", text):
        assert set(extra.split(",")) <= set(extras), (path, extra)
