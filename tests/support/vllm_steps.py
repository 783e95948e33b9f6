"""Engine steps over a real vattention cache, as the plugin's runner drives them, for the checks
that call the plugin's metadata builders and forwards (on vLLM's classes in the vLLM venv, or on
the plugin's own batch classes).

A step is a list of ``(slot index, new tokens)``: each named row grows by its new tokens, the
cache maps them (``KVCache.step``), the builder sees the rows and their past lengths through its
``batch_source`` (what the runner gives it), and builds the step's metadata from vLLM's common
metadata (the query offsets and token counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace as NS
from typing import Any, Iterable, Iterator, List, Sequence, Tuple

import torch

from vattention.integrations.vllm.runner import BatchSlots


@dataclass(frozen=True)
class Step:
    rows: List[int]  # cache rows, in the step's order
    past: List[int]  # tokens each row held before the step
    new: List[int]  # tokens each row gets in the step
    starts: torch.Tensor  # int32 query offsets, vLLM's query_start_loc
    metadata: Any  # what the builder built

    @property
    def total(self) -> int:
        return sum(self.new)


def grow(
    cache, slots: Sequence[int], schedule: Iterable[Sequence[Tuple[int, int]]]
) -> Iterator[Tuple[List[int], List[int], List[int]]]:
    """Grows the named rows by each step of ``schedule`` (``cache.step``, every row's length) and
    yields the step's (rows, past lengths, new tokens)."""
    lens = {s: 0 for s in slots}
    for step in schedule:
        rows = [slots[i] for i, _ in step]
        new = [n for _, n in step]
        past = [lens[s] for s in rows]
        for s, n in zip(rows, new):
            lens[s] += n
        cache.step(dict(lens))
        yield rows, past, new


def run_steps(
    cache, builder, slots: Sequence[int], schedule: Iterable[Sequence[Tuple[int, int]]]
) -> Iterator[Step]:
    """Applies each step of ``schedule`` to ``cache`` and yields it with ``builder``'s metadata."""
    for rows, past, new in grow(cache, slots, schedule):
        builder.batch_source = lambda rows=rows, past=past: BatchSlots(rows, past)
        starts = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
        common = NS(num_reqs=len(rows), num_actual_tokens=sum(new), query_start_loc_cpu=starts)
        yield Step(rows, past, new, starts, builder.build(0, common))
