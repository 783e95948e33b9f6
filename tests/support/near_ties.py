"""Two bf16 engines judged against an fp32 reference: how far each is from it, and whether their
greedy tokens part only where the reference itself is a near-tie.

Reads ``vattention.bench.vllm_run`` output documents. The bf16 runs (stock vLLM, the plugin) ran
with ``SamplingParams.logprobs=k``: ``tokens[request][0]`` (one completion each) and
``logprobs[request][0]``, one ``[[token, logprob], ...]`` list per generated token (the top ``k``
and the sampled token). The reference ran in fp32 over each request's prompt followed by stock's
generated tokens, with ``prompt_logprobs=k``: ``prompt_logprobs[request][i]`` ranks the candidates
for position ``i`` of that sequence given the tokens before it, so generated position ``j`` is at
``i = len(prompt) + j`` (teacher forcing: the reference sees the bf16 run's own context).

Up to and including a request's first divergence, stock and the plugin computed the next token
from the same context, which is also the reference's there; those positions are compared. After
it the plugin's context differs and nothing more is compared.

The rules, with no constant fitted on a machine:

- **Distance** of an engine from the reference at a position: the root mean square of its
  engine - reference logprobs over the tokens all three runs listed there.
- **No further than stock**: over the compared positions, the plugin's mean distance exceeds
  stock's by at most three standard errors of the mean paired difference (distances at one
  position are paired: both engines ran that context, and most of their rounding is common).
  If the two were equally accurate, a larger excess would happen by chance about once in 700
  runs. (The root mean square, of the distances tried, best told a plugin whose attention output
  was scaled by 1.01 from the plugin as built.)
- **Noise**: how far stock, the baseline, puts two tokens' order from the reference's: at a
  position, the spread of its errors (the largest minus the smallest engine - reference logprob
  over the tokens both listed; the logsumexp both subtract cancels), and over the run, the
  largest such spread. An engine whose spread stays within ``noise`` prefers token ``b`` to ``a``
  only where the reference has ``b`` at most ``noise`` behind ``a``; so at every first divergence
  both tokens must be within ``noise`` of the reference's best there (and its own top-2 gap with
  them). Stock's noise and not the plugin's: a plugin that went wrong at a few positions must
  not widen the bound it is judged by.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

Ranked = Sequence[Sequence[float]]  # one position's [[token, logprob], ...]
Position = Tuple[int, int]  # (request, generated position)
STANDARD_ERRORS = 3.0  # the "no further" test's one-sided margin (a 0.13% chance if equal)


def _table(ranked: Ranked) -> Dict[int, float]:
    return {int(t): float(lp) for t, lp in ranked}


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def same_context_positions(stock: dict, plugin: dict) -> List[Position]:
    """Every (request, position) both engines computed from the same context: each request's
    positions up to and including its first divergence."""
    out = []
    for r, (a, b) in enumerate(zip(stock["tokens"], plugin["tokens"])):
        d = first_divergence(a[0], b[0])
        n = min(len(a[0]), len(b[0])) if d is None else d + 1
        out += [(r, j) for j in range(n)]
    return out


class Reference:
    """The fp32 run's ranked candidates at each generated position of the bf16 runs."""

    def __init__(self, doc: dict, prompts: Sequence[Sequence[int]]) -> None:
        self._ranked = doc["prompt_logprobs"]
        self._offsets = [len(p) for p in prompts]

    def at(self, position: Position) -> Dict[int, float]:
        r, j = position
        ranked = self._ranked[r][self._offsets[r] + j]
        if ranked is None:
            raise ValueError(f"the reference has no logprobs at request {r}, position {j}")
        return _table(ranked)

    def best(self, position: Position) -> List[Tuple[int, float]]:
        return sorted(self.at(position).items(), key=lambda e: -e[1])


def _errors(ranked: Ranked, reference: Dict[int, float]) -> List[float]:
    """engine - reference logprob of each token both listed at one position."""
    engine = _table(ranked)
    shared = engine.keys() & reference.keys()
    if not shared:
        raise ValueError(
            f"no token listed by both: engine {sorted(engine)}, reference {sorted(reference)}"
        )
    return [engine[t] - reference[t] for t in shared]


def distance(ranked: Ranked, reference: Dict[int, float], tokens: Sequence[int]) -> float:
    """The root mean square engine - reference logprob over ``tokens`` (listed by both)."""
    engine = _table(ranked)
    return math.sqrt(statistics.fmean((engine[t] - reference[t]) ** 2 for t in tokens))


def spread(ranked: Ranked, reference: Dict[int, float]) -> float:
    """How far the engine moves the gap between two tokens both listed at one position: the
    largest minus the smallest engine - reference logprob."""
    errors = _errors(ranked, reference)
    return max(errors) - min(errors)


def noise(doc: dict, reference: Reference, positions: Sequence[Position]) -> float:
    """The largest :func:`spread` of ``doc``'s run over ``positions``."""
    return max(spread(doc["logprobs"][r][0][j], reference.at((r, j))) for r, j in positions)


def _listed_by_all(
    stock: dict, plugin: dict, reference: Reference, position: Position
) -> List[int]:
    r, j = position
    listed = [_table(doc["logprobs"][r][0][j]).keys() for doc in (stock, plugin)]
    shared = sorted(listed[0] & listed[1] & reference.at(position).keys())
    if not shared:
        raise ValueError(
            f"request {r}, position {j}: no token listed by stock, plugin and reference"
        )
    return shared


