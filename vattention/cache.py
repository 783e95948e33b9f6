"""KVCache: the object a serving system holds. Wraps the C++ core and hands out torch tensors."""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import _C
from .arguments import as_int
from .config import DTYPES, KVCacheConfig, Size, parse_size
from .errors import (
    ArgumentTypeError,
    BackendUnavailableError,
    CacheClosedError,
    ConfigError,
    InvalidSlotError,
    SequenceTooLongError,
)
from .sharing import SharingMixin
from .swap import SwapMixin

__all__ = ["KVCache", "Capacity"]

logger = logging.getLogger(__name__)

SeqLens = Union[Mapping[int, int], Sequence[int], torch.Tensor]
# step(..., blocks={slot: (start, block_ids, cached)}): block_ids for one group, or one per group.
BlockUpdate = Tuple[int, Union[Sequence[int], Sequence[Sequence[int]]], int]


def _as_lens(seq_lens: SeqLens):
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.dim() != 1:
            raise ConfigError(f"seq_lens tensor must be 1-D, got shape {tuple(seq_lens.shape)}")
        if (
            seq_lens.dtype.is_floating_point
            or seq_lens.dtype.is_complex
            or seq_lens.dtype == torch.bool
        ):
            raise ArgumentTypeError(
                f"seq_lens must hold integers (lengths in tokens), got a "
                f"{seq_lens.dtype} tensor; convert it explicitly"
            )
        return seq_lens.detach().to("cpu", torch.int64).tolist()
    return seq_lens


