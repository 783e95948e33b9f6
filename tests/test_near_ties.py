"""The near-tie checks of the bf16 vLLM test (``support/near_ties.py``) on hand-made runs: they
pass divergences at ties and flag those that are not, without running vLLM."""

from __future__ import annotations

import pytest

from support import near_ties

BOUND = 0.0625


def run(tokens, logprobs):
    """A one-request ``vllm_run`` document: ``tokens`` and, per position, ``{token: logprob}``."""
    ranked = [sorted(([t, lp] for t, lp in pos.items()), key=lambda e: -e[1]) for pos in logprobs]
    return {"tokens": [[tokens]], "logprobs": [[ranked]]}


def test_identical_tokens_have_no_divergence():
    stock = run([5, 6], [{5: -1.0, 7: -2.0}, {6: -0.5, 8: -1.5}])
    plugin = run([5, 6], [{5: -1.01, 7: -2.0}, {6: -0.5, 8: -1.49}])
    assert near_ties.divergences(stock, plugin) == []
    assert near_ties.logprob_drift(stock, plugin) == pytest.approx(0.01)
    assert near_ties.top_gaps(stock) == [1.0, 1.0]


def test_a_flip_at_an_exact_tie_is_a_near_tie_whichever_is_listed_first():
    # stock took 5, but its list happens to name the tied 9 first
    stock = run([5, 1], [{9: -2.0, 5: -2.0, 4: -3.0}, {1: -1.0}])
    plugin = run([9, 2], [{9: -1.99, 5: -2.02, 4: -3.0}, {2: -0.1}])
    (d,) = near_ties.divergences(stock, plugin)
    assert (d.request, d.position, d.stock_token, d.plugin_token) == (0, 0, 5, 9)
    assert d.gap == 0.0 and d.in_stock_top2 and d.near_tie(BOUND)
    # after the divergence the contexts differ: position 1 is not compared
    assert near_ties.logprob_drift(stock, plugin) == pytest.approx(0.02)


@pytest.mark.parametrize(
    "stock_scores, why",
    [
        ({5: -1.0, 9: -1.2, 4: -3.0}, "gap 0.2000"),  # second best, but far behind
        ({5: -1.0, 4: -1.01, 9: -1.02}, "gap 0.0200"),  # close, but third
        ({5: -1.0, 4: -1.5}, "not in stock's top-k"),
    ],
)
def test_a_flip_that_is_no_near_tie_is_reported(stock_scores, why):
    stock = run([5], [stock_scores])
    plugin = run([9], [{9: -1.0, 5: -1.1}])
    (d,) = near_ties.divergences(stock, plugin)
    assert not d.near_tie(BOUND)
    text = d.describe()
    assert "request 0, position 0" in text and "the plugin 9" in text and why in text
