"""KV-cache allocators compared by the memory benchmark, behind one small interface.

* ``static-max`` / ``static-oracle``: a request reserves ``max_seq_len`` tokens, or exactly its
  final length, when admitted, and never grows (FasterTransformer / Orca style).
* ``paged-16``: vLLM-style blocks of 16 tokens. **Block arithmetic**, not vLLM itself.
* ``ideal``: the physical limit, holding exactly the live tokens (blocks of one token).
* On a sliding-window model (``ModelShape.window``), ``paged-16`` and ``ideal`` free the blocks
  of windowed layers that lie wholly before the window as a request decodes (vLLM's
  sliding-window block freeing), and the vattention rows release window pages in ``step()``;
  ``vattention-<layout>-<page>-norelease`` is the same cache without ``sliding_window``.
* On a model whose full-attention layers have a shape of their own (``ModelShape.full_head_dim``,
  Gemma 4), ``vattention-<layout>-<page>-padded`` is one cache with every layer at the largest
  shape: what a config with one ``num_kv_heads``/``head_dim`` could hold the model in.
* ``vattention-<layout>-<page>``: the real :class:`vattention.KVCache` on the host backend
  (``device="cpu"``), with ``memory_budget`` = the KV budget and deferred reclamation (the
  default). Two measured figures: bytes mapped to running requests' slots (pages backing
  ``cache.mapped_tokens(slot)``: ``held_bytes``), and all mapped bytes from
  ``cache.stats()["bytes_mapped"]`` (``mapped_bytes``), which also counts pages that freed slots
  keep until another request needs them.

Interface (what :func:`vattention.bench.memory.simulate` calls): ``admit(rid, num_tokens,
final_tokens) -> bool``, ``grow({rid: num_tokens}) -> bool`` (transactional: False changes
nothing), ``release(rid)``, ``held_bytes()``, ``mapped_bytes()``, ``counters()``, ``check()``
and ``close()``.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional

from vattention.errors import InvalidSlotError, OutOfPagesError

from .sizing import cache_config, page_geometry, window_pages_per_index
from .workload import ModelShape

__all__ = [
    "Allocator",
    "StaticAllocator",
    "BlockAllocator",
    "VAttentionAllocator",
    "make_allocator",
    "real_cache_factory",
    "ALL_ALLOCATORS",
    "BASELINES",
    "VATTENTION_VARIANTS",
    "ALLOCATOR_NOTES",
]

logger = logging.getLogger(__name__)

ALLOCATOR_NOTES = {
    "static-max": "reserves max_seq_len tokens per request",
    "static-oracle": "reserves each request's final length",
    "paged-16": "block arithmetic, not vLLM",
    "ideal": "physical limit: exactly the live tokens",
}


class Allocator:
    """Base class: capacity bookkeeping of one allocator over a fixed KV budget.

    Parameters
    ----------
    name : str
        Key used in reports and JSON.
    budget_bytes : int
        Bytes of KV memory the allocator may hold.
    bytes_per_token : int
        KV bytes of one token over all layers (K and V).
    """

    def __init__(self, name: str, budget_bytes: int, bytes_per_token: int) -> None:
        self.name = name
        self.budget_bytes = int(budget_bytes)
        self.bytes_per_token = int(bytes_per_token)
        self.note = ALLOCATOR_NOTES.get(name, "")
        # Bytes a request of n tokens really needs (ModelShape.kv_bytes on window models).
        self.kv_bytes: Callable[[int], int] = lambda n: n * self.bytes_per_token

    def admit(self, rid: int, num_tokens: int, final_tokens: int) -> bool:
        """Give request ``rid`` room for ``num_tokens``; False (no change) if it does not fit."""
        raise NotImplementedError

    def grow(self, lengths: Dict[int, int]) -> bool:
        """Make room for every running request's new length; False (no change) if impossible."""
        raise NotImplementedError

    def release(self, rid: int) -> None:
        """Request ``rid`` finished or was preempted."""
        raise NotImplementedError

    def held_bytes(self) -> int:
        """Physical bytes held for the running requests now."""
        raise NotImplementedError

    def mapped_bytes(self) -> int:
        """Physical bytes committed now, including memory cached for reuse (default: held)."""
        return self.held_bytes()

    def counters(self) -> Dict[str, int]:
        """Cumulative allocator-specific counters (e.g. map calls); empty by default."""
        return {}

    def check(self) -> None:
        """Assert internal invariants (tests call this every step); no-op by default."""

    def close(self) -> None:
        """Free resources."""


