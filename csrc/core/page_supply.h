// PageSupply: where the pages of a step (or a fork, a swap-in, a prefetch) come from, and how
// mapped pages that no request needs go back.
//
// Order of supply: the pool's free list, new pages within the budget, then
// idle slots' pages (least recently freed first), then look-ahead pages of active slots beyond
// their lengths, then idle slots that hold only pages held elsewhere too (an engine's cached
// blocks: unmapping such a row frees nothing by itself, and would cost a later hit in place).
// Nothing is taken from a slot before the whole need is known to be satisfiable, so OutOfPages
// leaves every slot as it was. A page is reclaimable only if every reference to it is a reclaimable
// mapping (a page another slot maps, a swap handle or an engine block keeps, is not); while no page
// has a second reference (PagePool::extra_refs() == 0) that count is the cheap sum of mapped pages.
// The slot in flight (prefetch_gate.h, rule R) is never shrunk and its pages are never counted.
//
// Not thread-safe: callers hold the cache mutex.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/errors.h"
#include "core/geometry.h"
#include "core/page_pool.h"
#include "core/prefetch_gate.h"
#include "core/slot_memory.h"
#include "core/slot_table.h"
#include "core/stats.h"

namespace vattention {

// One slot's growth in a plan: page indices [from, to) to map.
struct Growth {
  int slot;
  size_t from;
  size_t to;
};

enum class ReclaimPolicy { Deferred, Eager };

class PageSupply {
 public:
  PageSupply(const CacheGeometry& geometry, PagePool& pool, const SlotTable& slots,
             const PrefetchGate& gate, SlotMemory& memory, CacheCounters& counters,
             ReclaimPolicy policy);
  PageSupply(const PageSupply&) = delete;
  PageSupply& operator=(const PageSupply&) = delete;

  ReclaimPolicy policy() const { return policy_; }
  // Gets n pages (refcount 1): free list, new pages within the budget, then idle slots (LRU),
  // then (allow_trim) look-ahead of active slots outside `plan`. Throws OutOfPages (nothing
  // changed) if impossible, naming the numbers.
  std::vector<PageHandle> obtain(size_t n, const std::vector<Growth>& plan, bool allow_trim);
  // Pages obtain() could take from slots without changing any slot in `plan` or below a length.
  // `lens` (optional, a step's lens vector): the lengths step() will have set by then, for a
  // read-only estimate before the step (capacity()).
  size_t spare(const std::vector<Growth>& plan, bool allow_trim,
               const std::vector<int64_t>* lens = nullptr) const;
  // Unmaps idle pages (LRU), then look-ahead (allow_trim), then idle rows whose every page is
  // held elsewhere too, until n reached the free list or none is left. Returns the pages that
  // reached it.
  size_t release_spare(size_t n, const std::vector<Growth>& plan, bool allow_trim);
  // Eager policy: a freed slot's pages go back as soon as its fence completes.
  void queue_eager(int slot) { eager_pending_.push_back(slot); }
  bool eager_pending() const { return !eager_pending_.empty(); }
  // Unmaps the queued slots whose fence has completed (and that are not in flight).
  void drain_eager();
  void forget_eager() { eager_pending_.clear(); }
  // The OutOfPages error every caller raises, with pages_needed and pages_available.
  Error out_of_pages(size_t needed, size_t available) const;

 private:
  size_t freeable_spare(const std::vector<Growth>& plan, bool allow_trim,
                        const std::vector<int64_t>* lens) const;
  // Page indices of slot i that trimming must keep: its length's read end (the larger length
  // with `lens`).
  size_t keep_pages(size_t i, const std::vector<int64_t>* lens) const;

  const CacheGeometry& geo_;
  PagePool& pool_;
  const SlotTable& slots_;
  const PrefetchGate& gate_;
  SlotMemory& memory_;
  CacheCounters& counters_;
  const ReclaimPolicy policy_;
  std::vector<int> eager_pending_;  // eager policy: freed slots whose fence had not completed
};

}  // namespace vattention
