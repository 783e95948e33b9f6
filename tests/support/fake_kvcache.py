"""Pure-Python stand-in for ``vattention.KVCache`` (test double for the benchmark adapter).

Implements only what the memory benchmark calls: ``alloc``, ``step`` (dict form,
transactional), ``free`` with deferred reclamation (idle slots keep their pages until a step
needs them), ``mapped_tokens``, ``stats`` and ``close``. Page arithmetic follows
``KVCacheConfig``: a ``layer`` cache has ``2 * L`` tensors with ``H * D * elem`` bytes per token;
a ``mega`` cache has 2 tensors with ``L * H * D * elem`` bytes per token.
"""

from __future__ import annotations

from vattention.errors import InvalidSlotError, OutOfPagesError

_UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def _bytes(size: str) -> int:
    return int(size[:-2]) * _UNITS[size[-2:]]


class FakeKVCache:
    """Page bookkeeping of a KV cache without memory; counts map and unmap calls."""

    def __init__(self, model, layout, page_size, max_batch_size, max_seq_len, budget_bytes):
        per_layer = model.num_kv_heads * model.head_dim * model.element_bytes
        self.num_tensors = 2 * model.num_layers if layout == "layer" else 2
        self.token_bytes = per_layer if layout == "layer" else per_layer * model.num_layers
        self.page_bytes = _bytes(page_size)
        self.max_seq_len = max_seq_len
        self.budget_pages = budget_bytes // self.page_bytes
        self.pages = [0] * max_batch_size  # mapped pages per tensor, per slot
        self.lengths = [0] * max_batch_size
        self.active = [False] * max_batch_size
        self.map_calls = self.unmap_calls = 0

    def _pages_per_tensor(self, tokens: int) -> int:
        return -(-tokens * self.token_bytes // self.page_bytes)

    def _mapped(self) -> int:
        return sum(self.pages) * self.num_tensors

    def alloc(self) -> int:
        free = [s for s, a in enumerate(self.active) if not a]
        if not free:
            raise InvalidSlotError("no free slot")
        slot = max(free, key=lambda s: self.pages[s])  # prefer idle slots with pages
        self.active[slot] = True
        return slot

    def step(self, lengths: dict) -> None:
        need = {s: self._pages_per_tensor(n) - self.pages[s] for s, n in lengths.items()}
        if any(not self.active[s] for s in lengths):
            raise InvalidSlotError("slot not allocated")
        if any(n > self.max_seq_len for n in lengths.values()):
            raise ValueError("too long")
        needed = sum(max(0, k) for k in need.values()) * self.num_tensors
        free = self.budget_pages - self._mapped()
        idle = [s for s, a in enumerate(self.active) if not a and self.pages[s]]
        if needed > free + sum(self.pages[s] for s in idle) * self.num_tensors:
            raise OutOfPagesError(f"need {needed} pages")
        for s in idle:  # reclaim idle slots' pages only as far as needed
            if needed <= free:
                break
            free += self.pages[s] * self.num_tensors
            self.unmap_calls += self.pages[s] * self.num_tensors
            self.pages[s] = 0
        for s, k in need.items():
            if k > 0:
                self.pages[s] += k
                self.map_calls += k * self.num_tensors
            self.lengths[s] = lengths[s]

    def free(self, slot: int) -> None:
        if not self.active[slot]:
            raise InvalidSlotError(f"slot {slot} not allocated")
        self.active[slot] = False
        self.lengths[slot] = 0

    def mapped_tokens(self, slot: int) -> int:
        return min(self.pages[slot] * self.page_bytes // self.token_bytes, self.max_seq_len)

    def stats(self) -> dict:
        mapped = self._mapped()
        return {
            "page_bytes": self.page_bytes,
            "pages_mapped": mapped,
            "bytes_mapped": mapped * self.page_bytes,
            "bytes_reserved": mapped * self.page_bytes,
            "memory_budget": self.budget_pages * self.page_bytes,
            "map_calls": self.map_calls,
            "unmap_calls": self.unmap_calls,
        }

    def close(self) -> None:
        pass
