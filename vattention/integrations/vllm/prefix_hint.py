"""The CPU kernel's shared-prefix hint, read from vLLM's block tables.

With prefix caching, requests behind one system prompt hold the same block ids at the start of
their tables, and the plugin's cache maps the same pages behind those ids in every row: the rows
hold the same K/V there. The kernel cannot see that (each row has its own addresses), so each
step the metadata builder groups the batch's requests by their first block and tells the kernel
how far each shares its group's first request's table (``prefix_groups`` / ``prefix_lens`` of
:func:`vattention.attention.cpu_attention`): the prefix is then read once per KV head for the
whole group instead of once per request.

Only whole blocks cached before the step count (a request's own partial block is never shared),
and vLLM's null block (a hole: a sliding window's released block) never matches.

This module reads plain tensors only (no vLLM import), so it is tested without vLLM.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["NULL_BLOCK", "SharedPrefixMemo", "shared_prefixes"]

NULL_BLOCK = 0  # vLLM's null block id


def shared_prefixes(
    table: torch.Tensor, past: Sequence[int], block_size: int
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(prefix_groups, prefix_lens)`` int32 tensors for the batch, or ``(None, None)`` when no
    two requests share a first block.

    ``table``: vLLM's block table of the batch's requests ``[n, max_blocks]`` (CPU), ``past``: the
    tokens each had cached before the step. A group is the requests whose first block is the same
    id; a request's length is the run of whole cached blocks its table shares with the group's
    first request (for that request itself, its whole cached blocks), so any two members hold the
    same K/V up to the smaller of their two lengths.

    >>> t = torch.tensor([[5, 6, 7], [5, 6, 9], [8, 1, 2], [5, 0, 0]], dtype=torch.int32)
    >>> groups, lens = shared_prefixes(t, [300, 290, 300, 130], 128)
    >>> groups.tolist(), lens.tolist()
    ([0, 0, -1, 0], [256, 256, 0, 128])
    """
    n = len(past)
    if n < 2:
        return None, None
    ids = table[:n].numpy()
    by_first: Dict[int, List[int]] = {}
    for i, (block, cached) in enumerate(zip(ids[:, 0].tolist(), past)):
        if block != NULL_BLOCK and cached >= block_size:
            by_first.setdefault(block, []).append(i)
    groups: Optional[np.ndarray] = None
    lens: Optional[np.ndarray] = None
    for members in by_first.values():
        if len(members) < 2:
            continue
        if groups is None or lens is None:  # both or neither
            groups, lens, gid = np.full(n, -1, dtype=np.int32), np.zeros(n, dtype=np.int32), 0
        full = np.asarray([past[i] for i in members]) // block_size
        width = min(int(full.max()), ids.shape[1])
        lead = ids[members[0], :width]
        same = (ids[members, :width] == lead) & (lead != NULL_BLOCK)
        run = np.where(same.all(axis=1), width, same.argmin(axis=1))
        groups[members] = gid
        lens[members] = np.minimum(run, full) * block_size
        gid += 1
    if groups is None:
        return None, None
    return torch.from_numpy(groups), torch.from_numpy(lens)


class SharedPrefixMemo:
    """:func:`shared_prefixes` of the previous step again while the batch's tables (up to its
    whole cached blocks) and whole cached block counts are unchanged: most steps, since a decode
    row crosses a block boundary once every ``block_size`` tokens (about 3 us where the grouping
    takes 15-20 for 16 rows).

    >>> memo = SharedPrefixMemo()
    >>> t = torch.tensor([[5, 6, 7], [5, 6, 9]], dtype=torch.int32)
    >>> memo(t, [300, 290], 128)[1].tolist(), memo(t, [301, 291], 128) is memo(t, [300, 290], 128)
    ([256, 256], True)
    """

    def __init__(self) -> None:
        self._key: Optional[Tuple[bytes, Tuple[int, ...]]] = None
        self._value: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None)

    def __call__(self, table: torch.Tensor, past: Sequence[int], block_size: int):
        blocks = [p // block_size for p in past]
        width = max(blocks, default=0)
        key = (table[: len(past), :width].numpy().tobytes(), tuple(blocks))
        if key != self._key:
            self._key, self._value = key, shared_prefixes(table, past, block_size)
        return self._value
