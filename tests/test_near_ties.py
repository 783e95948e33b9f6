"""The bf16 vLLM test's judgement against an fp32 reference (``support/near_ties.py``) on
hand-made runs: it accepts engines as accurate as stock and divergences at the reference's
near-ties, and flags the rest, without running vLLM."""

from __future__ import annotations

import math

import pytest

from support import near_ties

PROMPT = [11, 12]  # the reference's sequences start with the prompt: positions are offset by 2


def ranked(scores):
    return sorted(([t, lp] for t, lp in scores.items()), key=lambda e: -e[1])


def run(tokens, logprobs):
    """A one-request bf16 ``vllm_run`` document: ``tokens`` and, per position, ``{token: lp}``."""
    return {"tokens": [[tokens]], "logprobs": [[[ranked(pos) for pos in logprobs]]]}


def reference(logprobs):
    """The fp32 run over PROMPT + stock's tokens: None for the first prompt token, one ranked
    list per later prompt token, then ``logprobs`` at the generated positions."""
    prompt_part = [None, ranked({12: -0.1, 40: -3.0})]
    doc = {"prompt_logprobs": [prompt_part + [ranked(pos) for pos in logprobs]]}
    return near_ties.Reference(doc, [PROMPT])


def test_distances_are_read_at_the_generated_positions_on_shared_tokens():
    ref = reference([{5: -1.0, 7: -2.0}, {6: -0.5, 8: -1.5}])
    stock = run([5, 6], [{5: -1.02, 7: -2.0, 9: -4.0}, {6: -0.5, 8: -1.48}])
    plugin = run([5, 6], [{5: -1.01, 7: -2.03}, {6: -0.51, 8: -1.5}])
    measured = near_ties.accuracy(stock, plugin, ref)
    # root mean square over tokens 5 and 7, then 6 and 8 (9: neither the reference nor the
    # plugin listed it)
    assert measured.stock == pytest.approx([math.sqrt(0.02**2 / 2)] * 2)
    assert measured.plugin == pytest.approx(
        [math.sqrt((0.01**2 + 0.03**2) / 2), math.sqrt(0.01**2 / 2)]
    )
    assert near_ties.divergences(stock, plugin, ref) == []
    assert near_ties.reference_gaps(ref, [(0, 0), (0, 1)]) == pytest.approx([1.0, 1.0])
    # noise: the spread of stock's errors at a position (its logsumexp shift cancels)
    positions = near_ties.same_context_positions(stock, plugin)
    assert near_ties.noise(stock, ref, positions) == pytest.approx(0.02)  # -0.02 .. 0, 0 .. +0.02
    assert near_ties.noise(plugin, ref, positions) == pytest.approx(0.02)  # -0.01 .. -0.03


def test_a_plugin_further_from_the_reference_than_stock_is_flagged():
    positions = 40
    ref_scores = [{5: -1.0, 7: -2.0}] * positions
    ref = reference(ref_scores)
    stock = run([5] * positions, [{5: -1.01, 7: -2.0}] * positions)
    # equally accurate, errors of the other sign: no excess
    same = run([5] * positions, [{5: -0.99, 7: -2.0}] * positions)
    assert near_ties.accuracy(stock, same, ref).plugin_no_further()
    # a little noisier at every position, consistently: flagged
    worse = run(
        [5] * positions, [{5: -1.0 + (0.02 if i % 2 else -0.03), 7: -2.0} for i in range(positions)]
    )
    measured = near_ties.accuracy(stock, worse, ref)
    assert not measured.plugin_no_further()
    assert "plugin - stock +0.0106" in measured.describe()


def test_a_flip_where_the_reference_is_a_near_tie_is_accepted():
    ref = reference([{5: -2.0, 9: -2.01, 4: -3.0}, {1: -1.0}])
    stock = run([5, 1], [{5: -2.0, 9: -2.02, 4: -3.0}, {1: -1.0}])
    plugin = run([9, 2], [{9: -1.995, 5: -2.0, 4: -3.0}, {2: -0.1}])
    (d,) = near_ties.divergences(stock, plugin, ref)
    assert (d.request, d.position, d.stock_token, d.plugin_token) == (0, 0, 5, 9)
    assert d.reference_gap == pytest.approx(0.01)
    noise = near_ties.noise(stock, ref, [(0, 0)])  # stock's 9 at -0.01, its 5 at 0
    assert noise == pytest.approx(0.01)
    assert d.near_tie(noise)  # both within 0.01 of the reference's best
    assert not d.near_tie(0.005)
    # after the divergence the contexts differ: position 1 is not compared
    assert near_ties.same_context_positions(stock, plugin) == [(0, 0)]


@pytest.mark.parametrize(
    "ref_scores, why",
    [
        ({5: -1.0, 9: -1.2, 4: -3.0}, "0.2000 behind its best"),  # second, but far behind
        ({5: -1.0, 4: -1.5}, "not in the reference's list"),
    ],
)
def test_a_flip_where_the_reference_is_no_near_tie_is_reported(ref_scores, why):
    ref = reference([ref_scores])
    stock = run([5], [{5: -1.0, 9: -1.21, 4: -3.0}])
    plugin = run([9], [{9: -1.0, 5: -1.1}])
    (d,) = near_ties.divergences(stock, plugin, ref)
    assert not d.near_tie(0.01)
    text = d.describe()
    assert "request 0, position 0" in text and "the plugin 9" in text and why in text


def test_a_position_the_reference_did_not_rank_is_an_error():
    ref = near_ties.Reference({"prompt_logprobs": [[None, None, None]]}, [[11, 12]])
    with pytest.raises(ValueError, match="request 0, position 0"):
        ref.at((0, 0))
