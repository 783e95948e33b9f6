// SlotMemory: maps and unmaps the pages of a slot's row, keeping the row's record (SlotPages),
// the pool's references and the counters true together.
//
// Why a type of its own: every path that changes what a row maps (step's growth, the prefetch
// thread's publish, reclamation, windows, fork, swap, engine block tables, close) goes through
// these few calls, so the record, the references and the driver-call counters can only change
// together. It is the only writer of SlotPages (slot.h): the mapped range, the window head, the
// read-only prefix and the free() fences. Unmapping is not stream-ordered: a row's pages are
// unmapped only after the fence its free() recorded has completed (wait_fence). The fence stays
// with the row when alloc() hands it to a new request, which inherits the old request's mappings
// while that request's last kernels may still read them: every unmapping of the row (unmap_tail,
// release_front, replace_page) waits for it first, idle or active, and drops it. A row without a
// fence costs no event query.
//
// A record kept beside the rows (an engine's block rows, block_tables.h) follows every unmapping
// through a RowObserver, so these calls need not know about it.
//
// Not thread-safe: callers hold the cache mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/geometry.h"
#include "core/page_pool.h"
#include "core/slot.h"
#include "core/slot_mapper.h"
#include "core/slot_table.h"
#include "core/stats.h"

namespace vattention {

// Told of every change to what a row maps.
class RowObserver {
 public:
  virtual ~RowObserver() = default;
  // Row `slot` now maps [0, mapped); the new page indices hold pages no block names yet.
  virtual void grown(int slot, size_t mapped) = 0;
  // Page indices [keep, mapped) of row `slot` were unmapped (the row now maps [0, keep)).
  virtual void cut(int slot, size_t keep) = 0;
  // A window released page indices [from, to) of `tensor` in row `slot`.
  virtual void released(int slot, int tensor, size_t from, size_t to) = 0;
  // An observer that keeps nothing.
  static RowObserver& none();
};

class SlotMemory {
 public:
  SlotMemory(const CacheGeometry& geometry, Backend& backend, const SlotMapper& mapper,
             PagePool& pool, SlotTable& slots, CacheCounters& counters);
  SlotMemory(const SlotMemory&) = delete;
  SlotMemory& operator=(const SlotMemory&) = delete;

  // From now on, `observer` is told of every change to a row's mapping (once, before the first).
  void observe(RowObserver& observer) { observer_ = &observer; }

  // ---- the mapped range ----------------------------------------------------------------------
  // Maps page indices [from, to) of `slot` (from == mapped) with `pages` ((to - from) * columns
  // handles taken from the pool; kNoPage entries are released window pages, a per-tensor prefix,
  // left unmapped), appends them to the record and counts the calls as the caller's (the
  // prefetch thread maps outside the lock and publishes instead). On failure nothing changed: it
  // unmaps what it mapped and rethrows.
  void map(int slot, size_t from, size_t to, const PageHandle* pages);
  // Appends [from, to) that the prefetch thread mapped outside the lock with `pages` (rule R,
  // prefetch_gate.h: nothing changed the row meanwhile, so from == mapped), counting its mapping
  // as the prefetch thread's (`driver_calls`: the VMM calls it made).
  void publish(int slot, size_t from, size_t to, const std::vector<PageHandle>& pages,
               size_t driver_calls);
  // Unmaps page indices [keep, mapped) of `slot` and releases its references (a row with a free()
  // fence waits for it first). Returns the pages that reached the free list (a shared page only
  // loses a reference). On a driver error it maps back what it unmapped and rethrows, so the record
  // stays true.
  size_t unmap_tail(int slot, size_t keep);
  // A window moves tensor t's head up to `to`: unmaps [head(t), to) of it with one call and
  // releases those pages. The caller waited for the kernels of this step's stream that may still
  // read them; a row with a free() fence waits for it too.
  void release_front(int slot, int tensor, size_t to);
  // Maps `page` (a reference the caller took, which the mapping keeps) at handle index k of
  // `slot` in place of the page there, whose reference it releases and which it returns. On a
  // driver error the old page is mapped again (each call retried once) and nothing changed. A row
  // with a free() fence waits for it first.
  PageHandle replace_page(int slot, size_t k, PageHandle page);

  // ---- finite tokens (read_tail.h) ----------------------------------------------------------
  // Tokens [0, tokens) of `slot` hold finite values from now on (tokens <= backed).
  void set_finite(int slot, int64_t tokens);

  // ---- the read-only prefix -------------------------------------------------------------------
  // Page indices [0, pages) of `slot` are read-only from now on (slot.h, SlotPages::read_only).
  void set_read_only(int slot, size_t pages);

  // "" or the first page held more than once (per `seen`: mappings and whatever else the caller
  // counted) that lies outside the read-only prefix of a row mapping it.
  std::string check_read_only(const std::map<PageHandle, uint32_t>& seen) const;

  // ---- fences ---------------------------------------------------------------------------------
  // free(): records a fence on `stream` when the row maps pages, before the row goes idle, and
  // drops the row's older fences that completed (a row reused before its fence was waited for
  // keeps the earlier one while it is pending: its pages may still be mapped).
  void fence_on_free(int slot, uintptr_t stream);
  // True while some fence of the row's free()s has not completed.
  bool fence_pending(int slot) const;
  // Waits for (and drops) the fences free() recorded on the row, counting a real wait; nothing
  // (no event query) when it has none.
  void wait_fence(int slot);
  // Drops the row's fences without waiting (the row maps nothing they guard any more, or the
  // caller waited for all of the device's work).
  void forget_fence(int slot);
  // Records a fence on `stream` and waits for it: copies queued there are done, and no kernel
  // queued before still reads what the caller is about to unmap.
  void sync_stream(uintptr_t stream);

 private:
  SlotPages& row(int slot) { return slots_.pages_of(static_cast<size_t>(slot), {}); }
  // Appends [from, to) with `pages` to the record (holes: kNoPage per-tensor prefixes).
  void append(SlotPages& s, size_t from, size_t to, const PageHandle* pages,
              const std::vector<size_t>& first);

  const CacheGeometry& geo_;
  Backend& backend_;
  const SlotMapper& mapper_;
  PagePool& pool_;
  SlotTable& slots_;
  CacheCounters& counters_;
  RowObserver* observer_ = &RowObserver::none();
};

}  // namespace vattention