class StaticAllocator(Allocator):
    """Reserve a fixed number of tokens per request at admission.

    Parameters
    ----------
    reserve : str
        ``"max"``: ``max_seq_len`` tokens; ``"oracle"``: the request's final length.
    max_seq_len : int
        Longest request, in tokens.

    Examples
    --------
    >>> a = StaticAllocator("static-max", 10 * 4, 4, reserve="max", max_seq_len=5)
    >>> a.admit(0, 2, 3), a.admit(1, 2, 3), a.admit(2, 1, 1)
    (True, True, False)
    >>> a.held_bytes()
    40
    """

    def __init__(
        self, name: str, budget_bytes: int, bytes_per_token: int, *, reserve: str, max_seq_len: int
    ) -> None:
        super().__init__(name, budget_bytes, bytes_per_token)
        if reserve not in ("max", "oracle"):
            raise ValueError(f"reserve={reserve!r} must be 'max' or 'oracle'")
        self.reserve = reserve
        self.max_seq_len = int(max_seq_len)
        self._reserved: Dict[int, int] = {}  # rid -> reserved tokens
        self._held_tokens = 0

    def admit(self, rid: int, num_tokens: int, final_tokens: int) -> bool:
        tokens = self.max_seq_len if self.reserve == "max" else int(final_tokens)
        if num_tokens > tokens:
            raise ValueError(f"request {rid}: {num_tokens} tokens exceed its reservation {tokens}")
        if (self._held_tokens + tokens) * self.bytes_per_token > self.budget_bytes:
            return False
        self._reserved[rid] = tokens
        self._held_tokens += tokens
        return True

    def grow(self, lengths: Dict[int, int]) -> bool:
        for rid, tokens in lengths.items():
            if tokens > self._reserved[rid]:
                raise ValueError(
                    f"request {rid} grew to {tokens} tokens beyond its static "
                    f"reservation of {self._reserved[rid]}"
                )
        return True

    def release(self, rid: int) -> None:
        self._held_tokens -= self._reserved.pop(rid)

    def held_bytes(self) -> int:
        return self._held_tokens * self.bytes_per_token


