"""Which vattention slot each vLLM request holds, and the counters the stats file reports."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

from ... import KVCache

__all__ = ["RequestSlots"]


class RequestSlots:
    """Request id -> slot of one :class:`~vattention.KVCache`, and the length of its block table.

    A request takes a slot the first time it is scheduled (:meth:`slot_for`) and gives it back
    when it finishes, is aborted or is preempted (:meth:`release`); a preempted request that
    resumes is recomputed from its prompt in whatever slot it gets next. :meth:`table` keeps how
    many blocks its table names (vLLM's appended blocks start there).

    Examples
    --------
    >>> import vattention
    >>> cfg = vattention.KVCacheConfig(num_layers=1, num_kv_heads=1, head_dim=64,
    ...                                max_batch_size=2, max_seq_len=64, dtype="float32",
    ...                                page_size="4KB")
    >>> with vattention.KVCache(cfg) as cache:
    ...     table = RequestSlots(cache)
    ...     a = table.slot_for("a"); b = table.slot_for("b")
    ...     table.release(["a", "never-scheduled"])
    ...     (a != b, table.slot_for("b") == b, table.held, table.peak, table.served)
    (True, True, 1, 2, 2)
    """

    def __init__(self, cache: KVCache) -> None:
        self._cache = cache
        self._slots: Dict[str, int] = {}
        self._table: Dict[str, int] = {}  # request id -> blocks its table names
        self.peak = 0  # most slots held at once
        self.served = 0  # slots handed out (a resumed request counts again)

    @property
    def held(self) -> int:
        """Slots held now."""
        return len(self._slots)

    def slot_for(
        self, req_id: str, hits: Optional[List[List[int]]] = None, stream: Any = None
    ) -> int:
        """The request's slot, allocated on its first call (``hits``: its leading prefix-cache
        hits per group, so that a row still mapping them is preferred: :meth:`KVCache.alloc`;
        ``stream``: where the engine runs its model, as :meth:`KVCache.alloc` takes it)."""
        slot = self._slots.get(req_id)
        if slot is None:
            slot = self._slots[req_id] = self._cache.alloc(hits=hits, stream=stream)
            self.served += 1
            self.peak = max(self.peak, len(self._slots))
        return slot

    def table(self, req_id: str, blocks: int = 0) -> int:
        """Blocks the request's table named before this call; it names ``blocks`` more after."""
        before = self._table.get(req_id, 0)
        self._table[req_id] = before + blocks
        return before

    def replace_table(self, req_id: str, blocks: int) -> None:
        """The request's table is a new one of ``blocks`` blocks (new or resumed requests)."""
        self._table[req_id] = blocks

    def release(self, req_ids: Iterable[str], stream: Any = None) -> None:
        """Free the slots of these requests (ids that hold none are ignored), fencing on
        ``stream``, where the engine's kernels that read them run (:meth:`KVCache.free`)."""
        for req_id in req_ids:
            self._table.pop(req_id, None)
            slot = self._slots.pop(req_id, None)
            if slot is not None:
                self._cache.free(slot, stream=stream)

    def release_all(self, stream: Any = None) -> int:
        """Free every slot still held; return how many there were."""
        held = len(self._slots)
        self.release(list(self._slots), stream)
        return held