def _lens_error(error: Exception, seq_lens, max_batch: int, max_seq: int) -> Exception:
    """The typed error for seq_lens the core's parser refused with a TypeError/OverflowError."""
    if isinstance(error, OverflowError):
        items = seq_lens.items() if isinstance(seq_lens, dict) else enumerate(seq_lens)
        for slot, length in items:
            if isinstance(slot, int) and not 0 <= slot < max_batch:
                return InvalidSlotError(
                    f"slot={slot} is out of range [0, {max_batch}) (max_batch_size={max_batch})"
                )
            if isinstance(length, int) and not -(2**63) <= length < 2**63:
                return SequenceTooLongError(
                    f"seq_lens[slot={slot}]={length} is outside "
                    f"[0, {max_seq}] (max_seq_len={max_seq})"
                )
    return ArgumentTypeError(str(error))


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What a step would need and could get, in physical pages (:meth:`KVCache.capacity`).

    ``pages_short`` is what is missing: 0 when the step would not run out of pages.
    ``pages_creatable`` is ``None`` without a memory budget (the backend is the only limit then,
    and ``pages_short`` is 0: a refusal by the driver itself is not foreseeable).
    """

    pages_needed: int
    pages_free: int
    pages_creatable: Optional[int]
    pages_reclaimable: int
    pages_short: int

    @property
    def fits(self) -> bool:
        """True when ``pages_short`` is 0."""
        return self.pages_short == 0


# Largest index_pages(i) before the cache says its page indices got coarse (see models.md).
COARSE_INDEX_PAGES = 8


def _warn_if_coarse(config: KVCacheConfig) -> None:
    """Per-layer shapes whose token bytes have a small gcd make every page index long: say so."""
    most = max(config.index_pages(i) for i in range(config.num_layers))
    if most > COARSE_INDEX_PAGES:
        logger.warning(
            "per-layer shapes: token rows of %s bytes have a gcd of %d bytes, so one page index "
            "holds %d tokens and takes %d pages (%d bytes) over all layers, %dx the pages of the "
            "largest layer alone; a request rounds up to that. A smaller page_size (now %d bytes) "
            "makes indices finer",
            sorted({config.layer_token_bytes(i) for i in range(config.num_layers)}),
            config.unit_bytes,
            config.tokens_per_page,
            config.pages_per_index,
            config.pages_per_index * config.page_bytes,
            most,
            config.page_bytes,
        )


class KVCache(SharingMixin, SwapMixin):
    """Virtual KV tensors with physical pages mapped on demand.

    Each layer's K and V cache is one dense tensor ``[max_batch_size, max_seq_len, num_kv_heads,
    head_dim]`` whose virtual addresses never change; physical pages back a slot's row only up to
    the tokens it holds. A request owns one slot (batch row) from :meth:`alloc` to :meth:`free`.

    Parameters
    ----------
    config : KVCacheConfig
        Shape, dtype, device, page size and layout.
    memory_budget : int or str, optional
        Cap on physical memory for pages (bytes or ``"8GB"``). ``None``: grow until the backend
        refuses. On the host backend, set one: the OS may kill a process before refusing memory.
    swap_budget : int or str, optional
        Cap on host memory holding swapped-out slots (:meth:`swap_out`), e.g. ``"16GB"``.
        ``None`` (default): no cap. Exceeding it raises :class:`SwapSpaceError`.

    Examples
    --------
    >>> import torch, vattention
    >>> cfg = vattention.KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, max_batch_size=4,
    ...                                max_seq_len=1024, dtype=torch.float16, page_size="64KB")
    >>> with vattention.KVCache(cfg, memory_budget="16MB") as cache:
    ...     slot = cache.alloc()
    ...     cache.step({slot: 100})
    ...     k, v = cache.layer(0)
    ...     k[slot, :100] = 1.0
    ...     cache.mapped_tokens(slot)
    256
    """

    def __init__(
        self,
        config: KVCacheConfig,
        *,
        memory_budget: Optional[Size] = None,
        swap_budget: Optional[Size] = None,
    ) -> None:
        if not isinstance(config, KVCacheConfig):
            raise ConfigError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        budget = -1 if memory_budget is None else parse_size(memory_budget, name="memory_budget")
        if 0 <= budget < config.page_bytes:
            raise ConfigError(
                f"memory_budget={memory_budget!r} ({budget} bytes) is smaller than one page "
                f"(page_size={config.page_size!r}, {config.page_bytes} bytes): no token could "
                f"ever be mapped; give at least {config.page_bytes} bytes or None for no cap"
            )
        self._dl_code, self._dl_bits = DTYPES[config.dtype]
        if config.per_layer_shapes:
            _warn_if_coarse(config)
        self._attach(
            config,
            _C.KVCacheCore(
                config.device,
                config.geometry,
                budget,
                config.reclaim == "eager",
                config.lookahead_tokens,
                config.num_blocks or 0,
                config.block_cache,
            ),
        )
        if config.scrub:
            self._core.set_scrub(True)
        if swap_budget is not None:
            if config.num_blocks is not None:
                self._core.close()
                raise ConfigError(
                    f"swap_budget={swap_budget!r}: a cache whose pages are named by engine blocks "
                    f"(num_blocks={config.num_blocks}) does not swap (the engine moves pages "
                    "through its block tables); leave swap_budget unset"
                )
            self.set_swap_budget(swap_budget)
        self._layers: Optional[List[Tuple[torch.Tensor, Optional[torch.Tensor]]]] = None
        logger.debug("KVCache %s: %d bytes virtual", config, config.virtual_bytes)

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def config(self) -> KVCacheConfig:
        """The configuration this cache was built with."""
        return self._config

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._core.closed

    def close(self) -> None:
        """Unmap every page and give it back. Tensors handed out stay reserved but fault on access.

        Idempotent. Afterwards every other method raises :class:`CacheClosedError`.
        """
        self._layers = None
        self._core.close()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.active_slots())} active slots"
        return f"KVCache({self._config}, {state})"

    # ---- tensors ------------------------------------------------------------------------------
    def _tensor(self, kv: int, layer: int) -> torch.Tensor:
        capsule = self._core.export_tensor(kv, layer, self._dl_code, self._dl_bits)
        try:
            return self._as_dtype(torch.from_dlpack(capsule))
        # e.g. a CUDA cache with a CPU-only torch (torch raises AssertionError "not compiled
        # with CUDA enabled" there)
        except (RuntimeError, TypeError, AssertionError) as e:
            raise BackendUnavailableError(
                f"torch {torch.__version__} cannot wrap this {self._config.device!r} memory: {e}"
            ) from e

    def _as_dtype(self, tensor: torch.Tensor) -> torch.Tensor:
        # fp8 leaves the core as uint8 bytes (see config.DTYPES): a zero-copy view of the same
        # memory.
        return tensor if tensor.dtype == self._config.dtype else tensor.view(self._config.dtype)

    def _all_layers(self) -> List[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        if self._layers is None:
            if self.closed:
                raise CacheClosedError("the KV cache is closed; create a new KVCache")
            values = self._config.value_cache
            self._layers = [
                (self._tensor(0, i), self._tensor(1, i) if values else None)
                for i in range(self._config.num_layers)
            ]
        return self._layers

    def layer(self, index: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """K and V of one layer: tensors ``[max_batch_size, max_seq_len, num_kv_heads, head_dim]``
        (that layer's ``num_kv_heads[index]`` and ``head_dim[index]`` with per-layer shapes).

        Zero-copy views of the virtual reservation; the same addresses on every call. Only the
        first :meth:`mapped_tokens` positions of a slot's row are backed: touching beyond them
        faults (SIGSEGV on the host backend, an illegal-address error on CUDA). On a
        sliding-window layer, positions below :meth:`window_start` are released and fault the same
        way. V is ``None`` with ``value_cache=False``.
        """
        index = self._layer_index(index)
        return self._all_layers()[index]

    def _layer_index(self, index) -> int:
        n = self._config.num_layers  # checked first: a bad index is reported as such everywhere
        index = as_int(index, "layer")
        if not 0 <= index < n:
            raise ConfigError(f"layer={index!r} is out of range [0, {n}) (num_layers={n})")
        return index

    def _check_open(self) -> None:
        if self.closed:
            raise CacheClosedError("the KV cache is closed; create a new KVCache")

    @property
    def k_cache(self) -> List[torch.Tensor]:
        """K tensors of all layers."""
        return [k for k, _ in self._all_layers()]

    @property
    def v_cache(self) -> List[Optional[torch.Tensor]]:
        """V tensors of all layers (``None`` entries with ``value_cache=False``)."""
        return [v for _, v in self._all_layers()]

    def mega_tensors(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``mega`` layout only: the whole K and V tensors ``[B, S, num_layers, H, D]``."""
        self._check_open()
        if self._config.layout != "mega":
            raise ConfigError("mega_tensors() needs layout='mega'")
        return self._tensor(0, -1), self._tensor(1, -1) if self._config.value_cache else None

    def layer_ptrs(self, index: int) -> Tuple[int, int]:
        """Raw virtual addresses of layer ``index``'s K and V (element [0, 0, 0, 0])."""
        cfg = self._config
        index = self._layer_index(index)
        self._check_open()  # the addresses stay reserved after close(), but nothing is behind them
        if cfg.layout == "layer":
            k = self._core.tensor_base(index)
            return k, self._core.tensor_base(cfg.num_layers + index) if cfg.value_cache else 0
        offset = index * cfg.layer_kv_heads[index] * cfg.layer_head_dims[index] * cfg.element_bytes
        return (
            self._core.tensor_base(0) + offset,
            self._core.tensor_base(1) + offset if cfg.value_cache else 0,
        )

    def host_alias(self, index: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Layer ``index`` exported as CPU tensors whatever the device.

        Only meaningful where the device memory is host memory (the host backend, or the CUDA
        driver emulation used in tests). Never use it with a real GPU. V is ``None`` with
        ``value_cache=False``.
        """
        index = self._layer_index(index)

        def alias(kv: int) -> torch.Tensor:
            return self._as_dtype(
                torch.from_dlpack(
                    self._core.export_tensor(kv, index, self._dl_code, self._dl_bits, True)
                )
            )

        return alias(0), alias(1) if self._config.value_cache else None

    # ---- slots --------------------------------------------------------------------------------
    def alloc(self, *, hits: Optional[Sequence] = None, stream=None) -> int:
        """Take a slot for a new request (an idle one that still holds pages if possible).

        Parameters
        ----------
        hits : sequence of int, or one sequence per KV cache group, optional
            Caches created with ``num_blocks``: the block ids the request's table starts with
            (its prefix-cache hits, what :meth:`step` will get as its first ``cached`` ids). The
            idle slot whose row still maps the longest run of them is taken first: :meth:`step`
            serves those hits with no map call (a shared system prompt costs nothing to map in
            the row that held it).

        stream : torch.cuda.Stream or int, optional
            With ``scrub=True``, where the pages the new request inherits are zeroed: ordered
            before the request's kernels on it. Default: the caller's current torch stream
            (:mod:`vattention.streams`).

        Raises :class:`InvalidSlotError` when all ``max_batch_size`` slots are active, and
        :class:`ConfigError` for ``hits`` on a cache not named by blocks, or a block id outside
        ``[0, num_blocks)`` (``-1``, the null block, aside); nothing changes then.
        """
        return self._core.alloc(hits, self._stream(stream))

    def free(self, slot: int, *, stream=None) -> None:
        """End the request in ``slot``. Its pages stay mapped until needed (deferred reclamation).

        On CUDA an event is recorded on ``stream`` (default: the caller's current torch stream,
        where the kernels reading the slot were queued: :mod:`vattention.streams`); the slot's
        pages are unmapped only after it has completed, so kernels still reading them are safe.
        """
        self._core.free(self._slot(slot), self._stream(stream))

    def step(
        self, seq_lens: SeqLens, *, blocks: Optional[Mapping[int, BlockUpdate]] = None, stream=None
    ) -> None:
        """Back every listed slot up to its length before the next attention call.

        Parameters
        ----------
        seq_lens : dict, sequence or 1-D tensor
            ``{slot: length}``, or ``max_batch_size`` lengths where 0 means "idle this iteration".
            Lengths are in tokens, ``0 <= length <= max_seq_len``.
        blocks : dict, optional
            Caches created with ``num_blocks`` (pages named by an engine's block ids):
            ``{slot: (start, block_ids, cached)}`` updates the block tables of listed slots.
            ``block_ids`` replace the table from page index ``start`` on (``start`` = the
            table's length appends, 0 replaces it); they are a list of ids, or one list per KV
            cache group (``layer_groups``). The first ``cached`` of them are cache hits (blocks
            whose pages exist: mapped again, zero copy; ``-1`` is the engine's null block, a
            hole, allowed only among a table's leading hits), the rest are fresh blocks. Every
            listed slot's table must name the page indices its length needs.

        Transactional: on :class:`OutOfPagesError` (attributes ``pages_needed``,
        ``pages_available``) nothing was mapped and every length is as before; preempt a request
        and retry. Pages no query can read any more may have gone back to the pool: window pages
        the step would have released, and, with engine blocks, pages no block table names any
        more (the updated tables stay recorded; a row whose replaced table dropped tokens its
        old table named has its length lowered to the tokens it still backs).

        Examples
        --------
        >>> import torch, vattention
        >>> cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64,
        ...                                max_batch_size=2, max_seq_len=1024,
        ...                                dtype=torch.float32, page_size="4KB",
        ...                                num_blocks=8, block_cache=True)
        >>> with vattention.KVCache(cfg) as cache:       # a page index holds 16 tokens
        ...     a = cache.alloc()
        ...     cache.step({a: 40}, blocks={a: (0, [5, 6, 7], 0)})    # three fresh blocks
        ...     b = cache.alloc()
        ...     cache.step({b: 36}, blocks={b: (0, [5, 6, 1], 2)})    # hits on 5 and 6
        ...     s = cache.stats()
        ...     s["block_hits"], s["pages_mapped"], s["mappings"]
        (2, 8, 12)
        """
        # The decode hot path: keep the Python side to one type check for the common dict input.
        if type(seq_lens) is not dict:
            seq_lens = _as_lens(seq_lens)
        try:
            if blocks is None:
                self._core.step(seq_lens, self._stream(stream))
            else:
                self._core.step(seq_lens, self._stream(stream), blocks)
        except (TypeError, OverflowError) as e:
            if isinstance(e, ArgumentTypeError):
                raise
            cfg = self._config
            raise _lens_error(e, seq_lens, cfg.max_batch_size, cfg.max_seq_len) from None

    def capacity(
        self, seq_lens: Optional[SeqLens] = None, *, new_requests: Sequence[int] = ()
    ) -> Capacity:
        """What :meth:`step` ``(seq_lens)`` would need, plus admitting requests of
        ``new_requests`` tokens each, and what it could get. Maps nothing, changes nothing.

        The same accounting :meth:`step` uses: pages it must map, against free pages, pages
        creatable within the budget, and reclaimable ones (idle slots, look-ahead beyond active
        lengths, window pages the step would release; a page also mapped or kept elsewhere is not
        reclaimable). Use it to admit requests or plan preemption before stepping;
        :class:`OutOfPagesError` is then left for shortfalls nobody planned for.

        Parameters
        ----------
        seq_lens : dict, sequence or 1-D tensor, optional
            As for :meth:`step` (active slots only). Default: no slot listed.
        new_requests : sequence of int
            Tokens of requests not admitted yet (each would take a slot from :meth:`alloc`).

        Examples
        --------
        >>> import torch, vattention
        >>> cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64,
        ...                                max_batch_size=4, max_seq_len=1024,
        ...                                dtype=torch.float32, page_size="4KB")
        >>> with vattention.KVCache(cfg, memory_budget="32KB") as cache:   # 8 pages
        ...     a = cache.alloc()
        ...     cache.step({a: 40})                  # 3 page indices x 2 tensors = 6 pages
        ...     cap = cache.capacity({a: 41}, new_requests=[16])
        ...     cap.pages_needed, cap.pages_short, cap.fits
        (2, 0, True)
        >>> with vattention.KVCache(cfg, memory_budget="32KB") as cache:
        ...     a = cache.alloc()
        ...     cache.step({a: 40})
        ...     cache.capacity({a: 60}, new_requests=[16]).pages_short
        2
        """
        lens = {} if seq_lens is None else seq_lens
        if type(lens) is not dict:
            lens = _as_lens(lens)
        new = [as_int(n, "new_requests") for n in new_requests]
        limit = self._config.max_seq_len
        for i, n in enumerate(new):
            if not 0 <= n <= limit:
                raise SequenceTooLongError(
                    f"new_requests[{i}]={n} is outside [0, {limit}] (max_seq_len={limit})"
                )
        try:
            c = self._core.capacity(lens, new)
        except (TypeError, OverflowError) as e:
            if isinstance(e, ArgumentTypeError):
                raise
            cfg = self._config
            raise _lens_error(e, lens, cfg.max_batch_size, cfg.max_seq_len) from None
        return Capacity(**c)

    def prefetch(self, seq_lens: SeqLens, *, lookahead_tokens: Optional[int] = None) -> None:
        """Map pages for the next iteration in the background; returns at once.

        Each listed slot is backed up to its length plus ``lookahead_tokens`` (default: the
        cache's). The next :meth:`step` waits only for a slot the thread is mapping at that moment
        and maps anything still missing itself; shortfalls are not errors here.
        """
        la = -1 if lookahead_tokens is None else as_int(lookahead_tokens, "lookahead_tokens")
        if la < -1 or (lookahead_tokens is not None and la < 0):
            raise ConfigError(f"lookahead_tokens={lookahead_tokens!r} must be >= 0")
        la = min(la, self._config.max_seq_len)  # the core caps lengths at max_seq_len anyway
        seq_lens = _as_lens(seq_lens)
        try:
            self._core.prefetch(seq_lens, la)
        except (TypeError, OverflowError) as e:
            if isinstance(e, ArgumentTypeError):
                raise
            cfg = self._config
            raise _lens_error(e, seq_lens, cfg.max_batch_size, cfg.max_seq_len) from None

    def wait(self) -> None:
        """Block until background prefetch work is done; re-raise a background driver error."""
        self._core.wait()

    # ---- physical memory ----------------------------------------------------------------------
    def reserve(self, size: Size) -> None:
        """Pre-create physical pages so the pool holds at least ``size`` bytes (e.g. ``"4GB"``).

        All or nothing: raises :class:`OutOfPagesError` (no pages kept) beyond the budget.
        """
        self._core.reserve(parse_size(size, name="size"))

    def reclaim(self) -> int:
        """Unmap the pages of every idle slot back to the pool. Returns pages unmapped."""
        return self._core.reclaim()

    def shrink(self, keep_bytes: Size = 0) -> int:
        """Give free pages back to the OS/driver until the pool holds at most ``keep_bytes``.

        Returns the number of pages destroyed. Mapped pages are never touched: call
        :meth:`reclaim` first to include idle slots' pages.
        """
        return self._core.shrink(parse_size(keep_bytes, name="keep_bytes"))

    def set_memory_budget(self, budget: Optional[Size]) -> int:
        """Change the physical memory cap at run time (``None``: no cap).

        Lowering it gives back free pages, reclaims idle slots' pages and trims look-ahead until
        under budget. Returns the bytes still over budget, which only preemption can free.
        """
        value = -1 if budget is None else parse_size(budget, name="memory_budget")
        return self._core.set_memory_budget(value)

    def set_headroom(self, size: Size) -> None:
        """Keep up to ``size`` bytes of created but free pages ready (rounded up to whole pages).

        After every :meth:`step`, :meth:`free` and :meth:`prefetch` that leaves the pool's free
        pages short of it, the background (prefetch) thread creates the missing ones, within the
        memory budget, so that a step finds them free instead of creating pages on its critical
        path (``stats()["step_pages_created"]`` counts those it still had to create). Pages are
        never created for it inside :meth:`step`. ``0`` (the default) keeps none ahead.

        Raises :class:`ConfigError` for a negative size or one beyond what the cache can ever
        hold; nothing changes then.

        Examples
        --------
        >>> import torch, vattention
        >>> cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64,
        ...                                max_batch_size=2, max_seq_len=1024,
        ...                                dtype=torch.float32, page_size="4KB")
        >>> with vattention.KVCache(cfg, memory_budget="64KB") as cache:
        ...     cache.set_headroom("16KB")                 # 4 pages ready ...
        ...     cache.wait()                               # ... once the thread made them
        ...     a = cache.alloc()
        ...     cache.step({a: 32})                        # 2 page indices x 2 tensors
        ...     cache.wait()                               # the thread refilled behind it
        ...     s = cache.stats()
        ...     s["pages_free"], s["step_pages_created"], s["background_pages_created"]
        (4, 0, 8)
        """
        self._core.set_headroom(parse_size(size, name="headroom"))

    # ---- queries ------------------------------------------------------------------------------
    def mapped_tokens(self, slot: int) -> int:
        """Token positions of ``slot`` backed by physical pages."""
        return self._core.mapped_tokens(self._slot(slot))

    def window_start(self, slot: int, layer: int) -> int:
        """First token of ``slot`` still backed on ``layer``: 0 on full-attention layers.

        On a sliding-window layer (``KVCacheConfig(sliding_window=...)``), ``step()`` released
        the pages lying wholly before the window; positions below this token read unmapped memory.
        Attention over ``[window_start, seq_len)`` with absolute positions (a mask offset, or
        FlashAttention's ``window_size``) reads only backed memory.
        """
        index = self._layer_index(layer)
        return self._core.window_starts(self._slot(slot))[index]

    def release_blocks(self, ids: Union[Iterable[int], torch.Tensor]) -> int:
        """Give the pages of engine blocks back to the pool (caches created with ``num_blocks``).

        Each listed block forgets its pages: an idle slot whose row still maps one (kept for a
        prefix hit in place) unmaps its row from the first page index that does; an active slot
        whose row maps one keeps those pages as anonymous ones (its request may still read them)
        until it unmaps them itself; the block drops its own hold (``block_cache=True``). A page
        nobody maps any more goes to the free list, where :meth:`set_memory_budget` and
        :meth:`shrink` can destroy it. A later cache hit on a released block is refused
        (:class:`ConfigError`: it holds no pages); handing its id out fresh is fine. Blocks
        without pages are skipped, and duplicates are fine.

        Unmapping is not stream-ordered on CUDA: an idle slot's row is unmapped only once the
        fence its :meth:`free` recorded has completed (the last use of the blocks it maps: free
        a slot on the stream its kernels run on). Nothing waits for work queued since, such as
        the step in flight under asynchronous scheduling: a slot freed steps ago costs no wait.

        Parameters
        ----------
        ids : sequence of int, or a 1-D integer tensor
            Block ids in ``[0, num_blocks)``; the engine's null block is not a block with pages:
            leave it out (``-1``, the core's hole, is refused like any negative id).

        Returns the number of pages that went back to the free list. Raises :class:`ConfigError`
        on a cache whose slots own their pages, and for an id outside ``[0, num_blocks)`` (naming
        it and the limit), changing nothing.

        Examples
        --------
        >>> import torch, vattention
        >>> cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64,
        ...                                max_batch_size=2, max_seq_len=1024,
        ...                                dtype=torch.float32, page_size="4KB",
        ...                                num_blocks=8, block_cache=True)
        >>> with vattention.KVCache(cfg) as cache:       # a block = 16 tokens, 2 pages
        ...     a = cache.alloc()
        ...     cache.step({a: 40}, blocks={a: (0, [5, 6, 7], 0)})
        ...     cache.free(a)                             # its blocks stay cached, mapped
        ...     cache.release_blocks([6, 7])              # the scheduler evicts two of them
        ...     cache.block_table(a), cache.stats()["blocks_with_pages"]
        4
        ([[5, 6, 7]], 1)
        """
        if isinstance(ids, torch.Tensor):
            if (
                ids.dim() != 1
                or ids.dtype.is_floating_point
                or ids.dtype.is_complex
                or ids.dtype == torch.bool
            ):
                raise ArgumentTypeError(
                    f"ids must be a 1-D integer tensor of block ids, got a {ids.dtype} tensor "
                    f"of shape {tuple(ids.shape)}"
                )
            values = ids.detach().to("cpu", torch.int64).tolist()
        else:
            if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Iterable):
                raise ArgumentTypeError(
                    f"ids must be a sequence of block ids, got {type(ids).__name__}"
                )
            values = [as_int(b, "ids[]") for b in ids]
        blocks = self._config.num_blocks
        for b in values:
            if -(2**63) <= b < 2**63:  # the core checks [0, num_blocks) itself
                continue
            if blocks is None:
                values = []  # a cache whose slots own their pages: the core refuses the call
                break
            raise ConfigError(
                f"release_blocks: block {b} is outside [0, {blocks}) (num_blocks={blocks})"
            )
        return self._core.release_blocks(values)

    def block_table(self, slot: int) -> List[List[int]]:
        """The engine block table of ``slot``: one list of block ids per KV cache group
        (``-1``: the null block), as the ``blocks`` of :meth:`step` left it. Empty without one."""
        return self._core.block_table(self._slot(slot))

    def seq_len(self, slot: int) -> int:
        """Length given for ``slot`` by the last :meth:`step` (0 after :meth:`alloc`)."""
        return self._core.seq_len(self._slot(slot))

    def active_slots(self) -> List[int]:
        """Slots currently owned by requests, ascending."""
        return self._core.active_slots()

    def stats(self) -> Dict[str, int]:
        """Counters and sizes: pages_total/free/mapped, bytes_mapped, bytes_used_by_tokens, ...

        See ``docs/guide.md`` for every key. Sizes are bytes, counts are pages or calls.
        """
        return self._core.stats()