class BlockAllocator(Allocator):
    """Blocks of ``block_tokens`` tokens allocated as requests grow (paged allocation).

    ``block_tokens=1`` is the ideal allocator: it holds exactly the live tokens.

    Examples
    --------
    >>> a = BlockAllocator("paged-16", 3 * 16 * 2, 2, block_tokens=16)
    >>> a.admit(0, 17, 40), a.grow({0: 33}), a.grow({0: 49})
    (True, True, False)
    >>> a.held_bytes() // 2
    48
    """

    def __init__(
        self, name: str, budget_bytes: int, bytes_per_token: int, *, block_tokens: int
    ) -> None:
        super().__init__(name, budget_bytes, bytes_per_token)
        if block_tokens < 1:
            raise ValueError(f"block_tokens={block_tokens} must be >= 1")
        self.block_tokens = int(block_tokens)
        self.num_blocks = self.budget_bytes // (self.block_tokens * self.bytes_per_token)
        self._blocks: Dict[int, int] = {}  # rid -> blocks held
        self._used_blocks = 0

    def _blocks_for(self, tokens: int) -> int:
        return -(-int(tokens) // self.block_tokens)

    def admit(self, rid: int, num_tokens: int, final_tokens: int) -> bool:
        need = self._blocks_for(num_tokens)
        if self._used_blocks + need > self.num_blocks:
            return False
        self._blocks[rid] = need
        self._used_blocks += need
        return True

    def grow(self, lengths: Dict[int, int]) -> bool:
        extra = {rid: self._blocks_for(n) - self._blocks[rid] for rid, n in lengths.items()}
        extra = {rid: e for rid, e in extra.items() if e > 0}
        if self._used_blocks + sum(extra.values()) > self.num_blocks:
            return False
        for rid, e in extra.items():
            self._blocks[rid] += e
            self._used_blocks += e
        return True

    def release(self, rid: int) -> None:
        self._used_blocks -= self._blocks.pop(rid)

    def held_bytes(self) -> int:
        return self._used_blocks * self.block_tokens * self.bytes_per_token


class WindowBlockAllocator(Allocator):
    """Block arithmetic on a sliding-window model: windowed layers free their blocks lying
    wholly before ``length - window`` once the request decodes (a prefill holds every block: its
    first queries read the first keys), full layers keep every block.

    Examples
    --------
    >>> from vattention.bench.workload import ModelShape
    >>> m = ModelShape("toy", 2, 1, 1, "uint8", window=16, window_layers=1)   # 2 + 2 bytes/token
    >>> a = WindowBlockAllocator("paged-16", 1000, m, block_tokens=16)
    >>> a.admit(0, 64, 100), a.held_bytes(), a.grow({0: 65}), a.held_bytes()
    (True, 256, True, 224)
    """

    def __init__(
        self, name: str, budget_bytes: int, model: ModelShape, *, block_tokens: int
    ) -> None:
        super().__init__(name, budget_bytes, model.bytes_per_token)
        self.block_tokens = int(block_tokens)
        self.window = model.window
        self.win_bpt = model.windowed_bytes_per_token
        self.full_bpt = model.bytes_per_token - self.win_bpt
        self._held: Dict[int, int] = {}  # rid -> bytes
        self._total = 0

    def _bytes(self, tokens: int, decoding: bool) -> int:
        bt = self.block_tokens
        blocks = -(-tokens // bt)
        freed = max(0, tokens - self.window) // bt if decoding else 0
        return blocks * bt * self.full_bpt + (blocks - freed) * bt * self.win_bpt

    def admit(self, rid: int, num_tokens: int, final_tokens: int) -> bool:
        need = self._bytes(num_tokens, False)
        if self._total + need > self.budget_bytes:
            return False
        self._held[rid] = need
        self._total += need
        return True

    def grow(self, lengths: Dict[int, int]) -> bool:
        new = {rid: self._bytes(n, True) for rid, n in lengths.items()}
        total = self._total + sum(new[rid] - self._held[rid] for rid in new)
        if total > self.budget_bytes:
            return False
        self._held.update(new)
        self._total = total
        return True

    def release(self, rid: int) -> None:
        self._total -= self._held.pop(rid)

    def held_bytes(self) -> int:
        return self._total


def real_cache_factory(
    model: ModelShape,
    layout: str,
    page_size: str,
    max_batch_size: int,
    max_seq_len: int,
    budget_bytes: int,
    *,
    reclaim: str = "deferred",
    release: bool = True,
):
    """Create the real :class:`vattention.KVCache` on the host backend (``device="cpu"``).

    ``reclaim`` is the cache's policy for pages of freed slots: ``"deferred"`` (the default:
    kept until another request needs them) or ``"eager"`` (unmapped at ``free``). ``release``:
    give the cache the model's sliding windows (``False``: keep every token on every layer).
    """
    import vattention  # imported late: needs the built core and torch

    cfg = cache_config(
        model,
        layout,
        page_size,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        release=release,
        reclaim=reclaim,
    )
    return vattention.KVCache(cfg, memory_budget=budget_bytes)


class VAttentionAllocator(Allocator):
    """Adapter driving a vattention ``KVCache`` (real, or a test double with its interface).

    Admission is ``cache.alloc()`` then ``cache.step(all running lengths + the new one)``; a
    request that cannot grow shows as ``OutOfPagesError`` from ``cache.step``, which is
    transactional, so ``grow`` returns False with nothing changed. Every ``step`` passes the
    lengths of all running requests.

    Parameters
    ----------
    layout : str
        ``"layer"`` or ``"mega"``.
    page_size : str
        ``"2MB"``, ``"64KB"``, ... (binary units).
    max_batch_size, max_seq_len : int
        Slots and tokens per slot of the cache.
    cache_factory : callable, optional
        ``factory(model, layout, page_size, max_batch_size, max_seq_len, budget_bytes)``;
        default builds the real host-backend cache.
    verify : bool
        Check after each successful step that ``bytes_mapped == pages_mapped * page_bytes``
        and that every running slot backs its length (tests).
    """

    def __init__(
        self,
        model: ModelShape,
        *,
        layout: str,
        page_size: str,
        max_batch_size: int,
        max_seq_len: int,
        budget_bytes: int,
        cache_factory: Optional[Callable] = None,
        verify: bool = False,
        release: bool = True,
        padded: bool = False,
    ) -> None:
        suffix = ("" if release else "-norelease") + ("-padded" if padded else "")
        super().__init__(
            f"vattention-{layout}-{page_size}{suffix}", budget_bytes, model.bytes_per_token
        )
        factory: Callable = cache_factory or real_cache_factory
        extra = {} if release else {"release": False}
        # padded: every layer at the largest shape, the one cache a uniform config can build for
        # a per-layer-shape model; efficiency still counts the model's real bytes per token.
        cache_model = model.padded() if padded else model
        self.cache = factory(
            cache_model, layout, page_size, max_batch_size, max_seq_len, budget_bytes, **extra
        )
        # Windowed layers (the first window_layers ones, see ModelShape.sliding_window) release
        # the same page indices: one window_start per slot tells how many.
        self._window_pages = window_pages_per_index(cache_model, layout) if release else 0
        self.layout, self.page_size, self.verify = layout, page_size, verify
        self.max_batch_size = max_batch_size
        self._geometry = page_geometry(cache_model, layout, page_size)
        self._slot: Dict[int, int] = {}  # rid -> slot
        self._length: Dict[int, int] = {}  # rid -> tokens backed by the last step
        self.failed_steps = 0  # step() calls refused with OutOfPagesError (nothing changed)

    def _step(self, lengths: Dict[int, int]) -> bool:
        try:
            self.cache.step({self._slot[rid]: n for rid, n in lengths.items()})
        except OutOfPagesError:
            self.failed_steps += 1
            return False
        self._length = dict(lengths)
        if self.verify:
            self.check()
        return True

    def admit(self, rid: int, num_tokens: int, final_tokens: int) -> bool:
        try:
            slot = self.cache.alloc()
        except InvalidSlotError:
            return False  # no free slot
        self._slot[rid] = slot
        if self._step({**self._length, rid: int(num_tokens)}):
            return True
        del self._slot[rid]
        self.cache.free(slot)
        return False

    def grow(self, lengths: Dict[int, int]) -> bool:
        return self._step(dict(lengths))

    def release(self, rid: int) -> None:
        self.cache.free(self._slot.pop(rid))
        self._length.pop(rid, None)
        # Deferred reclamation: the slot keeps its pages; the next step must not list it.

    def _slot_pages(self, slot: int) -> int:
        """Pages (all tensors) mapped in ``slot``: exact inverse of ``mapped_tokens`` and, on
        windowed tensors, ``window_start``."""
        pages_per_index, unit_bytes, page_bytes = self._geometry
        pages = pages_per_index * -(-self.cache.mapped_tokens(slot) * unit_bytes // page_bytes)
        if self._window_pages:
            pages -= self._window_pages * (
                self.cache.window_start(slot, 0) * unit_bytes // page_bytes
            )
        return pages

    def held_bytes(self) -> int:
        pages = sum(self._slot_pages(slot) for slot in self._slot.values())
        return pages * self._geometry[2]

    def mapped_bytes(self) -> int:
        return int(self.cache.stats()["bytes_mapped"])

    def counters(self) -> Dict[str, int]:
        stats = self.cache.stats()
        return {
            "map_calls": int(stats["map_calls"]),
            "unmap_calls": int(stats["unmap_calls"]),
            "pages_mapped": int(stats["pages_mapped"]),
            "bytes_reserved": int(stats["bytes_reserved"]),
            "failed_steps": self.failed_steps,
        }

    def check(self) -> None:
        stats = self.cache.stats()
        if stats["bytes_mapped"] != stats["pages_mapped"] * stats["page_bytes"]:
            raise AssertionError(
                f"{self.name}: bytes_mapped {stats['bytes_mapped']} != "
                f"{stats['pages_mapped']} pages * {stats['page_bytes']}"
            )
        if stats["memory_budget"] >= 0 and stats["bytes_reserved"] > stats["memory_budget"]:
            raise AssertionError(
                f"{self.name}: {stats['bytes_reserved']} bytes of pages "
                f"exceed the budget {stats['memory_budget']}"
            )
        for rid, n in self._length.items():
            backed = self.cache.mapped_tokens(self._slot[rid])
            if backed < n:
                raise AssertionError(
                    f"{self.name}: request {rid} needs {n} tokens, slot "
                    f"{self._slot[rid]} backs {backed}"
                )
        pages = sum(self._slot_pages(slot) for slot in range(self.max_batch_size))
        if pages != stats["pages_mapped"]:
            raise AssertionError(
                f"{self.name}: slots back {pages} pages of tokens, stats say "
                f"{stats['pages_mapped']} pages mapped"
            )

    def close(self) -> None:
        self.cache.close()


BASELINES = ("static-max", "static-oracle", "paged-16", "ideal")
VATTENTION_VARIANTS = (
    "vattention-layer-2MB",
    "vattention-mega-2MB",
    "vattention-layer-64KB",
    "vattention-mega-64KB",
)
ALL_ALLOCATORS = BASELINES + VATTENTION_VARIANTS


def make_allocator(
    name: str,
    model: ModelShape,
    *,
    budget_bytes: int,
    max_seq_len: int,
    max_batch_size: int,
    cache_factory: Optional[Callable] = None,
    verify: bool = False,
) -> Allocator:
    """Build the allocator called ``name`` (one of :data:`ALL_ALLOCATORS`, or any
    ``vattention-<layer|mega>-<page size>``).

    Examples
    --------
    >>> from vattention.bench.workload import MODELS
    >>> make_allocator("paged-16", MODELS["llama3-8b"], budget_bytes=1 << 30,
    ...                max_seq_len=4096, max_batch_size=8).num_blocks
    512
    """
    allocator = _make(
        name,
        model,
        budget_bytes=budget_bytes,
        max_seq_len=max_seq_len,
        max_batch_size=max_batch_size,
        cache_factory=cache_factory,
        verify=verify,
    )
    if model.window and model.window_layers:
        allocator.kv_bytes = model.kv_bytes
    return allocator


def _make(
    name: str,
    model: ModelShape,
    *,
    budget_bytes: int,
    max_seq_len: int,
    max_batch_size: int,
    cache_factory: Optional[Callable],
    verify: bool,
) -> Allocator:
    bpt = model.bytes_per_token
    windowed = bool(model.window and model.window_layers)
    if name in ("static-max", "static-oracle"):
        return StaticAllocator(
            name, budget_bytes, bpt, reserve=name.split("-")[1], max_seq_len=max_seq_len
        )
    if name in ("paged-16", "ideal"):
        tokens = 16 if name == "paged-16" else 1
        if windowed:
            return WindowBlockAllocator(name, budget_bytes, model, block_tokens=tokens)
        return BlockAllocator(name, budget_bytes, bpt, block_tokens=tokens)
    parts = name.split("-")
    if (
        len(parts) in (3, 4)
        and parts[0] == "vattention"
        and parts[1] in ("layer", "mega")
        and parts[3:] in ([], ["norelease"], ["padded"])
    ):
        return VAttentionAllocator(
            model,
            layout=parts[1],
            page_size=parts[2],
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            budget_bytes=budget_bytes,
            cache_factory=cache_factory,
            verify=verify,
            release=parts[3:] != ["norelease"],
            padded=parts[3:] == ["padded"],
        )
    raise ValueError(
        f"allocator {name!r} is not one of {', '.join(ALL_ALLOCATORS)} "
        "(or vattention-<layer|mega>-<page size>[-norelease|-padded])"
    )
