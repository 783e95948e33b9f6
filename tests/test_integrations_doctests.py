"""The docstring examples of the integration modules run and print what they claim."""

from __future__ import annotations

import doctest
import importlib

import pytest


@pytest.mark.parametrize("module", ["vattention.compat", "vattention.integrations.flash_attn",
                                    "vattention.integrations.transformers"])
def test_docstring_examples(module):
    if module.endswith("transformers"):
        pytest.importorskip("transformers")
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
