// SlotMemory: maps and unmaps page-index ranges of a slot, keeping the slot's record, the pool's
// references and the counters true.
//
// Why a type of its own: every path that changes what a slot maps (step's growth, reclamation,
// windows, fork, swap, close) goes through these few calls, so the record (pages, mapped, backed,
// head), the pool references and the driver-call counters can only change together. Unmapping is
// not stream-ordered (DESIGN.md section 3): an idle slot's pages are unmapped only after the fence
// its free() recorded has completed (wait_fence).
//
// Not thread-safe: callers hold the cache mutex.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/backend.h"
#include "core/block_pages.h"
#include "core/geometry.h"
#include "core/page_pool.h"
#include "core/slot.h"
#include "core/slot_mapper.h"
#include "core/stats.h"

namespace vattention {

class SlotMemory {
 public:
  SlotMemory(const CacheGeometry& geometry, Backend& backend, const SlotMapper& mapper,
             PagePool& pool, BlockPages& blocks, CacheCounters& counters)
      : geo_(geometry),
        backend_(backend),
        mapper_(mapper),
        pool_(pool),
        blocks_(blocks),
        counters_(counters) {}
  SlotMemory(const SlotMemory&) = delete;
  SlotMemory& operator=(const SlotMemory&) = delete;

  // Maps page indices [from, to) of slot `index` (from == slot.mapped) with `pages` ((to - from)
  // * columns handles taken from the pool; kNoPage entries are released window pages, a per-tensor
  // prefix, left unmapped), appends them to the record (as anonymous pages: no engine block) and
  // counts the calls (as prefetch calls when from_prefetch). On failure nothing changed: it
  // unmaps what it mapped and rethrows.
  void map(Slot& slot, int index, size_t from, size_t to, const PageHandle* pages,
           bool from_prefetch);
  // Unmaps page indices [keep, mapped) of slot `index` and releases its references (an idle
  // slot waits for its fence first). Returns the pages that reached the free list (a shared page
  // only loses a reference). On a driver error it maps back what it unmapped and rethrows, so the
  // record stays true.
  size_t unmap_tail(Slot& slot, int index, size_t keep);
  // Waits for (and drops) the fence free() recorded on the slot, counting a real wait.
  void wait_fence(Slot& slot);
  // Records a fence on `stream` and waits for it: copies queued there are done, and no kernel
  // queued before still reads what the caller is about to unmap.
  void sync_stream(uintptr_t stream);
  // Drops the slot's fence without waiting (its new owner's work is ordered after the old one's).
  void forget_fence(Slot& slot);

 private:
  const CacheGeometry& geo_;
  Backend& backend_;
  const SlotMapper& mapper_;
  PagePool& pool_;
  BlockPages& blocks_;  // told about every engine block a row stops mapping
  CacheCounters& counters_;
};

}  // namespace vattention