@dataclass
class Accuracy:
    """Both engines' distances from the reference over the same positions."""

    stock: List[float]
    plugin: List[float]

    @property
    def excess(self) -> float:
        """The plugin's mean distance minus stock's."""
        return statistics.fmean(self.plugin) - statistics.fmean(self.stock)

    @property
    def margin(self) -> float:
        """STANDARD_ERRORS standard errors of the mean paired difference (plugin - stock)."""
        diffs = [p - s for p, s in zip(self.plugin, self.stock)]
        if len(diffs) < 2:
            return 0.0
        return STANDARD_ERRORS * statistics.stdev(diffs) / math.sqrt(len(diffs))

    def plugin_no_further(self) -> bool:
        return self.excess <= self.margin

    def describe(self) -> str:
        def q(values: List[float]) -> str:
            ordered = sorted(values)
            at = (0.5, 0.9, 1.0)
            return ", ".join(f"{p:.0%} {ordered[round(p * (len(ordered) - 1))]:.4f}" for p in at)

        return (
            f"distance from the fp32 reference over {len(self.stock)} positions: "
            f"stock mean {statistics.fmean(self.stock):.4f} ({q(self.stock)}), "
            f"plugin mean {statistics.fmean(self.plugin):.4f} ({q(self.plugin)}); "
            f"plugin - stock {self.excess:+.4f}, allowed {self.margin:.4f} "
            f"({STANDARD_ERRORS:g} standard errors)"
        )


def accuracy(stock: dict, plugin: dict, reference: Reference) -> Accuracy:
    """Both engines' distances from the reference at every same-context position."""
    out = Accuracy([], [])
    for r, j in same_context_positions(stock, plugin):
        tokens = _listed_by_all(stock, plugin, reference, (r, j))
        ref = reference.at((r, j))
        out.stock.append(distance(stock["logprobs"][r][0][j], ref, tokens))
        out.plugin.append(distance(plugin["logprobs"][r][0][j], ref, tokens))
    return out


@dataclass
class Divergence:
    """A request's first position where the plugin's greedy token is not stock's, as the
    reference scores that position."""

    request: int
    position: int
    stock_token: int
    plugin_token: int
    reference_top: List[Tuple[int, float]]  # the reference's candidates there, best first

    def _behind_best(self, token: int) -> Optional[float]:
        scores = dict(self.reference_top)
        return None if token not in scores else self.reference_top[0][1] - scores[token]

    @property
    def reference_gap(self) -> float:
        """The reference's own top-1 minus top-2 logprob here."""
        return self.reference_top[0][1] - self.reference_top[1][1]

    def near_tie(self, noise: float) -> bool:
        """Both tokens within ``noise`` of the reference's best (so its top-2 gap is too)."""
        behind = [self._behind_best(t) for t in (self.stock_token, self.plugin_token)]
        return all(b is not None and b <= noise for b in behind)

    def describe(self) -> str:
        top = ", ".join(f"{t}: {lp:.4f}" for t, lp in self.reference_top[:3])

        def behind(token: int) -> str:
            b = self._behind_best(token)
            return "not in the reference's list" if b is None else f"{b:.4f} behind its best"

        return (
            f"request {self.request}, position {self.position}: the reference's best [{top}] "
            f"(top-2 gap {self.reference_gap:.4f}); stock took {self.stock_token} "
            f"({behind(self.stock_token)}), the plugin {self.plugin_token} "
            f"({behind(self.plugin_token)})"
        )


def divergences(stock: dict, plugin: dict, reference: Reference) -> List[Divergence]:
    """Every request's first divergence between stock and the plugin."""
    found = []
    for r, (a, b) in enumerate(zip(stock["tokens"], plugin["tokens"])):
        d = first_divergence(a[0], b[0])
        if d is not None:
            found.append(Divergence(r, d, a[0][d], b[0][d], reference.best((r, d))))
    return found


def reference_gaps(reference: Reference, positions: Sequence[Position]) -> List[float]:
    """The reference's top-1 minus top-2 logprob at each of ``positions``."""
    out = []
    for p in positions:
        best = reference.best(p)
        out.append(best[0][1] - best[1][1])
    return out


def summary(stock: dict, plugin: dict, reference: Reference) -> str:
    """What the comparison found, for the test's output (``pytest -s``) and its failures."""
    measured = accuracy(stock, plugin, reference)
    positions = same_context_positions(stock, plugin)
    bound = noise(stock, reference, positions)
    gaps = sorted(reference_gaps(reference, positions))
    near = sum(g <= bound for g in gaps)
    found = divergences(stock, plugin, reference)
    lines = [
        measured.describe(),
        f"stock's noise (largest spread of its errors at a position) {bound:.4f}; the "
        f"reference's top-1 minus top-2 over those positions: median "
        f"{statistics.median(gaps):.4f}, {near} of {len(gaps)} within the noise",
        f"{len(found)} of {len(stock['tokens'])} requests diverged",
    ]
    lines += [f"  {d.describe()}" for d in found]
    return "\n".join(lines)
