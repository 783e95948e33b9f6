"""Where two engines' greedy tokens part, and how close the reference's candidates were there.

Reads ``vattention.bench.vllm_run`` output documents run with ``SamplingParams.logprobs=k``:
``tokens[request][0]`` (one completion each) and ``logprobs[request][0]``, one
``[[token, logprob], ...]`` list per generated token (the top ``k`` and the sampled token).

Up to and including a request's first divergence, both engines computed the next token from the
same context, so their logprobs there can be compared directly; after it the contexts differ and
nothing more is compared.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

Ranked = Sequence[Sequence[float]]  # one position's [[token, logprob], ...]


@dataclass
class Divergence:
    """A request's first position where the plugin's greedy token is not stock's."""

    request: int
    position: int
    stock_token: int
    plugin_token: int
    stock_top: List[Tuple[int, float]]  # stock's best candidates there, best first
    gap: Optional[float]  # stock's logprob of its token minus of the plugin's (None: not listed)
    in_stock_top2: bool  # the plugin's token scores at least stock's second best (ties count)

    def near_tie(self, bound: float) -> bool:
        return self.in_stock_top2 and self.gap is not None and self.gap <= bound

    def describe(self) -> str:
        top2 = ", ".join(f"{t}: {lp:.4f}" for t, lp in self.stock_top[:2])
        gap = "not in stock's top-k" if self.gap is None else f"gap {self.gap:.4f}"
        return (
            f"request {self.request}, position {self.position}: stock's top-2 [{top2}], "
            f"stock took {self.stock_token}, the plugin {self.plugin_token} ({gap})"
        )


def _table(ranked: Ranked) -> Dict[int, float]:
    return {int(t): float(lp) for t, lp in ranked}


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _same_context_positions(stock: dict, plugin: dict, request: int) -> int:
    """How many leading positions of ``request`` both engines computed from the same context."""
    a, b = stock["tokens"][request][0], plugin["tokens"][request][0]
    d = first_divergence(a, b)
    return min(len(a), len(b)) if d is None else d + 1


def top_gaps(doc: dict) -> List[float]:
    """The best minus the second-best logprob at every generated position of ``doc``."""
    gaps = []
    for per_request in doc["logprobs"]:
        for ranked in per_request[0]:
            best = sorted((lp for _, lp in ranked), reverse=True)
            gaps.append(best[0] - best[1])
    return gaps


def divergences(stock: dict, plugin: dict) -> List[Divergence]:
    """Every request's first divergence, judged by stock's own logprobs at that position."""
    found = []
    for r, (a, b) in enumerate(zip(stock["tokens"], plugin["tokens"])):
        d = first_divergence(a[0], b[0])
        if d is None:
            continue
        ranked = stock["logprobs"][r][0][d]
        scores = _table(ranked)
        # Stock's own token is the best it saw (greedy); at an exact tie the list's order is
        # arbitrary, so the gap is taken from its token, not from the list's first entry.
        theirs = scores.get(b[0][d])
        second = sorted(scores.values(), reverse=True)[1]
        found.append(
            Divergence(
                request=r,
                position=d,
                stock_token=a[0][d],
                plugin_token=b[0][d],
                stock_top=sorted(((int(t), float(lp)) for t, lp in ranked), key=lambda e: -e[1]),
                gap=None if theirs is None else scores[a[0][d]] - theirs,
                in_stock_top2=theirs is not None and theirs >= second,
            )
        )
    return found


def logprob_drift(stock: dict, plugin: dict) -> float:
    """The largest |plugin - stock| logprob of a token both listed, over the positions where both
    engines had the same context."""
    drift = 0.0
    for r in range(len(stock["tokens"])):
        for p in range(_same_context_positions(stock, plugin, r)):
            a = _table(stock["logprobs"][r][0][p])
            b = _table(plugin["logprobs"][r][0][p])
            drift = max([drift, *(abs(a[t] - b[t]) for t in a.keys() & b.keys())])
    return drift


def quantiles(values: Sequence[float], at: Sequence[float] = (0.0, 0.1, 0.25, 0.5)) -> str:
    ordered = sorted(values)
    return ", ".join(f"{q:.0%} {ordered[round(q * (len(ordered) - 1))]:.4f}" for q in at)


def summary(stock: dict, plugin: dict, bound: float) -> str:
    """What the comparison found, for the test's output (``pytest -s``) and its failures."""
    gaps = top_gaps(stock)
    found = divergences(stock, plugin)
    near = sum(g <= bound for g in gaps)
    lines = [
        f"stock's top-1 minus top-2 logprob over {len(gaps)} positions: {quantiles(gaps)} "
        f"(median {statistics.median(gaps):.4f}); {near} at most {bound} apart",
        f"largest |plugin - stock| logprob where the contexts were the same: "
        f"{logprob_drift(stock, plugin):.4f}",
        f"{len(found)} of {len(stock['tokens'])} requests diverged; at the first divergence, "
        f"stock's gap between its token and the plugin's: "
        + (", ".join("-" if d.gap is None else f"{d.gap:.4f}" for d in found) or "none"),
    ]
    lines += [f"  {d.describe()}" for d in found]
    return "\n".join(lines)
